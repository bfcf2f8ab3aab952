"""How much work memplan does, in instructions: the same count whatever the machine's load.

Wall-clock benchmarks (``bench_estimate.py``, ``bench_plan.py``) need an idle machine; on a
shared 2-core one their spread hides a 10% change. This script runs the same work under
valgrind's callgrind, which counts the instructions the interpreter executes: repeatable for
the same code, interpreter and inputs. Not a test: run it by hand (valgrind must be installed),
optionally against another checkout of memplan::

    python benchmarks/bench_instructions.py                 # this checkout
    python benchmarks/bench_instructions.py --tree /tmp/old # another one, same interpreter

What it counts (each a fresh interpreter):

- ``import memplan``;
- per estimate: (instructions with 2N estimates - instructions with none) / 2N, over N
  estimates of llama-7b on 64 GPUs and N of a mixed grid (2 models, mbs, tp 1-8, pp 1-4,
  ZeRO 0-3), as ``bench_estimate.py`` runs them;
- per new configuration: 192 configurations none of which was asked before (llama-7b,
  llama-3-70b and Mixtral 8x7B; mbs 1, 4; tp 1, 2, 8; pp 1, 2, 4; ZeRO 0, 1, 3; recompute
  none, full), each asked once, after every module of the model and the planning imported and
  other models' estimates made (so that neither a module's first import nor a first
  estimate's set-up is counted; ``NEW``), through ``memplan.estimate``, and the same
  configurations asked again with the result cache (``cached_estimate``, where the checkout
  has one) cleared: the per-layout caches warm, as in a sweep; and the model alone
  (``memplan.model.estimate.estimate`` on inputs built before), first and again. The other
  figure above (``WORK``) repeats four llama-7b configurations, which a result cache answers;
- the cold commands ``memplan estimate --model llama-7b --gpus 64`` and ``... --json``;
- with ``--plan MODEL:GPUS`` (repeatable), per case: the first ``memplan.plan(MODEL,
  gpus=GPUS, top=10)`` in process (instructions with the call - without it, the model and
  GPU looked up in both), the same with ``reserved=False`` (the search alone), and the cold
  commands ``memplan plan --model MODEL --gpus GPUS --json`` and ``memplan estimate ...``.

With ``PYTHONDONTWRITEBYTECODE=1`` (as on some machines) every count includes compiling
memplan's sources; the script reports whether it is set.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

WORK = """
import itertools, sys
import memplan
n = int(sys.argv[1])
grid = list(itertools.product(["llama-7b", "llama-3-70b"], [1, 2, 4, 8], [1, 2, 4, 8],
                              [1, 2, 4], [0, 1, 2, 3]))
memplan.estimate("llama-7b", gpus=64)
for i in range(n):
    memplan.estimate("llama-7b", gpus=64, micro_batch_size=1 + i % 4)
for model, mbs, tp, pp, zero in grid[:n]:
    memplan.estimate(model, gpus=8 * tp * pp, tp=tp, pp=pp, zero=zero, micro_batch_size=mbs)
"""


# One fresh interpreter: argv[1] "none" (the set-up alone), "api" (each new configuration
# once through memplan.estimate), "api2" (then again, the result cache cleared), "inputs"
# (the set-up and the configurations' typed inputs), "model" and "model2" (then the model's
# own estimate of each, once and twice).
NEW = """
import importlib, itertools, pkgutil, sys
import memplan
from memplan.api import resolve
from memplan.model import estimate as E
mode = sys.argv[1]
gpu = memplan.load_gpu("h100-sxm")
models = ["llama-7b", "llama-3-70b", "mixtral-8x7b"]
for m in models:
    memplan.load_model(m)
grid = list(itertools.product(models, [1, 4], [1, 2, 8], [1, 2, 4], [0, 1, 3],
                              ["none", "full"]))[:192]
for name in ("memplan.model", "memplan.planning"):
    try:
        package = importlib.import_module(name)
    except ModuleNotFoundError:  # (a checkout before the planning package)
        continue
    for info in pkgutil.iter_modules(package.__path__, name + "."):
        importlib.import_module(info.name)
for model in ("gpt2", "qwen1.5-moe-a2.7b"):
    for zero, pp, rc in itertools.product((0, 1, 3), (1, 2), ("none", "full")):
        memplan.estimate(model, gpus=8 * pp, tp=2, pp=pp, zero=zero, recompute=rc)
kw = [dict(gpus=8 * tp * pp, tp=tp, pp=pp, zero=zero, micro_batch_size=mbs, recompute=rc)
      for _, mbs, tp, pp, zero, rc in grid]
inputs = ([resolve(m, **k) for (m, *_), k in zip(grid, kw)]
          if mode.startswith(("model", "inputs")) else [])
