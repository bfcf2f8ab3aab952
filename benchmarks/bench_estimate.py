"""How fast memplan answers: cold CLI start and in-process estimates per second.

Not a test: run it by hand, from the repository root::

    .venv/bin/python benchmarks/bench_estimate.py            # table
    .venv/bin/python benchmarks/bench_estimate.py --json     # one JSON object
    .venv/bin/python benchmarks/bench_estimate.py --profile  # + cProfile of the in-process loop

What it measures:

(a) cold CLI: wall time of a fresh ``memplan estimate --model llama-7b --gpus 64`` process (the
    ``.venv/bin/memplan`` console script when it exists, else ``python -m memplan``), median of
    ``--runs`` runs (default 10) after one untimed run that warms the OS file cache and
    ``__pycache__``; the same with ``--json``; and, for scale, a bare ``python -c pass`` and
    ``python -c "import memplan.cli"``.
(b) in-process: ``memplan.estimate`` over a grid of configurations (mbs 1..8, tp 1/2/4/8,
    pp 1/2/4, zero 0-3, on llama-7b and llama-3-70b; dp 8), and the lower-level
    ``memplan.model.estimate.estimate`` on pre-built spec / GPU / layout / workload objects, each repeated
    until ``--seconds`` have passed; and a first pass over the grid in a fresh interpreter
    (``first_pass``: the model and GPU catalogs loaded, every other cache empty; median of
    ``--runs`` interpreters), which a sweep's repeated passes (its per-layout and stage-walk
    caches warm) do not measure.

Targets:

- cold CLI < 0.5 s on a 2-core machine (median, either output format);
- >= 10,000 estimates/s in-process (``memplan.estimate("llama-7b", gpus=64)`` from names, one
  core); the mixed grid is reported beside it (pipeline layouts cost one walk per stage).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmark the working tree, installed or not

from memplan.calibrate.records import cpu_name  # noqa: E402  (after the path set-up)

TARGET_CLI_S = 0.5
TARGET_PER_S = 10_000
CLI_ARGS = ["estimate", "--model", "llama-7b", "--gpus", "64"]

MODELS = ("llama-7b", "llama-3-70b")
MBS = range(1, 9)
TP = (1, 2, 4, 8)
PP = (1, 2, 4)
ZERO = (0, 1, 2, 3)
DP = 8


# --- environment ---------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
    }


# --- (a) cold CLI --------------------------------------------------------------------------

def cli_command() -> tuple[list[str], str]:
    script = ROOT / ".venv" / "bin" / "memplan"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)], str(script.relative_to(ROOT))
    return [sys.executable, "-m", "memplan"], "python -m memplan"


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("COLUMNS", "120")
    return env


def time_process(argv: list[str], runs: int) -> dict[str, Any]:
    env = child_env()

    def once() -> float:
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): "
                             f"{proc.stderr.decode(errors='replace').strip()}")
        return elapsed

    once()  # warm the file cache and __pycache__; not counted
    times = [once() for _ in range(runs)]
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "runs": runs}


def bench_cli(runs: int) -> dict[str, Any]:
    cmd, label = cli_command()
    return {
        "command": label,
        "python -c pass": time_process([sys.executable, "-c", "pass"], runs),
        "python -c 'import memplan.cli'": time_process(
            [sys.executable, "-c", "import memplan.cli"], runs),
        "estimate (table)": time_process([*cmd, *CLI_ARGS], runs),
        "estimate --json": time_process([*cmd, *CLI_ARGS, "--json"], runs),
    }


# --- (b) in-process ------------------------------------------------------------------------

def grid() -> list[dict[str, Any]]:
    return [dict(model=model, gpus=tp * pp * DP, tp=tp, pp=pp, zero=zero, micro_batch_size=mbs)
            for model, mbs, tp, pp, zero in itertools.product(MODELS, MBS, TP, PP, ZERO)]


def rate(step: Callable[[], int], seconds: float) -> dict[str, Any]:
    """Call ``step`` (which runs a batch and returns how many estimates it made) until
    ``seconds`` have passed; estimates per second over the whole run."""
    step()  # warm caches (catalog, param counts); not counted
    done, start = 0, time.perf_counter()
    while True:
        done += step()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    return {"per_s": done / elapsed, "us_per_estimate": elapsed / done * 1e6,
            "estimates": done, "seconds": elapsed}


def api_step() -> Callable[[], int]:
    import memplan

    configs = grid()

    def step() -> int:
        for cfg in configs:
            memplan.estimate(cfg["model"], gpus=cfg["gpus"], tp=cfg["tp"], pp=cfg["pp"],
                             zero=cfg["zero"], micro_batch_size=cfg["micro_batch_size"])
        return len(configs)

    return step


def api_json_step() -> Callable[[], int]:
    import memplan
    from memplan.report import estimate_json

    configs = grid()

    def step() -> int:
        for cfg in configs:
            json.dumps(estimate_json(memplan.estimate(
                cfg["model"], gpus=cfg["gpus"], tp=cfg["tp"], pp=cfg["pp"], zero=cfg["zero"],
                micro_batch_size=cfg["micro_batch_size"])))
        return len(configs)

    return step


def core_step() -> Callable[[], int]:
    import memplan
    from memplan.model import estimate as memory

    gpu = memplan.load_gpu("h100-sxm")
    prebuilt = []
    for cfg in grid():
        spec = memplan.load_model(cfg["model"])
        par = memplan.make_layout(cfg["gpus"], tp=cfg["tp"], pp=cfg["pp"], zero=cfg["zero"])
        wl = memplan.make_workload(spec, micro_batch_size=cfg["micro_batch_size"])
        prebuilt.append((spec, par, wl))

    def step() -> int:
        for spec, par, wl in prebuilt:
            memory.estimate(spec, gpu, par, wl)
        return len(prebuilt)

    return step


def headline_step() -> Callable[[], int]:
    """The command's own question, in process: llama-7b on 64 GPUs with the defaults."""
    import memplan

    def step() -> int:
        memplan.estimate("llama-7b", gpus=64)
        return 1

    return step


