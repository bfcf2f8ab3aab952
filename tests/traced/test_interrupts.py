"""Ctrl-C during ``memplan trace``'s torch work: one line and exit 130, never an abort.

A SIGINT that Python turned into KeyboardInterrupt wherever it landed could land in a Python
callback torch runs from C++ (the tracker's weakref finaliser, run by a tensor's destructor),
where an exception cannot pass: the process aborted (exit -6). The command now takes the
signal between operators (``memplan.errors.deferred_interrupts``). Each run sends the signal
after the child reports a given step started, and the child keeps stepping until
interrupted, so no timing decides the outcome; the signals land at different points of a step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import sys
import memplan.profile.trace as trace
from memplan.cli import main

real, at = trace._step, int(sys.argv[1])

def step(*args):
    if args[-1] == at:  # the step number: say the work is under way
        print("working", flush=True)
    return real(*args)

trace._step = step
sys.exit(main(["trace", "-m", "tiny", "--steps", "100000", *sys.argv[2:]]))
"""


@pytest.mark.parametrize(("at", "options"), [(1, []), (2, ["--mbs", "2"]), (3, ["--real"])])
def test_sigint_mid_trace_exits_130_with_one_line(tmp_path: Path, at: int,
                                                  options: list[str]) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(at), *options], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.stdout.readline() == "working\n", child.communicate(timeout=120)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 130, err[-3000:]
    assert err == "memplan: interrupted: nothing was written\n"
    assert list(tmp_path.iterdir()) == []
