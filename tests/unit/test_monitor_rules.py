"""``MemoryMonitor`` fed through its ``reader`` hook: leak and non-leak patterns, rate-limited
warnings, argument checks, faults of its reader, clock and disk, bounded memory; the trend
rule itself (``memplan.monitor.trend``). torch-free."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import sys
import tracemalloc

import pytest

from memplan.diagnose.monitored import read_monitor
from memplan.errors import MemplanError
from memplan.monitor import LEAK_BYTES, MemoryMonitor, summarize
from memplan.monitor.trend import floors, theil_sen, trend

MiB, GiB = 2**20, 2**30


class Feed:
    """A reader returning ``allocated_bytes`` from a list, and a clock of 0.5 s a call."""

    def __init__(self, values, extra=None):
        self.values, self.extra, self.i, self.t = list(values), extra or {}, 0, 0.0

    def read(self):
        v = self.values[self.i]
        self.i += 1
        return {"allocated_bytes": v, **self.extra}

    def clock(self):
        self.t += 0.5
        return self.t


def _run(tmp_path, values, **kw):
    feed = Feed(values)
    with MemoryMonitor(tmp_path, rank=0, reader=feed.read, clock=feed.clock, **kw) as mon:
        recs = [mon.step() for _ in values]
    return mon, recs


def _leak_steps(recs):
    return [r["step"] for r in recs if any("possible leak" in w for w in r["warnings"])]


# --- the trend rule --------------------------------------------------------------------------
def test_theil_sen_and_floors():
    """The ten slopes of (0,0) (1,10) (2,20) (3,30) (4,1000): six of 10, and 250, 330, 490,
    970 to the outlier at step 4: median 10 (a least-squares slope would be 198)."""
    assert theil_sen([0, 1, 2, 3, 4], [0, 10, 20, 30, 1000]) == 10
    assert floors([5, 1, 7, 3, 9, 8, 2]) == (1, 3, 2)  # thirds of 2, 2 and 3


def test_trend_linear_growth_exact():
    t = trend("allocated_bytes", list(range(1, 7)), [k * GiB for k in range(1, 7)], LEAK_BYTES)
    assert (t.slope_bytes_per_step, t.growth_bytes) == (GiB, 5 * GiB)
    assert t.floor_bytes == (GiB, 3 * GiB, 5 * GiB) and t.leak
    assert trend("x", [1, 2], [1, 2], 1) is None  # too few steps to judge


@pytest.mark.parametrize("period", range(2, 25))
def test_sawtooth_is_no_leak(period):
    """A 30-step window over a sawtooth of 1 GiB amplitude, every period up to 24 steps (4/5 of
    the window) and every phase: the floor does not rise in both later thirds."""
    for phase in range(period):
        values = [10 * GiB + ((t + phase) % period) * GiB // period for t in range(30)]
        assert not trend("x", list(range(30)), values, LEAK_BYTES).leak, phase


def test_single_step_up_is_no_leak():
    for at in range(30):
        values = [10 * GiB + (GiB if t >= at else 0) for t in range(30)]
        assert not trend("x", list(range(30)), values, LEAK_BYTES).leak, at


# --- the monitor on patterns -----------------------------------------------------------------
def test_intermittent_leak_is_caught(tmp_path):
    """+60 MiB on every 2nd or 3rd step (the gap a seeded random choice), 10 GiB otherwise: a
    rule of "grew N steps in a row" never fires on it; the trend does, once it holds half its
    30-step window (step 15), and from then on every step."""
    rng = random.Random(0)
    values, level, due = [], 10 * GiB, 2
    for t in range(60):
        if t == due:
            level, due = level + 60 * MiB, t + rng.choice((2, 3))
        values.append(level)
    _, recs = _run(tmp_path, values)
    steps = _leak_steps(recs)
    assert steps and steps[0] == 15 and steps == list(range(15, 61))


def test_steady_sawtooth_and_noise_left_alone(tmp_path):
    """A steady job: gradient accumulation's sawtooth (period 4, +1 GiB), a periodic eval
    spike every 50 steps, and +-32 MiB of noise, over 2,000 steps (every window scale)."""
    rng = random.Random(1)
    values = [20 * GiB + (t % 4) * GiB // 4 + (3 * GiB if t % 50 == 0 else 0)
              + rng.randint(-32 * MiB, 32 * MiB) for t in range(2000)]
    mon, recs = _run(tmp_path, values)
    assert _leak_steps(recs) == []
    assert mon.summary["warnings"] == {}


def test_slow_leak_caught_at_a_coarse_scale(tmp_path):
    """+1 MiB every 4th step (0.25 MiB a step: 7.5 MiB in 30 steps, under the 64 MiB threshold)
    and +-4 MiB of noise: the blocks of 8 steps see 60 MiB in 240 steps, the blocks of 64
    steps 480 MiB in 1,920; found before step 1,000."""
    rng = random.Random(2)
    values = [8 * GiB + (t // 4) * MiB + rng.randint(-4 * MiB, 4 * MiB) for t in range(1000)]
    _, recs = _run(tmp_path, values)
    steps = _leak_steps(recs)
    assert steps and 300 < steps[0] < 1000


def test_rss_leak_on_the_host(tmp_path):
    """The process's resident set grows 306 MiB over 100 steps (3.06 MiB a step), with no
    allocator counters at all (a CPU job): the rss series is trended on its own."""
    feed = Feed([0] * 100)
    rss = iter(range(2 * GiB, 2 * GiB + 100 * 3_208_642, 3_208_642))

    with MemoryMonitor(tmp_path, rank=0, clock=feed.clock,
                       reader=lambda: {"rss_bytes": next(rss)}) as mon:
        recs = [mon.step() for _ in range(100)]
    steps = _leak_steps(recs)
    # the growth reaches 64 MiB at step 22: 21 gaps of 3.06 MiB (61.2 MiB at step 21)
    assert steps and steps[0] == 22
    assert recs[-1]["warnings"][0].startswith("rss_bytes grew ")


def test_warnings_rate_limited(tmp_path, caplog):
    """A leak that lasts 260 steps is in every record from step 15 on, but logged at step 15,
    115 and 215 (warn_every=100), each saying how many steps it held since."""
    with caplog.at_level(logging.WARNING, logger="memplan.monitor"):
        mon, recs = _run(tmp_path, [10 * GiB + t * 8 * MiB for t in range(260)])
    logged = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in logged] == ["rank 0 step 15", "rank 0 step 115",
                                                 "rank 0 step 215"]
    assert logged[1].endswith("(held 99 more steps since step 15)")
    assert mon.summary["warnings"] == {"leak:allocated_bytes": 246}
    assert sum(1 for r in recs if r["warnings"]) == 246


def test_records_and_other_warnings(tmp_path):
    stats = [{"allocated_bytes": 10 * GiB, "peak_bytes": 40 * GiB, "reserved_bytes": 41 * GiB,
              "capacity_bytes": 80 * GiB},
             {"allocated_bytes": 10 * GiB, "peak_bytes": 78 * GiB, "reserved_bytes": 78 * GiB,
              "capacity_bytes": 80 * GiB}]
    feed = Feed([0, 0])
    it = iter(stats)
    with MemoryMonitor(tmp_path, rank=3, reader=lambda: next(it), clock=feed.clock,
                       predicted_peak_bytes=40 * GiB, deviation_pct=4.0) as mon:
        recs = [mon.step(), mon.step()]
    assert [r["step_time_s"] for r in recs] == [0.5, 0.5]
    assert recs[0]["fragmentation_bytes"] == 31 * GiB and recs[0]["warnings"] == []
    assert recs[0]["headroom_bytes"] == 39 * GiB
    assert recs[1]["headroom_bytes"] == 2 * GiB  # 2.5% of 80 GiB: under 5%
    assert recs[1]["warnings"] == [
        f"headroom {2 * GiB} bytes is under 5.0% of {80 * GiB} bytes",
        f"peak {78 * GiB} bytes is +95.0% from the predicted {40 * GiB} bytes"]
    lines = (tmp_path / "memory_rank3.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == recs
    assert mon.summary["max_peak_bytes"] == 78 * GiB and mon.summary["min_headroom_bytes"] == 2 * GiB


def test_summary_trend_per_rank(tmp_path):
    """Two ranks' files: rank 1 grows 1 GiB a step for 6 steps, rank 0 stays put; the
    summary's trend says which, with the floors of each third."""
    for rank, slope in ((0, 0), (1, GiB)):
        feed = Feed([5 * GiB + k * slope for k in range(6)])
        with MemoryMonitor(tmp_path, rank=rank, reader=feed.read, clock=feed.clock) as mon:
            for _ in range(6):
                mon.step()
    recs = [json.loads(line) for f in sorted(tmp_path.glob("*.jsonl"))
            for line in f.read_text().splitlines()]
    out = summarize(recs)
    t0, t1 = (out["ranks"][k]["trend"]["allocated_bytes"] for k in (0, 1))
    assert (t0["growth_bytes"], t0["leak"]) == (0, False)
    assert (t1["growth_bytes"], t1["floor_bytes"], t1["leak"]) == (
        5 * GiB, [5 * GiB, 7 * GiB, 9 * GiB], True)


