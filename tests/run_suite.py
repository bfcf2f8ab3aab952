"""Run the test suite as two pytest processes side by side, then print each one's report.

    .venv/bin/python tests/run_suite.py [PYTEST ARGS ...]   # e.g. -x, tests/unit, -k compiled
    .venv/bin/python tests/run_suite.py --record            # and re-record the file durations

The suite is mostly single-threaded Python (torch's dispatcher under fake tensors, Inductor's
compiles), so on two cores two processes can take about half the time of one, as far as the
recorded durations balance them (docs/contributing.md says how far they do). Each process runs
the whole test files ``tests/suite_split.py`` places in it (the same files, in the same order, on
every run of a commit) with its own Inductor cache folder, so neither sees the other's compiled
artefacts. ``pytest -q`` alone still runs everything in one process.

The exit status is pytest's: 0 when both processes pass (a process with nothing selected counts
as passing when the other ran tests), else the first failing process's status.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SHARDS = 2  # CI's cores (README: CI runs on 2 cores); fixed, so placement never varies
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import suite_split  # tests/suite_split.py


def _env(k: int, record: Path | None) -> dict[str, str]:
    env = dict(os.environ, MEMPLAN_TEST_SHARD=f"{k}/{SHARDS}")
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(
            Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_shard{k}")
    if record is not None:
        env["MEMPLAN_TEST_DURATIONS"] = str(record)
    return env


def _status(codes: list[int]) -> int:
    if all(c in (0, 5) for c in codes):
        return 0 if 0 in codes else 5
    return next(c for c in codes if c not in (0, 5))


def _write_durations(logs: list[Path]) -> None:
    seconds: dict[str, float] = {}
    tests: dict[str, set[str]] = {}
    for log in logs:
        for line in log.read_text().splitlines():
            nodeid, _, took = line.split("\t")
            name = nodeid.split("::")[0]
            seconds[name] = seconds.get(name, 0.0) + float(took)
            tests.setdefault(name, set()).add(nodeid)
    files = {name: {"seconds": round(seconds[name], 1), "tests": len(tests[name])}
             for name in sorted(seconds)}
    suite_split.DURATIONS.write_text(json.dumps(
        {"recorded_with": "tests/run_suite.py --record", "files": files}, indent=1) + "\n")


def main(argv: list[str]) -> int:
    # a SIGTERM (a CI timeout) unwinds like Ctrl-C, so both pytest processes are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    record = "--record" in argv
    args = [a for a in argv if a != "--record"]
    with tempfile.TemporaryDirectory(prefix="memplan-suite-") as tmp:
        outs = [Path(tmp) / f"shard{k}.out" for k in range(SHARDS)]
        logs = [Path(tmp) / f"shard{k}.durations" for k in range(SHARDS)]
        procs = []
        try:
            for k in range(SHARDS):
                with open(outs[k], "w") as out:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                        cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                        env=_env(k, logs[k] if record else None)))
            print(f"tests/run_suite.py: {SHARDS} pytest processes started", flush=True)
            codes = [p.wait() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for k in range(SHARDS):
            print(f"\n===== process {k + 1} of {SHARDS} (exit status {codes[k]}) =====")
            print(outs[k].read_text(), end="", flush=True)
        if record and all(c in (0, 5) for c in codes):
            _write_durations([log for log in logs if log.exists()])
            print(f"recorded {suite_split.DURATIONS.relative_to(ROOT)}")
    status = _status(codes)
    print(f"\ntests/run_suite.py: {'passed' if status == 0 else 'FAILED'} "
          f"(exit statuses {codes})")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