FIRST_PASS_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import memplan
from memplan.model import estimate as memory
from benchmarks.bench_estimate import grid
configs = grid()
gpu = memplan.load_gpu("h100-sxm")
specs = {name: memplan.load_model(name) for name in {cfg["model"] for cfg in configs}}
if sys.argv[2] == "core":
    prebuilt = [(specs[cfg["model"]],
                 memplan.make_layout(cfg["gpus"], tp=cfg["tp"], pp=cfg["pp"], zero=cfg["zero"]),
                 memplan.make_workload(specs[cfg["model"]],
                                       micro_batch_size=cfg["micro_batch_size"]))
                for cfg in configs]
    start = time.perf_counter()
    for spec, par, wl in prebuilt:
        memory.estimate(spec, gpu, par, wl)
else:
    start = time.perf_counter()
    for cfg in configs:
        memplan.estimate(cfg["model"], gpus=cfg["gpus"], tp=cfg["tp"], pp=cfg["pp"],
                         zero=cfg["zero"], micro_batch_size=cfg["micro_batch_size"])
print(json.dumps({"s": time.perf_counter() - start, "estimates": len(configs)}))
"""


def first_pass(runs: int, what: str = "api") -> dict[str, Any]:
    """The grid estimated once in each of ``runs`` fresh interpreters (``what``: "api",
    ``memplan.estimate``; "core", the model on inputs built before the clock starts), after
    the imports and the catalog look-ups: every cache of the estimate empty. The median
    run's rate."""
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", FIRST_PASS_CHILD, str(ROOT), what],
                             cwd=ROOT, env=child_env(), capture_output=True, text=True,
                             check=True)
        times.append(json.loads(out.stdout))
    s = statistics.median(t["s"] for t in times)
    n = times[0]["estimates"]
    return {"per_s": n / s, "us_per_estimate": s / n * 1e6, "estimates": n, "seconds": s,
            "runs": runs}