def test_cli_monitor_summary_shows_trend(tmp_path):
    from typer.testing import CliRunner

    from memplan.cli import app

    _run(tmp_path, [10 * GiB + t * 100 * MiB for t in range(40)])
    res = CliRunner().invoke(app, ["monitor-summary", str(tmp_path)], env={"COLUMNS": "120"},
                             catch_exceptions=False)
    assert res.exit_code == 0 and "memory trend per rank" in res.stdout
    row = next(line for line in res.stdout.splitlines() if "allocated" in line)
    # 100 MiB a step = 97.656 GiB per 1,000 steps; 39 steps x 100 MiB = 3.81 GiB
    assert "+97.656" in row and "+3.81" in row and "yes" in row


# --- arguments checked when made -------------------------------------------------------------
@pytest.mark.parametrize("kwargs, says", [
    ({"out_dir": None}, "out_dir must be a folder path"),
    ({"out_dir": 3}, "out_dir must be a folder path"),
    ({"predicted_peak_bytes": "x"}, "predicted_peak_bytes must be an int >= 1 or None, not 'x'"),
    ({"predicted_peak_bytes": True}, "predicted_peak_bytes"),
    ({"rank": -1}, "rank must be an int >= 0"),
    ({"reader": 5}, "reader must be a callable"),
    ({"clock": "now"}, "clock must be a callable"),
    ({"clock": lambda: 1 / 0}, "clock() failed when tried: ZeroDivisionError"),
    ({"clock": lambda: sys.exit(1)}, "clock() failed when tried: SystemExit"),
    ({"clock": lambda: "soon"}, "clock() must return a number of seconds, not 'soon'"),
    ({"deviation_pct": float("nan")}, "deviation_pct must be a number"),
    ({"min_headroom_pct": 100}, "min_headroom_pct must be a number from 0 to under 100"),
    ({"leak_window": 3}, "leak_window must be an int >= 6"),
    ({"leak_bytes": 0}, "leak_bytes must be an int >= 1"),
    ({"warn_every": 0}, "warn_every must be an int >= 1"),
])
def test_bad_arguments_refused_when_made(tmp_path, kwargs, says):
    kwargs = {"out_dir": tmp_path, **kwargs}
    with pytest.raises(MemplanError) as err:
        MemoryMonitor(**kwargs)
    assert str(err.value).startswith("MemoryMonitor: ") and says in str(err.value)


