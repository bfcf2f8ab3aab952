"""Write the chrome traces of real 2-process gloo runs (DDP, CPU) for ``memplan analyze-trace``.

    python benchmarks/gloo_trace.py tests/data/traces/gloo_2rank
    python benchmarks/gloo_trace.py /tmp/lag --runs 0:0,1:60,0:150 --steps 6

Each rank trains a small MLP under DistributedDataParallel (``--buckets`` gradient buckets, so
several all-reduces run at once in backward) inside ``torch.profiler.profile`` (CPU activity),
marks each step ``ProfilerStep#N`` and writes ``<run>/rank<N>.json.gz`` (``<run>`` is the output
folder itself without ``--runs``, where rank 1 lags ``--lag-ms``). A run ``R:L`` makes
rank R compute L ms of extra matmuls before each forward (a deliberate straggler), so the
other ranks wait for it in the gradient all-reduces; ``--runs`` lists runs made one after the
other in the same process group, each profiled on its own after two warm-up steps. With
``--idle-ms`` every rank also sleeps before each forward, as a job waiting for its data does.

The truth, on clocks every rank shares (``time.monotonic_ns``: CLOCK_MONOTONIC, one clock for
all processes of a Linux host), goes to ``<run>/truth.json``: per step and rank, the moment the
rank's last gradient was accumulated (its backward compute done; from then on it waits for
the reduction), the moment ``backward()`` returned, and the step's start and end. A rank's exposed wait in a step is the
latest rank's ready moment less its own (``exposed_wait_truth``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

WIDTH = 512


def _busy(seconds: float) -> None:
    import torch

    a = torch.randn(256, 256)  # about a millisecond a product: few trace events
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, a)


def _model(buckets: int) -> tuple[Any, Any, list[Any]]:
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(buckets)]
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.ReLU())])
    # one layer per bucket: its 1 MiB of fp32 weights and 2 KiB of bias reach the 1 MiB cap
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), list(model.parameters())


def _run(rank: int, out: Path, steps: int, lag_rank: int, lag_ms: float,
         buckets: int, idle_ms: float) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    ddp, opt, params = _model(buckets)
    ready: list[int] = []
    hooks = [p.register_post_accumulate_grad_hook(
        lambda _p: ready.append(time.monotonic_ns())) for p in params]

    def step() -> dict[str, int]:
        start = time.monotonic_ns()
        x = torch.randn(64, WIDTH)
        time.sleep(idle_ms / 1000)  # every rank: waiting for its data
        if rank == lag_rank:
            _busy(lag_ms / 1000)
        ready.clear()
        ddp(x).square().mean().backward()
        done = time.monotonic_ns()
        opt.step()
        opt.zero_grad()
        return {"start_ns": start, "ready_ns": max(ready), "backward_done_ns": done,
                "end_ns": time.monotonic_ns()}

    step()  # warm-up: DDP rebuilds its buckets after the first iteration and broadcasts
    step()  # them in the second one's forward
    truth = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(1, steps + 1):
            with record_function(f"ProfilerStep#{k}"):
                truth.append({"step": k, **step()})
    for h in hooks:
        h.remove()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{rank}.json"
    prof.export_chrome_trace(str(path))
    with path.open("rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    (out / f"truth_rank{rank}.json").write_text(json.dumps(truth))


def worker(rank: int, world: int, out: str, steps: int, runs: list[tuple[int, float]],
           store: str, buckets: int, idle_ms: float, named: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank: the ranks do not fight over the CPUs
    # a file store in the output folder: no TCP port to find free (or to race another job for)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for i, (lag_rank, lag_ms) in enumerate(runs):
        where = Path(out) / run_name(i, lag_rank, lag_ms) if named else Path(out)
        _run(rank, where, steps, lag_rank, lag_ms, buckets, idle_ms)
        dist.barrier()
    dist.destroy_process_group()
    from memplan.profile.distributed import leave_rank

    leave_rank()  # everything is written: no teardown for gloo's threads to race


def run_name(index: int, lag_rank: int, lag_ms: float) -> str:
    return f"run{index}_rank{lag_rank}_lag{lag_ms:g}ms"


def read_truth(run_dir: Path) -> dict[int, list[dict[str, int]]]:
    """Per rank, per step: ``start_ns``, ``ready_ns``, ``backward_done_ns`` and ``end_ns``
    (see the module docstring)."""
    return {int(p.stem.removeprefix("truth_rank")): json.loads(p.read_text())
            for p in sorted(run_dir.glob("truth_rank*.json"))}


def exposed_wait_truth(truth: dict[int, list[dict[str, int]]]) -> dict[int, float]:
    """Per rank, microseconds spent waiting for a later rank: in each step, the latest rank's
    ready moment less this rank's, summed over steps (shared clock)."""
    out = {r: 0.0 for r in truth}
    for rows in zip(*truth.values(), strict=True):
        latest = max(row["ready_ns"] for row in rows)
        for rank, row in zip(truth, rows, strict=True):
            out[rank] += (latest - row["ready_ns"]) / 1000
    return out


def _parse_runs(text: str) -> list[tuple[int, float]]:
    runs = []
    for item in text.split(","):
        rank, _, lag = item.partition(":")
        runs.append((int(rank), float(lag)))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lag-ms", type=float, default=40.0,
                    help="the lag of rank 1 when --runs is not given")
    ap.add_argument("--runs", default=None, help="RANK:LAG_MS,... one run each")
    ap.add_argument("--buckets", type=int, default=3)
    ap.add_argument("--idle-ms", type=float, default=20.0,
                    help="every rank sleeps this long before each forward (a data wait)")
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    store = Path(args.out).resolve() / ".gloo_store"
    store.unlink(missing_ok=True)  # a file store left by an earlier launch would be reused
    import multiprocessing as mp

    runs = _parse_runs(args.runs) if args.runs else [(1, args.lag_ms)]
    # spawned workers import torch; this process does not need to
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(rank, args.world, args.out, args.steps, runs,
                                               str(store), args.buckets, args.idle_ms,
                                               args.runs is not None))
             for rank in range(args.world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode]
    if failed:
        raise SystemExit(f"a worker failed (exit codes {failed})")


if __name__ == "__main__":
    main()
