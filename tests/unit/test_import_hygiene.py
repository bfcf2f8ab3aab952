"""Importing memplan and running an estimate stays light and side-effect free; memplan's
modules import each other without cycles and calibration never imports a layer above it.

Each runtime check runs in a fresh interpreter (``sys.executable -c``) so modules imported by
other tests in this session cannot hide or fake an import. torch is installed in the development
environment, so an accidental ``import torch`` anywhere on the estimate path shows up here. The
import graph is read from the source (``ast``), so it needs neither torch nor an import.
"""

from __future__ import annotations

import ast
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


# --- the import graph ------------------------------------------------------------------------

PACKAGE = ROOT / "memplan"
# Cycles that cannot be broken yet, each with its reason. Empty: none is allowed today.
ALLOWED_CYCLES: set[frozenset[str]] = set()
# Layers calibration sits below (ARCHITECTURE.md's data flow): it may not import them, even
# inside a function.
ABOVE_CALIBRATION = ("memplan.planning.planner", "memplan.planning.search", "memplan.report",
                     "memplan.cli", "memplan.api", "memplan.diagnose")


def _module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``: never executed, so no runtime edge."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom,
              modules: dict[str, Path]) -> list[str]:
    """The memplan modules one import statement loads: ``from P import n`` loads the
    submodule ``P.n`` when there is one, else ``P`` itself."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the statement's own package up
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                   for a in node.names]
    out = []
    for target in targets:
        while target not in modules and "." in target:
            target = target.rpartition(".")[0]
        if target in modules and target != name:
            out.append(target)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, from module-level and function-level imports."""
    modules = _module_names()
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skip:
                for target in _imported(name, path, node, modules):
                    graph[name].setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "e": {"d": 1}}
    assert cycles(graph) == [frozenset("abc")]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_import_graph_reads_function_level_and_relative_imports() -> None:
    graph = import_graph()
    assert "memplan.model.estimate" in graph["memplan.calibrate.apply"]
    assert "memplan.profile.step" in graph["memplan.profile"]  # inside __getattr__
    assert graph["memplan.profile.step"]["memplan.profile.phases"] > 0


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = set(cycles(graph))
    edges = {c: sorted(f"{a} -> {b} (line {graph[a][b]})" for a in c for b in graph[a] if b in c)
             for c in found}
    assert not found - ALLOWED_CYCLES, {c: edges[c] for c in found - ALLOWED_CYCLES}
    fixed = ALLOWED_CYCLES - found
    assert not fixed, f"fixed, remove from ALLOWED_CYCLES: {fixed}"


def test_calibration_imports_no_layer_above_it() -> None:
    graph = import_graph()
    wrong = {f"{name} -> {target} (line {line})"
             for name, targets in graph.items() if name.startswith("memplan.calibrate")
             for target, line in targets.items()
             if any(target == up or target.startswith(up + ".") for up in ABOVE_CALIBRATION)}
    assert not wrong, sorted(wrong)


def test_top_level_is_a_short_list() -> None:
    """The top level holds the kernel, the typed inputs and the API, at most 16 modules
    (``__init__`` and ``__main__`` counted); planning, measurement readers, the monitor and the
    rest live in their folders (docs/contributing.md)."""
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(modules) <= 16, modules


PLUGINS_CHILD = r"""
import contextlib, io, json, os, sys
import importlib.metadata as md
groups = []
_entry_points = md.entry_points
def _recorded(**k):
    groups.append(k.get("group"))
    return _entry_points(**k)
md.entry_points = _recorded
import memplan.cli
with contextlib.redirect_stdout(io.StringIO()):
    code = memplan.cli.main(["estimate", "--model", "llama-7b", "--gpus", "8", "--json"])
print(json.dumps({"code": code, "groups": groups,
                  "after": os.environ.get("PYDANTIC_DISABLE_PLUGINS"),
                  "pydantic": sorted(m for m in sys.modules if m.split(".")[0] in
                                     ("pydantic", "pydantic_core"))}))
"""


@pytest.mark.parametrize("given", [None, "logfire"])
def test_estimate_imports_no_pydantic_and_restores_the_environment(given) -> None:
    """``memplan estimate`` imports neither pydantic nor pydantic_core: its inputs are records
    (``memplan.choices.Record``) and its option values are converted without typer's pydantic
    adapters (``memplan.cli.PlainValue``), so no plugin scan of every installed
    distribution's entry points (group 'pydantic') happens whatever PYDANTIC_DISABLE_PLUGINS
    says; the caller's PYDANTIC_DISABLE_PLUGINS (which commands that do build pydantic models,
    the calibration files', run with plugins off), unset or set to a plugin name, is what it
    was afterwards."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MEMPLAN_DEBUG", "PYDANTIC_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if given is not None:
        env["PYDANTIC_DISABLE_PLUGINS"] = given
    proc = subprocess.run([sys.executable, "-c", PLUGINS_CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 0
    assert out["after"] == given
    assert out["pydantic"] == []
    assert "pydantic" not in out["groups"]


def test_test_files_have_unique_names() -> None:
    """pytest imports test modules by their basename (no packages under tests/): two files of
    one name in tests/unit and tests/traced stop the whole suite at collection."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