def test_out_dir_under_a_file_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(MemplanError, match="is a file, not a folder"):
        MemoryMonitor(tmp_path / "file" / "sub")


# --- faults never reach the training loop ----------------------------------------------------
@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()])
def test_reader_raising_base_exception_stops_the_monitor(tmp_path, exc, caplog):
    calls = []

    def reader():
        calls.append(1)
        if len(calls) == 2:
            raise exc
        return {"allocated_bytes": 1}

    with caplog.at_level(logging.WARNING, logger="memplan.monitor"):
        mon = MemoryMonitor(tmp_path, rank=0, reader=reader)
        assert mon.step()["step"] == 1
        assert mon.step() is None and mon.step() is None and mon.close() is None
    assert mon.stopped.startswith(f"reader raised {type(exc).__name__}") and len(calls) == 2
    last = json.loads((tmp_path / "memory_rank0.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and last["monitor_stopped"] == mon.stopped
    assert any("stopped" in r.getMessage() for r in caplog.records)


def test_reader_answer_raising_when_read(tmp_path):
    """The reader returns a dict whose items() raises KeyboardInterrupt: that is the reader's
    code too, so the monitor stops and the step returns."""
    class Sly(dict):
        def items(self):
            raise KeyboardInterrupt

    mon = MemoryMonitor(tmp_path, rank=0, reader=lambda: Sly(allocated_bytes=1))
    assert mon.step() is None and mon.stopped == "reader raised KeyboardInterrupt()"


def test_clock_failing_later(tmp_path):
    """A clock that works when the monitor is made, then raises: step times fall back to
    time.perf_counter, the error is counted; one raising SystemExit stops the monitor."""
    ticks = iter([0.0, 1.0])

    def clock():
        value = next(ticks, None)
        if value is None:
            raise RuntimeError("clock gone")
        return value

    mon = MemoryMonitor(tmp_path, rank=0, reader=dict, clock=clock)
    recs = [mon.step() for _ in range(3)]
    assert all(r is not None for r in recs) and mon.errors == 1 and mon.stopped is None
    state = {"n": 0}

    def exits():
        state["n"] += 1
        if state["n"] > 3:  # made, started, the first step
            raise SystemExit(0)
        return 1.0

    mon = MemoryMonitor(tmp_path / "b", rank=0, reader=dict, clock=exits)
    assert mon.step() is not None and mon.step() is None
    assert mon.stopped == "clock raised SystemExit(0)"


def test_reader_failures_and_bad_values_counted(tmp_path, caplog):
    answers = iter([RuntimeError("no stats"), ["not", "a", "dict"],
                    {"allocated_bytes": "x", "reserved_bytes": 5, "step": 99}])

    def reader():
        got = next(answers)
        if isinstance(got, Exception):
            raise got
        return got

    with caplog.at_level(logging.WARNING, logger="memplan.monitor"):
        mon = MemoryMonitor(tmp_path, rank=0, reader=reader)
        recs = [mon.step() for _ in range(3)]
    assert [r["step"] for r in recs] == [1, 2, 3]  # the reader cannot renumber a step
    assert recs[2]["reserved_bytes"] == 5 and "allocated_bytes" not in recs[2]
    assert mon.errors == 3 and len(caplog.records) == 1  # one kind: logged once


def test_disk_failures_counted(tmp_path, monkeypatch):
    """The folder cannot be made (a file takes its name after the monitor was made), then a
    write fails (a full disk): counted, the running summary goes on."""
    mon = MemoryMonitor(tmp_path / "sub", rank=0, reader=lambda: {"allocated_bytes": 7})
    (tmp_path / "sub").write_text("")
    assert mon.step()["allocated_bytes"] == 7 and mon.errors == 1
    ok = MemoryMonitor(tmp_path / "ok", rank=0, reader=lambda: {"allocated_bytes": 7})
    ok.start()

    class Full:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def close(self):
            raise OSError(28, "No space left on device")

    ok._file = Full()
    assert ok.step()["step"] == 1 and ok.close() is None
    assert ok.errors == 2 and ok.summary["num_steps"] == 1


def test_bad_rank_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    mon = MemoryMonitor(tmp_path, reader=dict)
    assert mon.step()["rank"] == 0 and mon.errors == 1
    assert (tmp_path / "memory_rank0.jsonl").exists()


def test_memory_is_bounded(tmp_path):
    """The monitor keeps a running summary and its windows, not its records: once its windows
    are full (64 x 30 steps), 1,000 more steps of 40 counters each leave it holding under 8 KiB
    more (its records would be 1.5 MB)."""
    steps = 2000 + 1000
    feed = Feed([10 * GiB + (t % 7) * MiB for t in range(steps)],
                extra={f"counter_{i}_bytes": i for i in range(40)})
    mon = MemoryMonitor(tmp_path, rank=0, reader=feed.read, clock=feed.clock)
    for _ in range(2000):
        mon.step()
    tracemalloc.start()
    for _ in range(1000):
        mon.step()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    mon.close()
    assert held < 8 * 1024, held


# --- transformers' callback protocol, duck-typed ----------------------------------------------
def test_trainer_callback_protocol(tmp_path):
    """What transformers' CallbackHandler does with a callback: every event by name, with
    (args, state, control); a returned value would replace ``control``, so all return None."""
    feed = Feed([1, 2, 3])
    mon = MemoryMonitor(tmp_path, rank=0, reader=feed.read, clock=feed.clock)
    for event in ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin",
                  "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end",
                  "on_log", "on_step_end", "on_evaluate", "on_save", "on_step_end",
                  "on_epoch_end", "on_train_end", "on_some_future_event"):
        assert getattr(mon, event)(None, None, None, model=None) is None
    assert mon.summary["num_steps"] == 3
    assert len((tmp_path / "memory_rank0.jsonl").read_text().splitlines()) == 3
    with pytest.raises(AttributeError):
        mon.no_such_thing  # noqa: B018 - only events (on_*) are answered by any name


# --- the record file in a shared folder: links planted at its name, a full disk -------------

def _planted(tmp_path, kind):
    """``out/memory_rank0.jsonl`` made by another user as ``kind``, and the file outside
    ``out`` it would make the job write to (None for a FIFO)."""
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("someone else's file\n")
    name = out / "memory_rank0.jsonl"
    if kind == "symlink":
        name.symlink_to(victim)
    elif kind == "dangling":
        name.symlink_to(tmp_path / "created-through-the-link")
    elif kind == "loop":
        name.symlink_to(name)
    elif kind == "hardlink":
        os.link(victim, name)
    else:
        os.mkfifo(name)
    return out, victim


LINKS = ["symlink", "dangling", "loop", "hardlink", "fifo"]


@pytest.mark.parametrize("kind", LINKS)
def test_a_planted_link_is_refused_not_followed(tmp_path, kind, caplog, monkeypatch):
    """Whatever is planted at the record file's name, nothing outside ``out_dir`` is written or
    created; the job goes on, the refusal is one logged line naming the file, counted in
    ``errors`` (the monitor never raises into the training loop once made)."""
    out, victim = _planted(tmp_path, kind)
    monkeypatch.setenv("RANK", "0")
    before = sorted(p.name for p in tmp_path.iterdir())
    with caplog.at_level(logging.WARNING, logger="memplan.monitor"):
        mon = MemoryMonitor(out, reader=lambda: {"allocated_bytes": 7})  # rank from RANK
        assert mon.step()["allocated_bytes"] == 7
        assert mon.step()["step"] == 2
        mon.close()
    assert victim.read_text() == "someone else's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert mon.errors == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert "memory_rank0.jsonl is " in line and "\n" not in line, line


@pytest.mark.parametrize("kind", ["symlink", "dangling"])
def test_a_planted_link_is_refused_when_made(tmp_path, kind):
    """With the rank given, a link already there is refused before training starts."""
    out, _ = _planted(tmp_path, kind)
    with pytest.raises(MemplanError, match=r"memory_rank0.jsonl is a symbolic link \(to "):
        MemoryMonitor(out, rank=0, reader=dict)


class _DiskFillsAfter:
    """The monitor's file on a disk with ``room`` bytes left: a write past it stores what fits
    and raises ENOSPC (as write(2) stores a part, then fails), until ``room`` grows again."""

    def __init__(self, real, room):
        self.real, self.room = real, room

    def write(self, data):
        if len(data) <= self.room:
            self.room -= len(data)
            return self.real.write(data)
        self.real.write(data[:self.room])
        self.room = 0
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):  # seek, truncate, close: the real file's
        return getattr(self.real, name)


