"""What ``MemoryMonitor.step()`` costs next to a training step.

    python benchmarks/bench_monitor.py [--steps 300]

Runs a small MLP's training step (forward, backward, AdamW) on CUDA when available, else CPU,
and times: the step alone, the step followed by ``monitor.step()``, and ``monitor.step()``
alone. On CUDA the monitor reads ``torch.cuda.memory_stats`` and the process's memory (its
default reader); on CPU it reads the process's memory and a dict shaped like the allocator's
(~80 counters), so the JSON encoding, the file write and the trend windows are the same.
The overhead is the median ``monitor.step()`` time over the median step time. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def main() -> None:
    import torch

    from memplan.monitor import MemoryMonitor
    from memplan.monitor.readers import cuda_reader, default_reader, host_reader

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    width = 512
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, width, device=device)

    def train_step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(10):
        train_step()
    reader = default_reader() if cuda_reader() is not None else None
    if reader is None:
        fake = {f"counter_{i}": i for i in range(80)}
        fake.update(allocated_bytes=1 << 30, reserved_bytes=1 << 31, peak_bytes=1 << 30,
                    capacity_bytes=80 << 30)
        host = host_reader()

        def reader() -> dict[str, int]:  # the allocator's shape, and the process's memory
            return {**fake, **host()}
    with tempfile.TemporaryDirectory() as out:
        mon = MemoryMonitor(out, rank=0, reader=reader)
        plain, calls = [], []
        with mon:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                train_step()
                t1 = time.perf_counter()
                mon.step()
                t2 = time.perf_counter()
                plain.append(t1 - t0)
                calls.append(t2 - t1)
    step_s, call_s = statistics.median(plain), statistics.median(calls)
    print(json.dumps({"device": device, "torch": torch.__version__, "steps": args.steps,
                      "median_step_s": step_s, "median_monitor_step_s": call_s,
                      "p99_monitor_step_s": sorted(calls)[int(0.99 * len(calls))],
                      "overhead_pct": 100 * call_s / step_s, "errors": mon.errors}, indent=2))


if __name__ == "__main__":
    main()
