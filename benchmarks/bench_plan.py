"""How fast `memplan plan` searches: wall time in process and as a command, and how much.

Not a test: run it by hand, from the repository root, on an idle machine::

    .venv/bin/python benchmarks/bench_plan.py [--runs 7]

For each case it prints the median over fresh interpreters of: the first ``memplan.plan`` call
(imports and the model and GPU lookups done, the search's caches empty), a second call in the
same interpreter, the first call with ``top=10`` (the command's default: only recompute
policies that could reach the ten fastest are searched) and the whole ``memplan plan ...
--json`` command; then the candidates the full search covered ((layout, recompute policy,
micro-batch) triples), the exact evaluations of the most loaded rank it needed (and with
``top=10``), and the candidates that fit. First, the start-up every command pays before it
searches: a fresh interpreter importing the CLI and numpy.

Targets (issue): the full search for llama-3.1-405b on 16,384 H100s at seq 8192 under 2 s
wall on a 2-core machine; a 7B model on 8 GPUs under 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = [
    ("llama-2-7b", 8, {"seq_len": 4096}),
    ("llama-3.1-405b", 16384, {"seq_len": 8192, "global_batch_size": 2048}),
    # a mixture of experts: ep and etp searched beside the dense degrees
    ("mixtral-8x7b", 64, {"seq_len": 4096, "global_batch_size": 256}),
    # hybrids (Mamba-2 and attention layers, and MoE in granite): the reserved check's
    # allocator replays dominate (the command's defaults otherwise)
    ("falcon-h1-34b", 64, {}),
    ("granite-4.0-h-small", 64, {}),
]

# One fresh interpreter: the first and a second plan() call, timed after the imports.
IN_PROCESS = """
import json, sys, time
import memplan, memplan.planning.planner
model, gpus, fields = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
memplan.load_model(model), memplan.load_gpu("h100-sxm")
top = json.loads(sys.argv[4])
times = []
for _ in range(1 if top else 2):
    start = time.perf_counter()
    result = memplan.plan(model, gpus=gpus, top=top, **fields)
    times.append(time.perf_counter() - start)
print(json.dumps({"times": times, "searched": result.searched, "evaluated": result.evaluated,
                  "feasible": len(result.candidates)}))
"""


def in_process(model: str, gpus: int, fields: dict, top: int | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, model, str(gpus), json.dumps(fields),
                          json.dumps(top)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def command(model: str, gpus: int, fields: dict) -> float:
    exe = Path(sys.executable).with_name("memplan")
    argv = [str(exe), "plan", "--model", model, "--gpus", str(gpus), "--json"]
    if "seq_len" in fields:
        argv += ["--seq", str(fields["seq_len"])]
    if "global_batch_size" in fields:
        argv += ["--gbs", str(fields["global_batch_size"])]
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - start


def start_up() -> float:
    """Wall time of a fresh interpreter importing what the command imports before it searches
    (the CLI, hence pydantic and typer, and numpy): the floor under any command's time."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import memplan.cli, memplan.planning.planner"],
                   check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    print(f"median of {runs} runs each; candidates: (layout, recompute, micro-batch) searched")
    print(f"{'case':26} {'first call':>10} {'second':>8} {'top 10':>8} {'command':>8} "
          f"{'candidates':>11} {'evaluated':>10} {'(top 10)':>9} {'fit':>5}")
    floor = statistics.median(start_up() for _ in range(runs))
    print(f"start-up (interpreter + imports, no search): {floor:.3f}s")
    for model, gpus, fields in CASES:
        results = [in_process(model, gpus, fields) for _ in range(runs)]
        first = statistics.median(r["times"][0] for r in results)
        second = statistics.median(r["times"][1] for r in results)
        tops = [in_process(model, gpus, fields, 10) for _ in range(runs)]
        top = statistics.median(r["times"][0] for r in tops)
        wall = statistics.median(command(model, gpus, fields) for _ in range(runs))
        r = results[0]
        print(f"{model + ' on ' + str(gpus):26} {first:9.3f}s {second:7.3f}s {top:7.3f}s "
              f"{wall:7.3f}s {r['searched']:11,d} {r['evaluated']:10,d} "
              f"{tops[0]['evaluated']:9,d} {r['feasible']:5,d}")


if __name__ == "__main__":
    main()