@pytest.mark.parametrize("room", [0, 1, 40, 80])
def test_a_full_disk_never_leaves_a_cut_line(tmp_path, room):
    """Steps 2 and 3 meet a full disk (``room`` bytes left, some of a line): each failed line
    is cut back, so the file holds steps 1 and 4, whole, and reads back with no note."""
    mon = MemoryMonitor(tmp_path, rank=0, reader=lambda: {"allocated_bytes": 7})
    mon.step()
    disk = _DiskFillsAfter(mon._file, room)
    mon._file = disk
    mon.step()
    mon.step()
    disk.room = 10**6
    mon.step()
    mon.close()
    raw = (tmp_path / "memory_rank0.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    assert [json.loads(line)["step"] for line in raw.splitlines()] == [1, 4]
    assert mon.errors == 2
    monitored = read_monitor([str(tmp_path)])
    assert monitored.partial == () or list(monitored.partial) == []


def test_dev_full_keeps_nothing_half_written(tmp_path):
    """On a real full device (/dev/full: every write fails with ENOSPC) the monitor counts
    the failure; the write is cut back (a device has no length to cut: nothing to keep)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    mon = MemoryMonitor(tmp_path, rank=0, reader=dict)
    mon.start()
    real = mon._file
    mon._file = open("/dev/full", "ab", buffering=0)  # noqa: SIM115
    assert mon.step()["step"] == 1 and mon.errors == 1
    mon._file.close()
    mon._file = real
    mon.close()
