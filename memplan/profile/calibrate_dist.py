"""Multi-rank calibration worker, started by ``memplan calibrate --nproc N`` through torchrun.

Every rank runs the same grid (``memplan.calibrate.grid.parallel_grid``): FSDP2 and tensor
parallel layouts of the reference model, built and stepped by ``memplan.profile.distributed``
(``trace_rank``, real tensors). On CPU the process group is gloo and the exact tracker measures
each rank; on CUDA it is NCCL, each rank on its own device, and the caching allocator is read per
phase as in the single-process grid, plus device used minus reserved (context and NCCL buffers)
and the growth over the process group's initialisation and first all-reduce (``nccl_bytes``).
Rank 0 gathers every rank's measures and writes one record per point, atomically, then prints
one JSON line per point for the parent's progress bar.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from memplan.calibrate.grid import Point, parallel_grid
from memplan.calibrate.records import Meta, RankMeasure, Record, finished_keys, write_record
from memplan.profile.calibrate_run import PhaseClock, make_meta, steps_of


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def init(device: str) -> int | None:
    """Start the process group; on CUDA return the device-used growth it caused."""
    if device == "cpu":
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    before = _used()
    dist.init_process_group("nccl", timeout=timedelta(minutes=10),
                            device_id=torch.device("cuda", local))
    probe = torch.ones(1, device="cuda")
    dist.all_reduce(probe)
    torch.cuda.synchronize()
    return _used() - before


def measure_rank(point: Point, device: str, steps: int, nccl: int | None) -> RankMeasure | str:
    """This rank's measures of one point, or the out-of-memory message."""
    from memplan.profile.distributed import trace_rank

    clock = PhaseClock(cuda=device == "cuda")
    try:
        with torch.device(device):
            traced = trace_rank(point.spec, point.layout, point.workload, steps=steps,
                                fake=False, device=device,
                                on_model=lambda _model, tracker: clock.attach(tracker))
        clock.close()
    except (torch.cuda.OutOfMemoryError, MemoryError) as err:
        return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return RankMeasure(rank=dist.get_rank(), nccl_bytes=nccl,
                       steps=steps_of(point, clock, None if device == "cuda" else traced))


def _record(point: Point, meta: Meta, measures: list[RankMeasure | str]) -> Record:
    errors = [m for m in measures if isinstance(m, str)]
    common = {"kind": "grid", "key": point.key, "spec": point.spec, "layout": point.layout,
              "workload": point.workload, "meta": meta}
    if errors:
        return Record(status="oom", error=errors[0], **common)
    return Record(status="ok", ranks=sorted(measures, key=lambda m: m.rank), **common)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="memplan.profile.calibrate_dist")
    parser.add_argument("--folder", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--gpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    nccl = init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    shared: list = [None, None]
    if rank == 0:
        shared = [make_meta(args.device, args.command, args.gpu, num_devices=world),
                  finished_keys(args.folder) if args.resume else set()]
    dist.broadcast_object_list(shared, src=0)
    meta, done = shared
    try:
        for point in parallel_grid(args.device, world, quick=args.quick):
            if point.key in done:
                if rank == 0:
                    print(json.dumps({"key": point.key, "status": "skipped"}), flush=True)
                continue
            mine = measure_rank(point, args.device, args.steps, nccl)
            gathered: list | None = [None] * world if rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            if rank == 0:
                rec = _record(point, meta, gathered)  # type: ignore[arg-type]
                write_record(args.folder, rec)
                print(json.dumps({"key": point.key, "status": rec.status}), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    from memplan.profile.distributed import leave_rank

    leave_rank()  # past the last record: no interpreter teardown for gloo's threads to race
