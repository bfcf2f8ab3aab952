"""Write the chrome traces of a real 2-process gloo run (DDP, CPU) for ``memplan analyze-trace``.

    python benchmarks/gloo_trace.py tests/data/traces/gloo_2rank

Each rank trains a small MLP under DistributedDataParallel for ``--steps`` steps inside
``torch.profiler.profile`` (CPU activity), marks each step ``ProfilerStep#N`` and writes
``rank<N>.json.gz``. Rank 1 computes ``--lag-ms`` of extra matmuls before each forward (a
deliberate straggler), so rank 0 waits for it in every gradient all-reduce.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import time
from pathlib import Path


def _busy(seconds: float) -> None:
    import torch

    a = torch.randn(128, 128)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, a)


def worker(rank: int, world: int, out: str, steps: int, lag_ms: float, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(steps):
            with record_function(f"ProfilerStep#{k}"):
                x = torch.randn(64, 256)
                if rank == 1:
                    _busy(lag_ms / 1000)
                ddp(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    path = Path(out) / f"rank{rank}.json"
    prof.export_chrome_trace(str(path))
    with path.open("rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lag-ms", type=float, default=20.0)
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(2, args.out, args.steps, args.lag_ms, args.port), nprocs=2)


if __name__ == "__main__":
    main()
