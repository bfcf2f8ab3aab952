"""Make the example plots of docs/profiling.md from real runs on this machine's CPU (docs/images/).

    python benchmarks/docs_plots.py [docs/images]

- ``timeline.png``: ``memplan profile`` of GPT-2 cut to 4 layers, real CPU tensors under the
  exact tracker, 3 steps, with the estimate's phase peaks.
- ``trace.png``: ``memplan analyze-trace --plot`` of the committed 2-process gloo DDP traces
  (tests/data/traces/gloo_2rank, rank 1 lagging 40 ms a step).
- ``monitor.png``: ``memplan monitor-summary --plot`` of a 2-process gloo DDP run made here:
  an MLP trained 150 steps with a ``MemoryMonitor`` on each rank (the default reader: the
  process's resident set and the host's memory); from step 50 rank 1 keeps each step's output
  in a list "for logging" (4 MiB a step that is never freed).
- ``estimate.png``: ``memplan estimate --plot`` of Llama-2-7B on 8 H100s, tp 2 and pp 4.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _memplan(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "memplan", *args], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)


def _leaky_rank(rank: int, world: int, out: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    from memplan.monitor import MemoryMonitor

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024),
                                                                 torch.nn.ReLU())])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    kept = []
    with MemoryMonitor(out) as monitor:
        for step in range(1, 151):
            out = ddp(torch.randn(1024, 1024))
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
            if rank == 1 and step >= 50:
                kept.append(out)  # the bug: a float of it was meant
            monitor.step()
    dist.destroy_process_group()
    from memplan.profile.distributed import leave_rank

    leave_rank()  # the monitor's files are closed: no teardown for gloo's threads to race


def monitor_run(out: Path) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_leaky_rank, args=(r, 2, str(out), 29611)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit("a monitored rank failed")


def main() -> None:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "images")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        prof = Path(tmp) / "prof"
        _memplan("profile", "-m", "gpt2", "--layers", "4", "--real", "--seq", "512", "--mbs",
                 "4", "--steps", "3", "--out", str(prof))
        shutil.copy(prof / "timeline.png", dest / "timeline.png")
        mem = Path(tmp) / "mem"
        monitor_run(mem)
        _memplan("monitor-summary", str(mem), "--plot", str(dest / "monitor.png"))
    traces = sorted((ROOT / "tests" / "data" / "traces" / "gloo_2rank").glob("rank*.json.gz"))
    _memplan("analyze-trace", *map(str, traces), "--plot", str(dest / "trace.png"))
    _memplan("estimate", "-m", "llama-2-7b", "-n", "8", "--tp", "2", "--pp", "4", "--gpu",
             "h100-sxm", "--seq", "4096", "--gbs", "64", "--plot", str(dest / "estimate.png"))
    for p in sorted(dest.glob("*.png")):
        print(f"{p}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
