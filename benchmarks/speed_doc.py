"""The measured tables of ``docs/speed.md``: cold start, in-process rates and plan times.

Not a test: run it by hand on an idle machine, from the repository root::

    .venv/bin/python benchmarks/speed_doc.py            # measure and rewrite the tables
    .venv/bin/python benchmarks/speed_doc.py --print    # measure and print them only
    .venv/bin/python benchmarks/speed_doc.py --only in-process  # that table alone

The prose of the doc is written by hand around the tables this script writes between
``<!-- table:NAME -->`` and ``<!-- end -->`` markers (wall times vary from run to run, so
there is no ``--check``). memplan's bytecode is compiled first, as an installed package has it.
What it measures, each in fresh interpreters where a start is part of the figure:

- ``cold``: the command ``memplan estimate --model llama-7b --gpus 64`` (table and ``--json``)
  against the bare import of its third-party dependencies (``import pydantic, typer, rich``),
  run alternately; the ratio is the median of the per-pair ratios.
- ``in-process``: ``memplan.estimate`` over the mixed grid of ``bench_estimate.py`` (768
  configurations), asked again (answered from the result cache) and each configuration once
  per pass (the result cache cleared before every pass; the per-layout and stage-walk caches
  stay warm, as in a sweep), ``memplan.model.estimate.estimate`` on pre-built inputs, and
  both as the first pass in a fresh interpreter (``bench_estimate.first_pass``: the catalogs
  loaded, every cache of the estimate empty; median of ``--runs`` interpreters).
- ``plan-catalog``: ``memplan.plan`` (``top=10``, the command's default) for every catalog
  model at its natural scale (``natural_gpus``): the first call in a fresh interpreter after
  the imports and the model and GPU lookups (every cache of the search empty), the exact
  evaluations it needed, and the whole ``memplan plan`` command against a cold ``memplan
  estimate`` of the same model and GPUs (medians of ``--runs``).
"""

from __future__ import annotations

import argparse
import compileall
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_estimate import (  # noqa: E402  (after the path set-up)
    CLI_ARGS,
    api_step,
    child_env,
    cli_command,
    core_step,
    first_pass,
    grid,
    machine_info,
    rate,
)

DOC = ROOT / "docs" / "speed.md"
MODELS = ROOT / "model_specs" / "models"

# The scale each catalog model is planned at: 8 GPUs (one node) below 15B parameters, 64 below
# 150B, 2,048 above (DeepSeek-V3 was trained on 2,048 H800s: DeepSeek-AI 2024, section 3.1).
TABLES = ("cold", "in-process", "plan-catalog")
NATURAL = ((15e9, 8), (150e9, 64), (float("inf"), 2048))

PLAN_CHILD = """
import json, sys, time
import memplan, memplan.planning.planner
model, gpus = sys.argv[1], int(sys.argv[2])
memplan.load_model(model), memplan.load_gpu("h100-sxm")
start = time.perf_counter()
result = memplan.plan(model, gpus=gpus, top=10)
print(json.dumps({"s": time.perf_counter() - start, "evaluated": result.evaluated,
                  "candidates": len(result.candidates)}))
"""


def natural_gpus(num_params: int) -> int:
    return next(gpus for below, gpus in NATURAL if num_params < below)


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=child_env(), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def cold(runs: int) -> list[str]:
    cmd, _ = cli_command()
    bare = [sys.executable, "-c", "import pydantic, typer, rich"]
    table, js, base, ratios = [], [], [], []
    wall(bare), wall([*cmd, *CLI_ARGS])  # warm the file cache and __pycache__
    for _ in range(runs):
        b = wall(bare)
        t = wall([*cmd, *CLI_ARGS])
        j = wall([*cmd, *CLI_ARGS, "--json"])
        base.append(b), table.append(t), js.append(j), ratios.append(t / b)
    med = statistics.median
    return ["| what | median of %d | vs the bare import |" % runs, "|---|---|---|",
            f"| `python -c \"import pydantic, typer, rich\"` | {med(base):.3f} s | 1 |",
            f"| `memplan {' '.join(CLI_ARGS)}` | {med(table):.3f} s | {med(ratios):.2f}x |",
            f"| the same, `--json` | {med(js):.3f} s | "
            f"{med(j / b for j, b in zip(js, base)):.2f}x |"]


