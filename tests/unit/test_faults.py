"""Faults during a run: Ctrl-C, a full disk, a file cut by a killed job.

``memplan profile`` runs here against a stand-in for the torch module that measures
(``memplan.profile.reference_profile``: its two functions, which the command imports when it
runs), so the tests are torch-free and fast; what they check is the command's own handling:
the results written into a staging folder and moved into ``--out`` only when complete, an
interrupt or a write error leaving ``--out`` exactly as it was. ``calibrate``'s interrupt runs
real CPU steps in ``tests/traced/test_calibrate.py``.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import pickle
import stat
import sys
import types
from pathlib import Path

import pytest

from memplan.cli import main
from memplan.errors import MemplanError
from memplan.measure.timeline import Sample, Timeline
from memplan.outputs import check_out_dir, staged_dir, write_atomic

DATA = Path(__file__).resolve().parents[1] / "data"


def _timeline() -> Timeline:
    """Two steps of three phases, 1 KiB more live in step 2 (hand-made samples)."""
    samples = [Sample(index=i, step=step, phase=phase, total_bytes=1024 * (i + step),
                      by_category={"activations": 1024 * i}, op=f"op{i}")
               for i, (step, phase) in enumerate((s, p) for s in (1, 2)
                                                 for p in ("forward", "backward", "optimizer"))]
    return Timeline(device="cpu-tracker", source="hand-made samples", num_steps=2,
                    samples=samples, context={"model": "tiny"})


def _stand_in(monkeypatch: pytest.MonkeyPatch, run) -> None:
    """``memplan.profile.reference_profile`` with ``profile_reference`` = ``run``."""
    module = types.ModuleType("memplan.profile.reference_profile")
    module.profile_reference = run
    module.predicted = lambda *a, **k: {"source": "stand-in", "first_step": {}, "steady": {},
                                        "peak_bytes": 4096}
    monkeypatch.setitem(sys.modules, "memplan.profile.reference_profile", module)


def _tree(root: Path) -> dict[str, tuple]:
    return {str(p.relative_to(root)): (p.is_dir(), p.is_file() and hashlib.sha1(
        p.read_bytes()).hexdigest()) for p in sorted(root.rglob("*"))}


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _interrupt_after_half_a_file(*_a, snapshot_path=None, **_k):
    """Write 65,536 bytes of a result where the command asked for one, then Ctrl-C."""
    Path(snapshot_path).write_bytes(b"x" * 65536)
    raise KeyboardInterrupt


@pytest.mark.parametrize("existing", [False, True])
def test_profile_interrupted_leaves_out_as_it_was(work: Path, existing: bool, capsys,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    out = work / "runs" / "prof"
    if existing:  # an earlier run's results stay whole
        out.mkdir(parents=True)
        (out / "timeline.json").write_text('{"earlier": true}\n')
    before = _tree(work)
    _stand_in(monkeypatch, _interrupt_after_half_a_file)
    argv = ["profile", "-m", "tiny", "--device", "cuda", "--out", str(out)]
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert captured.err == (f"memplan: interrupted: nothing was written to {out}; rerun with: "
                            f"memplan profile -m tiny --device cuda --out {out}\n")
    assert _tree(work) == before  # no staging folder, no half file, nothing new


def test_profile_disk_full_leaves_out_as_it_was(work: Path, capsys,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The second file's write fails with ENOSPC: one line, exit 2, nothing kept."""
    _stand_in(monkeypatch, lambda *a, **k: _timeline())
    calls = []
    real = os.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr("memplan.outputs.os.fsync", fsync)
    out = work / "prof"
    assert main(["profile", "-m", "tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"memplan: error: --out: cannot write {out / 'timeline.csv'}: No space left on "
                   "device; nothing of this run was kept\n")
    assert sorted(p.name for p in work.iterdir()) == []  # neither --out nor a staging folder


def test_profile_writes_every_file_into_out(work: Path, capsys,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in(monkeypatch, lambda *a, **k: _timeline())
    out = work / "a" / "b"
    assert main(["profile", "-m", "tiny", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    names = {"timeline.json", "timeline.csv", "summary.json"}
    assert names <= {Path(p).name for p in result["files"]}
    assert all(Path(p).parent == out for p in result["files"])
    assert names <= {p.name for p in out.iterdir()}
    assert [p.name for p in (work / "a").iterdir()] == ["b"]  # no staging folder left
    assert json.loads((out / "summary.json").read_text())["num_steps"] == 2
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((out / "summary.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask


def test_write_atomic_keeps_the_old_file_on_failure(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "r.json"
    write_atomic(path, "old\n")

    def replace(*_a):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr("memplan.outputs.os.replace", replace)
    with pytest.raises(MemplanError, match=r"cannot write .*r.json: I/O error; it is as it was"):
        write_atomic(path, "new\n" * 10000)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_staged_dir_removes_everything_on_an_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_dir(out) as stage:
        (stage / "half.json").write_text("{")
        raise RuntimeError("stopped")
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_folder_is_refused_before_work(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.access`` answers as for a read-only folder (as root it never does)."""
    monkeypatch.setattr("memplan.outputs.os.access", lambda *_a: False)
    with pytest.raises(MemplanError, match=f"--out: cannot write in {tmp_path} "
                                           r"\(permission denied\)"):
        check_out_dir(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []


# --- damaged evidence: the rest is used, the result says it is partial ---------------------

def _cut_trace(tmp_path: Path, fraction: float) -> Path:
    raw = (DATA / "traces" / "gloo_2rank" / "rank0.json.gz").read_bytes()
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(raw[:int(len(raw) * fraction)])
    return path


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.95])
def test_a_cut_trace_is_read_up_to_its_last_event(tmp_path: Path, fraction: float,
                                                  capsys) -> None:
    """A .json.gz cut by a killed job: analyze-trace reads the events before the cut, exit
    0, one warning line naming the file and the compressed byte where it ends."""
    whole = tmp_path / "whole.json.gz"
    whole.write_bytes((DATA / "traces" / "gloo_2rank" / "rank0.json.gz").read_bytes())
    assert main(["analyze-trace", str(whole), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    path = _cut_trace(tmp_path, fraction)
    assert main(["analyze-trace", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    size = path.stat().st_size
    assert result["partial"] == [result["partial"][0]]
    assert result["partial"][0].startswith(f"{path} is cut (its gzip stream ends at "
                                           f"compressed byte {size:,}")
    assert err == f"memplan: warning: {result['partial'][0]}\n"
    assert full["partial"] == []
    assert 0 < result["ranks"][0]["num_steps"] <= full["ranks"][0]["num_steps"]
    assert result["ranks"][0]["window_us"] <= full["ranks"][0]["window_us"]


def test_a_cut_plain_json_trace_names_its_line(tmp_path: Path, capsys) -> None:
    text = gzip.decompress((DATA / "traces" / "gloo_2rank" / "rank0.json.gz").read_bytes())
    path = tmp_path / "rank0.json"
    path.write_bytes(text[:len(text) // 2])
    assert main(["analyze-trace", str(path)]) == 0
    err = capsys.readouterr().err
    line = text[:len(text) // 2].count(b"\n") + 1
    assert err.startswith(f"memplan: warning: {path} is cut (its JSON ends at line {line}")


def test_ctrl_c_in_a_command_that_keeps_nothing(work: Path, capsys,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan interrupted mid-search: exit 130 and one line, no traceback."""
    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr("memplan.planning.planner.plan", interrupted)
    assert main(["plan", "-m", "tiny", "-n", "8"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "memplan: interrupted: nothing was written\n"
    assert list(work.iterdir()) == []


# --- a memory cap (ulimit -v, common on HPC login nodes) -----------------------------------

CAPPED_CHILD = r"""
import contextlib, gzip, io, pathlib, pickle, resource, sys
from memplan import inputs
from memplan.cli import main

def address_space():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

folder = pathlib.Path(sys.argv[1])
# room for the run itself, and less than any reader's size limit but the model file's: a
# reader that reserved its limit up front fails here with MemoryError
cap = address_space() + 200 * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
small = folder / "small.bin"
for name in ("MODEL_FILE_BYTES", "PROFILE_BYTES", "LOG_BYTES", "MONITOR_BYTES", "TRACE_BYTES",
             "SNAPSHOT_BYTES", "SUMMARY_BYTES"):
    limit = getattr(inputs, name)
    assert len(inputs.read_bytes(small, name, limit)) == 100, name
    assert len(inputs.read_maybe_gzip(small, name, limit).data) == 100, name
    assert len(inputs.read_stream(io.BytesIO(bytes(100)), name, limit)) == 100, name
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert main(["analyze-trace", str(folder / "rank0.json"), "--json"]) == 0
    assert main(["diagnose", "-m", "tiny", "--no-fixes", "--trust-pickle", "--snapshot",
                 str(folder / "s.pickle"), "--json"]) == 0
print("ok")
"""


def test_readers_under_a_memory_cap(tmp_path: Path) -> None:
    """Every reader holds no more memory than the file it reads: under an address-space cap
    200 MiB above what the process already maps, a 100-byte file is read at every size limit
    (16 MiB to 4 GiB), and a plain (not gzipped) trace and a snapshot through the commands.
    Before, a read asked for a buffer of its whole limit and failed with MemoryError."""
    import subprocess

    (tmp_path / "small.bin").write_bytes(b"x" * 100)
    (tmp_path / "rank0.json").write_bytes(
        gzip.decompress((DATA / "traces" / "gloo_2rank" / "rank0.json.gz").read_bytes()))
    (tmp_path / "s.pickle").write_bytes(pickle.dumps(
        {"segments": [{"total_size": 2**20, "allocated_size": 2**19, "blocks": []}]}))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MEMPLAN_DEBUG": "1"}
    proc = subprocess.run([sys.executable, "-c", CAPPED_CHILD, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


# --- outputs: checked before any work; what a killed run left, removed by the next ----------

def _never_run(*_a, **_k):
    raise AssertionError("the command measured before checking --out")


def _link_to_nothing(root: Path) -> Path:
    link = root / "out"
    link.symlink_to(root / "missing")
    return link


def _link_loop(root: Path) -> Path:
    link = root / "out"
    link.symlink_to(link)
    return link


def _under_a_dangling_link(root: Path) -> Path:
    return _link_to_nothing(root) / "sub"


def _long_name(root: Path) -> Path:
    return root / ("x" * 300)


@pytest.mark.parametrize("make", [_link_to_nothing, _link_loop, _under_a_dangling_link,
                                  _long_name])
@pytest.mark.parametrize("command", [["profile", "-m", "tiny"], ["calibrate", "--device", "cpu"]])
def test_out_is_refused_before_any_work(work: Path, make, command: list[str], capsys,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A --out that can never hold the results (a symbolic link to nothing or to itself, on
    the way or at the end; a name longer than the file system's 255 bytes) is refused in one
    line naming --out, before anything is measured; nothing is created."""
    _stand_in(monkeypatch, _never_run)
    out = make(work)
    before = _tree(work)
    assert main([*command, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memplan: error: --out: ") and err.count("\n") == 1, err
    assert "symbolic link to nothing" in err or "too long" in err, err
    assert _tree(work) == before


STAGING = ".memplan-staging-"


def _leftover(root: Path, name: str, age_s: float = 0.0) -> Path:
    """A staging folder as a run left it, a file in it, last changed ``age_s`` ago."""
    import time

    folder = root / name
    folder.mkdir()
    (folder / "timeline.json").write_text("{}")
    then = time.time() - age_s
    for path in (folder / "timeline.json", folder):
        os.utime(path, (then, then))
    return folder


def test_staging_a_killed_run_left_is_removed_by_the_next(work: Path, capsys,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """In the folder a run stages in, the next run removes what runs that are over left (a
    process of this machine that no longer exists; another machine's or an older memplan's
    folder unchanged for over two days) and keeps the rest: this process's own (a live
    run's), another machine's or an unnamed one changed recently, and anything not a staging
    folder."""
    import socket

    from memplan.outputs import STALE_STAGING_S, _host

    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text()) if Path(
        "/proc/sys/kernel/pid_max").exists() else 2**22
    host = _host()
    assert socket.gethostname()  # the names below are this machine's
    gone = [_leftover(work, f"{STAGING}{pid_max + 1}@{host}@prof1a2b3c4d"),
            _leftover(work, f"{STAGING}{pid_max + 7}@{host}@"),
            _leftover(work, f"{STAGING}12@other-node@prof9", age_s=STALE_STAGING_S + 60),
            _leftover(work, f"{STAGING}profk3j4h5g6", age_s=STALE_STAGING_S + 60)]
    kept = [_leftover(work, f"{STAGING}{os.getpid()}@{host}@profzzzz1111", age_s=10**7),
            _leftover(work, f"{STAGING}12@other-node@profqqqq", age_s=60),
            _leftover(work, f"{STAGING}profrecent12", age_s=60),
            _leftover(work, "results-of-another-run")]
    _stand_in(monkeypatch, lambda *a, **k: _timeline())
    assert main(["profile", "-m", "tiny", "--out", str(work / "prof")]) == 0
    capsys.readouterr()
    assert not any(p.exists() for p in gone)
    assert all(p.exists() for p in kept)
    assert (work / "prof" / "summary.json").exists()


KILLED_CHILD = r"""
import os, signal, sys, types
from pathlib import Path

def killed(*_a, snapshot_path=None, **_k):
    Path(snapshot_path).write_bytes(b"x" * 4096)  # a half-written result in the staging folder
    os.kill(os.getpid(), signal.SIGKILL)

module = types.ModuleType("memplan.profile.reference_profile")
module.profile_reference = killed
module.predicted = lambda *a, **k: {}
sys.modules["memplan.profile.reference_profile"] = module
from memplan.cli import main
main(["profile", "-m", "tiny", "--device", "cuda", "--out", sys.argv[1]])
"""


@pytest.mark.parametrize("existing", [False, True])
def test_a_sigkilled_profile_leaves_staging_the_next_run_removes(
        work: Path, existing: bool, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile killed by SIGKILL (no handler runs) leaves its staging folder; the next
    profile into the same --out removes it, and --out holds only that run's results."""
    import signal
    import subprocess

    out = work / "prof"
    if existing:
        out.mkdir()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", KILLED_CHILD, str(out)], cwd=work,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    staged = work if not existing else out
    assert [p.name for p in staged.iterdir() if p.name.startswith(STAGING)], "nothing left"
    _stand_in(monkeypatch, lambda *a, **k: _timeline())
    assert main(["profile", "-m", "tiny", "--out", str(out)]) == 0
    capsys.readouterr()
    assert [p.name for p in work.iterdir()] == ["prof"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


# --- Ctrl-C: one line and exit 130, wherever it lands ----------------------------------------

def test_ctrl_c_in_torch_work_is_taken_at_a_safe_point() -> None:
    """Inside ``deferred_interrupts`` a SIGINT does not raise where it lands (it may land in a
    callback torch runs from C++, where an exception aborts the process): the code around it
    finishes its statement, ``raise_if_interrupted`` raises KeyboardInterrupt, and the handler
    that was there before is back after the block."""
    import signal

    from memplan.errors import deferred_interrupts, raise_if_interrupted

    before = signal.getsignal(signal.SIGINT)
    reached = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        raise_if_interrupted()  # nothing pending: no effect
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next statement
        reached.append("after the signal")  # a critical region: not cut short
        raise_if_interrupted()
        reached.append("never")
    assert reached == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is before
    raise_if_interrupted()  # the flag was cleared on the way out

    with pytest.raises(KeyboardInterrupt), deferred_interrupts():  # no check inside: at its end
        os.kill(os.getpid(), signal.SIGINT)
        reached.append("finished")
    assert reached[-1] == "finished"


@pytest.mark.parametrize("command", [["trace", "-m", "tiny"],
                                     ["profile", "-m", "tiny", "--out", "prof"]])
def test_ctrl_c_in_a_torch_command_is_one_line(command: list[str], work: Path, capsys,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The SIGINT lands while the torch work runs (a stand-in for it, torch-free): exit 130,
    one line, nothing written."""
    import signal

    from memplan.errors import raise_if_interrupted

    def working(*_a, **_k):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(3):  # operators go on until the next safe point
            raise_if_interrupted()
        raise AssertionError("not interrupted")

    module = types.ModuleType("memplan.profile.compare")
    module.compare, module.comparison_json = working, dict
    monkeypatch.setitem(sys.modules, "memplan.profile.compare", module)
    _stand_in(monkeypatch, working)
    assert main(command) == 130
    err = capsys.readouterr().err
    assert err.startswith("memplan: interrupted: ") and err.count("\n") == 1, err
    assert list(work.iterdir()) == []


SIGINT_CHILD = r"""
import sys
import memplan.planning.planner as planner
from memplan.cli import main

real = planner.plan

def busy(*args, **kwargs):  # a plan that stays mid-search until interrupted
    print("working", flush=True)
    while True:
        real(*args, **kwargs)

planner.plan = busy
sys.exit(main(sys.argv[1:]))
"""


def test_sigint_to_a_running_command_exits_130_with_one_line(work: Path) -> None:
    """A real SIGINT from outside (what Ctrl-C sends) to ``memplan plan`` mid-search: exit 130
    and one line on stderr, no traceback. The signal is sent once the child says it works,
    and it keeps working until interrupted, so no timing decides the outcome."""
    import signal
    import subprocess

    root = Path(__file__).resolve().parents[2]
    # SIGINT as a terminal's foreground job has it: a test run started in the background of
    # a non-interactive shell inherits SIGINT ignored (bash ignores it for asynchronous
    # commands), and Python then installs no handler: the child would never see the signal
    child = subprocess.Popen([sys.executable, "-c", SIGINT_CHILD, "plan", "-m", "llama-2-7b",
                              "-n", "64"], cwd=work, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(root)},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert child.stdout.readline() == "working\n"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:  # a child that did not stop would otherwise run on after the test
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 130, err[-2000:]
    assert err == "memplan: interrupted: nothing was written\n"


# --- concurrency: two runs writing into one folder -------------------------------------------

def test_two_runs_staging_into_one_out_keep_each_others_files(work: Path) -> None:
    """Run B starts while run A is still writing (its staging folder is a live run's: never
    removed as stale); both finish and --out holds both runs' files, no staging left."""
    out = work / "prof"
    with staged_dir(out) as first:
        (first / "a.json").write_text("{}")
        with staged_dir(out) as second:
            assert first.exists()  # B's clean-up left A's folder alone
            (second / "b.json").write_text("[]")
        assert first.exists() and (first / "a.json").exists()
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "b.json"]
    assert sorted(p.name for p in work.iterdir()) == ["prof"]


def test_two_monitors_appending_to_one_file_keep_every_line_whole(tmp_path: Path) -> None:
    """Two monitors writing the same rank's file at once (a restarted job while the old one
    still runs): each record is one append of a whole line, so the file holds every record of
    both, each line whole, whatever the interleaving."""
    import threading

    from memplan.diagnose.monitored import read_monitor
    from memplan.monitor import MemoryMonitor

    monitors = [MemoryMonitor(tmp_path, rank=0, reader=lambda k=k: {"allocated_bytes": k,
                                                                     "pad_bytes": 10**6})
                for k in (1, 2)]
    barrier = threading.Barrier(2)

    def steps(monitor: MemoryMonitor) -> None:
        barrier.wait()
        for _ in range(300):
            monitor.step()
        monitor.close()

    threads = [threading.Thread(target=steps, args=(m,)) for m in monitors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = (tmp_path / "memory_rank0.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 601
    records = [json.loads(line) for line in lines[:-1]]
    assert sorted(r["allocated_bytes"] for r in records) == [1] * 300 + [2] * 300
    assert all(m.errors == 0 for m in monitors)
    assert read_monitor([str(tmp_path)]).partial == ()


def test_writers_racing_on_one_file_leave_one_whole(tmp_path: Path) -> None:
    """Threads writing one result file at once: it ends as one writer's bytes, whole, and no
    temporary file is left beside it."""
    import threading

    path = tmp_path / "summary.json"
    contents = [(str(k) * 50_000).encode() for k in range(4)]
    barrier = threading.Barrier(len(contents))

    def write(data: bytes) -> None:
        barrier.wait()
        for _ in range(5):
            write_atomic(path, data)

    threads = [threading.Thread(target=write, args=(c,)) for c in contents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_bytes() in contents
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@pytest.mark.parametrize("kind", ["file", "dangling"])
def test_a_link_planted_at_a_result_is_replaced_not_followed(work: Path, kind: str, capsys,
                                                             monkeypatch) -> None:
    """A symbolic link planted in --out where a result goes (to another file, or to nowhere):
    the result replaces the link (os.replace does not follow it), the file it pointed to is
    untouched and nothing is created outside --out."""
    out, victim = work / "prof", work / "victim.txt"
    out.mkdir()
    victim.write_text("someone else's file\n")
    (out / "summary.json").symlink_to(victim if kind == "file" else work / "created")
    _stand_in(monkeypatch, lambda *a, **k: _timeline())
    assert main(["profile", "-m", "tiny", "--out", str(out)]) == 0
    capsys.readouterr()
    assert victim.read_text() == "someone else's file\n"
    assert not (out / "summary.json").is_symlink()
    assert json.loads((out / "summary.json").read_text())["num_steps"] == 2
    assert sorted(p.name for p in work.iterdir()) == ["prof", "victim.txt"]
