"""Importing memplan and running an estimate stays light and side-effect free.

Each check runs in a fresh interpreter (``sys.executable -c``) so modules imported by other tests
in this session cannot hide or fake an import. torch is installed in the development
environment, so an accidental ``import torch`` anywhere on the estimate path shows up here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs in the child. Records any attempt to start a process (nvidia-smi) or load a shared
# library through ctypes (libcuda, libnvidia-ml) before memplan is imported, then reports what
# memplan left behind.
CHILD = r"""
import ctypes, io, json, logging, os, subprocess, sys, contextlib

spawned, loaded = [], []
_popen_init = subprocess.Popen.__init__
def _popen(self, args, *a, **k):
    spawned.append(str(args))
    return _popen_init(self, args, *a, **k)
subprocess.Popen.__init__ = _popen
_cdll_init = ctypes.CDLL.__init__
def _cdll(self, name, *a, **k):
    loaded.append(str(name))
    return _cdll_init(self, name, *a, **k)
ctypes.CDLL.__init__ = _cdll
for fn in ("system", "popen", "execv", "execvp", "execve", "posix_spawn", "posix_spawnp"):
    if hasattr(os, fn):
        real = getattr(os, fn)
        def _wrap(*a, _real=real, _fn=fn, **k):
            spawned.append(_fn + " " + repr(a[:1]))
            return _real(*a, **k)
        setattr(os, fn, _wrap)

env_before = dict(os.environ)
import memplan, memplan.cli
after_import = {
    "modules": sorted(sys.modules),
    "root_handlers": [repr(h) for h in logging.getLogger().handlers],
    "root_level": logging.getLogger().level,
    "last_resort": logging.lastResort is not None,
}
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = memplan.cli.main(["estimate", "--model", "llama-7b", "--gpus", "64", "--json"])
try:
    maps = open("/proc/self/maps").read()
except OSError:
    maps = ""
print(json.dumps({
    "after_import": after_import,
    "after_main": sorted(sys.modules),
    "code": code,
    "stdout": out.getvalue(),
    "stderr": err.getvalue(),
    "root_handlers": [repr(h) for h in logging.getLogger().handlers],
    "spawned": spawned,
    "loaded": loaded,
    "cuda_libs_mapped": sorted({line.split()[-1] for line in maps.splitlines()
                                if "libcuda" in line or "libnvidia-ml" in line
                                or "libcudart" in line}),
    "env_changed": sorted(k for k in set(os.environ) | set(env_before)
                          if os.environ.get(k) != env_before.get(k)),
}))
"""

HEAVY = ("torch", "jax", "tensorflow", "transformers", "pynvml", "cupy", "triton")


@pytest.fixture(scope="module")
def child() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    # memplan is importable from the source tree whether or not it is pip-installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_estimate_runs(child: dict) -> None:
    assert child["code"] == 0, child["stderr"]
    assert child["stderr"] == ""
    assert json.loads(child["stdout"])["num_params"] == 6_738_415_616


def test_torch_never_imported(child: dict) -> None:
    for modules in (child["after_import"]["modules"], child["after_main"]):
        for name in HEAVY:
            assert name not in modules, name
        assert not [m for m in modules if m.startswith("torch.")]
        assert "memplan.profile" not in modules


def test_no_logging_configured(child: dict) -> None:
    assert child["after_import"]["root_handlers"] == []
    assert child["root_handlers"] == []
    assert child["after_import"]["root_level"] == 30  # WARNING, the untouched default


def test_no_cuda_probe(child: dict) -> None:
    assert child["spawned"] == []  # no nvidia-smi / rocm-smi
    assert child["loaded"] == []  # no ctypes load of libcuda / libnvidia-ml
    assert child["cuda_libs_mapped"] == []
    assert child["env_changed"] == []  # e.g. no CUDA_VISIBLE_DEVICES / CUDA_MODULE_LOADING set


DIAGNOSE_CHILD = r"""
import contextlib, io, json, sys
import memplan.cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = memplan.cli.main(["diagnose", "--model", "llama-7b", "--gpus", "8", "--mbs", "4",
                             "--oom", sys.argv[1], "--json"])
print(json.dumps({"code": code, "modules": sorted(sys.modules),
                  "peak": json.loads(out.getvalue())["estimate"]["peak_bytes"]}))
"""


def test_diagnose_is_torch_free(tmp_path: Path) -> None:
    err = tmp_path / "oom.txt"
    err.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 "
                   "has a total capacity of 79.10 GiB of which 1.50 GiB is free. Of the allocated "
                   "memory 74.20 GiB is allocated by PyTorch, and 2.50 GiB is reserved by "
                   "PyTorch but unallocated.")
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", DIAGNOSE_CHILD, str(err)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["code"] == 0 and child["peak"] > 0
    assert "memplan.diagnose" in child["modules"]
    for name in HEAVY:
        assert name not in child["modules"], name
    assert not [m for m in child["modules"] if m.startswith(("torch.", "memplan.profile"))]
