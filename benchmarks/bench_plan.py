"""How fast `memplan plan` searches: wall time in process and as a command.

Not a test: run it by hand, from the repository root::

    .venv/bin/python benchmarks/bench_plan.py

Targets (issue): the full search for llama-3.1-405b on 16,384 H100s at seq 8192 under 2 s
wall on a 2-core machine; a 7B model on 8 GPUs under 0.5 s.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = [
    ("llama-2-7b", 8, dict(seq_len=4096)),
    ("llama-3.1-405b", 16384, dict(seq_len=8192, global_batch_size=2048)),
]


def in_process(model: str, gpus: int, fields: dict, runs: int = 3) -> tuple[float, int, int]:
    import memplan

    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = memplan.plan(model, gpus=gpus, **fields)
        times.append(time.perf_counter() - start)
    assert result is not None
    return statistics.median(times), result.evaluated, len(result.candidates)


def command(model: str, gpus: int, fields: dict, runs: int = 3) -> float:
    exe = Path(sys.executable).with_name("memplan")
    argv = [str(exe), "plan", "--model", model, "--gpus", str(gpus), "--json",
            "--seq", str(fields["seq_len"])]
    if "global_batch_size" in fields:
        argv += ["--gbs", str(fields["global_batch_size"])]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    print(f"{'case':32} {'in-process':>11} {'command':>9} {'estimates':>10} {'feasible':>9}")
    for model, gpus, fields in CASES:
        inproc, evaluated, feasible = in_process(model, gpus, fields)
        wall = command(model, gpus, fields)
        print(f"{model + ' on ' + str(gpus):32} {inproc:10.3f}s {wall:8.3f}s {evaluated:10,d} "
              f"{feasible:9,d}")


if __name__ == "__main__":
    main()
