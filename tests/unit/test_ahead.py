"""The reserved check's replays made ahead by forked workers (``memplan.planning.ahead``):
the same plan, figure for figure, as replayed in the plan's own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from memplan.errors import MemplanError
from memplan.planning import ahead


@pytest.mark.parametrize("raw, message", [("two", "whole number"), ("0", "at least 1"),
                                          ("-3", "at least 1")])
def test_a_bad_jobs_setting_is_one_line(monkeypatch: pytest.MonkeyPatch, raw: str,
                                        message: str) -> None:
    monkeypatch.setenv("MEMPLAN_JOBS", raw)
    with pytest.raises(MemplanError, match=f"MEMPLAN_JOBS must be .*{message}.*{raw}"):
        ahead.jobs()


def test_jobs_one_means_no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMPLAN_JOBS", "1")
    assert ahead.jobs() == 1


def test_no_workers_where_a_fork_is_not_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMPLAN_JOBS", "4")
    monkeypatch.setattr(ahead.threading, "active_count", lambda: 2)  # another thread
    assert ahead.jobs() == 1
    monkeypatch.setattr(ahead.threading, "active_count", lambda: 1)
    monkeypatch.setattr(ahead.sys, "platform", "darwin")
    assert ahead.jobs() == 1
    monkeypatch.setattr(ahead.sys, "platform", "linux")
    assert ahead.jobs() == 4


# Run in a fresh interpreter (no thread of the test session's beside it): each plan with its
# replays made in the process and with two workers ahead, every cache cleared between, and
# how many replays the workers handed over.
_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import memplan
    import memplan.planning.ahead as ahead
    import memplan.planning.planner as planner

    taken = [0]
    take = ahead.Ahead.take
    def counted(self, key):
        got = take(self, key)
        taken[0] += got is not None
        return got
    ahead.Ahead.take = counted

    def plan(jobs, kwargs):
        os.environ["MEMPLAN_JOBS"] = str(jobs)
        planner._reserved_peak.cache_clear()
        planner._SEEN.clear()
        planner._stopped.clear()
        r = memplan.plan(**kwargs)
        return repr((r.candidates, sorted(r.rejected.items()), r.replayed, r.evaluated,
                     r.closest_miss, r.oom_excess_bytes))

    out = []
    for kwargs in json.loads(sys.argv[1]):
        alone = plan(1, kwargs)
        taken[0] = 0
        out.append([alone == plan(2, kwargs), taken[0]])
    # a worker that dies (the system's out-of-memory killer): no answer from it, none ahead
    # after it, the caller replays itself
    broken = ahead.Ahead(os._exit, 2)
    broken.submit([(3,)])
    gone = broken.take((3,)) is None and broken.workers == 1
    broken.close()
    print(json.dumps({"plans": out, "broken": gone}))
""")

CASES = [
    # ten shown among candidates the check turns down and tries again at smaller micro-batches
    dict(model="llama-3-70b", gpus=64, top=10),
    # every candidate the search fits turned down: the closest miss made exact
    dict(model="llama-2-7b", gpus=8, tp=1, pp=2, top=3, gpu_memory="22GiB", seq_len=2048,
         global_batch_size=64),
]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork on Linux only")
def test_plans_with_workers_ahead_are_the_plans_without() -> None:
    env = dict(os.environ)
    env.pop("MEMPLAN_JOBS", None)
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for kwargs, (same, taken) in zip(CASES, results["plans"], strict=True):
        assert same, kwargs
        assert taken > 0, kwargs  # the workers made replays the check read
    assert results["broken"]


def test_no_workers_inside_a_pool_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # a daemonic process (a multiprocessing pool's worker) may start no process of its own
    import multiprocessing

    monkeypatch.setenv("MEMPLAN_JOBS", "4")
    monkeypatch.setattr(ahead.threading, "active_count", lambda: 1)
    monkeypatch.setattr(ahead.sys, "platform", "linux")
    monkeypatch.setattr(multiprocessing.current_process(), "daemon", True, raising=False)
    assert ahead.jobs() == 1


def test_no_process_to_start_means_none_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    # where the system refuses a process (a limit), the plan replays in its own process
    import concurrent.futures

    def refused(*args, **kwargs):
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", refused)
    got = ahead.Ahead(lambda *key: key, 4)
    got.submit([(1,), (2,)])
    assert got.workers == 1 and got.take((1,)) is None
    got.close()