for _ in range(2 if mode.endswith("2") else 0 if mode in ("none", "inputs") else 1):
    if mode.startswith("api"):
        for (m, *_), k in zip(grid, kw):
            memplan.estimate(m, **k)
        if hasattr(E, "cached_estimate"):
            E.cached_estimate.cache_clear()
    else:
        for spec, par, wl in inputs:
            E.estimate(spec, gpu, par, wl)
"""
NEW_COUNT = 192


def new_rows(tree: Path) -> list[tuple[str, int]]:
    """Per new configuration (``NEW``): through the API and the model alone, first and again."""
    count = {mode: instructions(["-c", NEW, mode], tree)
             for mode in ("none", "api", "api2", "inputs", "model", "model2")}
    return [
        ("per new configuration, memplan.estimate", (count["api"] - count["none"]) // NEW_COUNT),
        ("  the same again, result cache cleared", (count["api2"] - count["api"]) // NEW_COUNT),
        ("  the model alone, first", (count["model"] - count["inputs"]) // NEW_COUNT),
        ("  the model alone, again", (count["model2"] - count["model"]) // NEW_COUNT),
    ]


# One fresh interpreter: the model and GPU looked up, then (argv[3] != "none") one plan.
PLAN = """
import sys
import memplan, memplan.planning.planner
model, gpus, reserved = sys.argv[1], int(sys.argv[2]), sys.argv[3]
memplan.load_model(model), memplan.load_gpu("h100-sxm")
if reserved != "none":
    memplan.plan(model, gpus=gpus, top=10, reserved=reserved == "reserved")
"""


def plan_rows(case: str, tree: Path, commands: bool = True) -> list[tuple[str, int]]:
    """Instruction counts of one ``MODEL:GPUS`` plan (``--plan``), each printed as counted."""
    model, gpus = case.split(":")
    script = ["-c", PLAN, model, gpus]
    base = instructions([*script, "none"], tree)
    cli = ["-m", "memplan"]
    runs = [(f"{model} x {gpus}: first plan(top=10)", [*script, "reserved"], base),
            (f"{model} x {gpus}: first plan(top=10, reserved=False)", [*script, "search"], base)]
    if commands:
        runs += [(f"{model} x {gpus}: cold `memplan plan ... --json`",
                  [*cli, "plan", "--model", model, "--gpus", gpus, "--json"], 0),
                 (f"{model} x {gpus}: cold `memplan estimate`",
                  [*cli, "estimate", "--model", model, "--gpus", gpus], 0)]
    rows = []
    for name, args, less in runs:
        rows.append((name, instructions(args, tree) - less))
        print(f"  {name:<55} {rows[-1][1]:>15,} instructions", flush=True)
    return rows


def instructions(args: list[str], tree: Path) -> int:
    """Instructions callgrind counts for ``python ARGS`` with ``tree`` first on the path."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                          sys.executable, *args], cwd=tree, env=env, capture_output=True,
                         text=True, check=True)
    found = re.search(r"Collected\s*:\s*(\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count: {out.stderr[-500:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the checkout whose memplan is measured (default: this one)")
    parser.add_argument("-n", type=int, default=300, help="estimates of each kind (300)")
    parser.add_argument("--plan", action="append", default=[], metavar="MODEL:GPUS",
                        help="also count plans of MODEL on GPUS (repeatable)")
    parser.add_argument("--plans-only", action="store_true",
                        help="count the --plan cases only")
    parser.add_argument("--no-commands", action="store_true",
                        help="count the --plan cases in process only")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    tree = args.tree.resolve()
    rows: list[tuple[str, int]] = []
    for case in args.plan:
        rows += plan_rows(case, tree, not args.no_commands)
    if args.plans_only:
        return 0
    script = ["-c", WORK]
    base = instructions([*script, "0"], tree)
    loaded = instructions([*script, str(args.n)], tree)
    rows = [
        *rows,
        ("import memplan", instructions(["-c", "import memplan"], tree)),
        ("per estimate (mean of the two kinds)", (loaded - base) // (2 * args.n)),
        *new_rows(tree),
        ("cold `memplan estimate --model llama-7b --gpus 64`",
         instructions(["-m", "memplan", "estimate", "--model", "llama-7b", "--gpus", "64"],
                      tree)),
        ("cold `... --json`", instructions(["-m", "memplan", "estimate", "--model", "llama-7b",
                                            "--gpus", "64", "--json"], tree)),
    ]
    return _show(tree, rows)


def _show(tree: Path, rows: list[tuple[str, int]]) -> int:
    print(f"memplan at {tree}; PYTHONDONTWRITEBYTECODE="
          f"{os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}")
    for name, count in rows:
        print(f"  {name:<55} {count:>15,} instructions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