def bench_inprocess(seconds: float, runs: int = 5) -> dict[str, Any]:
    return {
        "configs": len(grid()),
        "memplan.estimate('llama-7b', gpus=64)": rate(headline_step(), seconds),
        "memplan.estimate": rate(api_step(), seconds),
        "memplan.model.estimate.estimate (pre-built inputs)": rate(core_step(), seconds),
        "memplan.estimate + estimate_json + json.dumps": rate(api_json_step(), seconds),
        "memplan.estimate, first pass (fresh interpreter)": first_pass(runs),
        "memplan.model.estimate.estimate, first pass": first_pass(runs, "core"),
    }


def profile(seconds: float, top: int) -> str:
    step = api_step()
    step()
    prof = cProfile.Profile()
    prof.enable()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    out.write("== by own time (tottime) ==\n")
    stats.sort_stats("tottime").print_stats(top)
    out.write("== by cumulative time ==\n")
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


# --- output --------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "meets target" if ok else "BELOW TARGET"


def print_table(result: dict[str, Any]) -> None:
    info = result["machine"]
    print(f"{info['python']} on {info['platform']}")
    print(f"CPU: {info['cpu']} ({info['cpus_usable']} usable of {info['cpu_count']})")
    if "cli" in result:
        cli = result["cli"]
        print(f"\n(a) cold CLI, {cli['command']} {' '.join(CLI_ARGS)} "
              f"(median of {cli['estimate (table)']['runs']} runs)")
        print(f"  {'':34} {'median':>9} {'min':>9} {'max':>9}")
        for name, row in cli.items():
            if name == "command":
                continue
            print(f"  {name:34} {row['median_s']:8.3f}s {row['min_s']:8.3f}s "
                  f"{row['max_s']:8.3f}s")
        worst = max(cli["estimate (table)"]["median_s"], cli["estimate --json"]["median_s"])
        print(f"  target < {TARGET_CLI_S} s: {verdict(worst < TARGET_CLI_S)}")
    if "inprocess" in result:
        inp = result["inprocess"]
        print(f"\n(b) in-process, {inp['configs']} configurations "
              f"(2 models x mbs 1-8 x tp 1/2/4/8 x pp 1/2/4 x zero 0-3, dp {DP})")
        print(f"  {'':48} {'estimates/s':>12} {'us each':>9}")
        for name, row in inp.items():
            if name == "configs":
                continue
            print(f"  {name:48} {row['per_s']:12,.0f} {row['us_per_estimate']:9.1f}")
        api = inp["memplan.estimate('llama-7b', gpus=64)"]["per_s"]
        print(f"  target >= {TARGET_PER_S:,}/s (the llama-7b --gpus 64 estimate): "
              f"{verdict(api >= TARGET_PER_S)}; the grid's pipeline layouts walk every stage")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10,
                        help="cold CLI runs per command, and interpreters per first pass (10)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="time per in-process measurement (2.0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--skip-cli", action="store_true", help="only the in-process part")
    parser.add_argument("--skip-inprocess", action="store_true", help="only the cold CLI part")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile the memplan.estimate loop and print the top functions")
    parser.add_argument("--top", type=int, default=20, help="functions shown by --profile (20)")
    args = parser.parse_args(argv)

    result: dict[str, Any] = {"machine": machine_info(),
                              "targets": {"cli_s": TARGET_CLI_S, "estimates_per_s": TARGET_PER_S}}
    if not args.skip_cli:
        result["cli"] = bench_cli(args.runs)
    if not args.skip_inprocess:
        result["inprocess"] = bench_inprocess(args.seconds, args.runs)
    if args.json:
        if args.profile:
            result["profile"] = profile(args.seconds, args.top)
        print(json.dumps(result, indent=2))
        return 0
    print_table(result)
    if args.profile:
        print("\ncProfile of the memplan.estimate loop:")
        print(profile(args.seconds, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