def in_process(seconds: float, runs: int) -> list[str]:
    from memplan.model.estimate import cached_estimate

    again = api_step()
    each_once = api_step()

    def cleared() -> int:
        cached_estimate.cache_clear()
        return each_once()

    rows = [("`memplan.estimate`, the grid asked again (result cache)", rate(again, seconds)),
            ("`memplan.estimate`, each configuration once per pass", rate(cleared, seconds)),
            ("`memplan.model.estimate.estimate` on pre-built inputs", rate(core_step(), seconds)),
            ("`memplan.estimate`, first pass in a fresh interpreter", first_pass(runs)),
            ("`memplan.model.estimate.estimate`, first pass in a fresh interpreter",
             first_pass(runs, "core"))]
    return [f"Grid: {len(grid())} configurations (llama-7b and llama-3-70b, mbs 1-8, tp 1/2/4/8, "
            "pp 1/2/4, ZeRO 0-3, dp 8).", "", "| what | estimates/s | us each |", "|---|---|---|",
            *(f"| {label} | {r['per_s']:,.0f} | {r['us_per_estimate']:.1f} |"
              for label, r in rows)]


def plan_catalog(runs: int) -> list[str]:
    import memplan

    cmd, _ = cli_command()
    lines = ["| model | GPUs | first `plan` call | evaluations | `plan` command | "
             "cold `estimate` | ratio |", "|---|---|---|---|---|---|---|"]
    for path in sorted(MODELS.glob("*.toml")):
        name = path.stem
        gpus = natural_gpus(memplan.load_model(name).num_params)
        child = [sys.executable, "-c", PLAN_CHILD, name, str(gpus)]
        found = [json.loads(subprocess.run(child, cwd=ROOT, env=child_env(), check=True,
                                           capture_output=True, text=True).stdout)
                 for _ in range(runs)]
        args = ["--model", name, "--gpus", str(gpus)]
        wall([*cmd, "plan", *args])  # warm
        pairs = [(wall([*cmd, "plan", *args]), wall([*cmd, "estimate", *args]))
                 for _ in range(runs)]
        first = statistics.median(f["s"] for f in found)
        plan_s = statistics.median(p for p, _ in pairs)
        est_s = statistics.median(e for _, e in pairs)
        ratio = statistics.median(p / e for p, e in pairs)
        lines.append(f"| {name} | {gpus:,} | {first:.3f} s | {found[0]['evaluated']:,} | "
                     f"{plan_s:.3f} s | {est_s:.3f} s | {ratio:.2f}x |")
    return lines


def rewrite(doc: str, tables: dict[str, list[str]]) -> str:
    for name, lines in tables.items():
        pattern = re.compile(rf"(<!-- table:{re.escape(name)} -->\n).*?(<!-- end -->)", re.S)
        if not pattern.search(doc):
            raise SystemExit(f"{DOC}: no <!-- table:{name} --> ... <!-- end --> markers")
        doc = pattern.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(2), doc)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--print", action="store_true", help="print the tables, write nothing")
    parser.add_argument("--only", action="append", choices=TABLES,
                        help="measure and write this table alone (repeatable)")
    args = parser.parse_args(argv)
    # bytecode cached, as an installed package has it (with PYTHONDONTWRITEBYTECODE set every
    # cold command would otherwise compile memplan's sources first)
    compileall.compile_dir(str(ROOT / "memplan"), quiet=1)
    info = machine_info()
    measure = {
        "machine": lambda: [f"{info['python']} on {info['cpu']} ({info['cpus_usable']} usable "
                            f"of {info['cpu_count']} CPUs)"],
        "cold": lambda: cold(args.runs),
        "in-process": lambda: in_process(args.seconds, args.runs),
        "plan-catalog": lambda: plan_catalog(args.runs),
    }
    tables = {name: make() for name, make in measure.items()
              if not args.only or name in args.only}
    if args.print:
        for name, lines in tables.items():
            print(f"== {name}\n" + "\n".join(lines) + "\n")
        return 0
    DOC.write_text(rewrite(DOC.read_text(), tables))
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
