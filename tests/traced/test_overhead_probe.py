"""The CUDA overhead probe called from Python: a clear MemplanError without a GPU or when a
probe process dies, never a BrokenPipeError from the process it was holding."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memplan.errors import MemplanError
from memplan.profile.overhead_probe import _answer, _release, run_probes


def test_without_a_gpu_one_clear_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the probes run")
    with pytest.raises(MemplanError) as err:
        run_probes()
    assert str(err.value).startswith("overhead probe needs a CUDA GPU: no CUDA device is "
                                     f"visible (torch {torch.__version__}")


def test_a_dead_probe_process_is_reported_and_released():
    """A holding process that died before answering: its last stderr line is the message,
    and letting it go (writing to its closed stdin) raises nothing."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('cuInit failed: 999')"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    with pytest.raises(MemplanError, match=r"the first process ended without a result "
                                           r"\(exit 1\): cuInit failed: 999"):
        _answer(proc.stdout.readline(), proc, "first")
    _release(proc)
    assert proc.returncode == 1
