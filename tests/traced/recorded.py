"""Traces kept with what produced them: a traced test re-runs memplan's estimate, and re-runs a
library's trace only when something that made the trace has changed.

A traced test has two halves. The trace runs the library's real code under the tensor tracker:
seconds to minutes per case, and it changes only when the library, torch or memplan's tracing
code changes. The estimate is memplan's analytic model: milliseconds, and it is what most commits
change. ``recorded(fn, *args)`` returns ``fn(*args)`` from a record in ``tests/data/recorded`` when
the record still describes that call exactly, and otherwise runs ``fn``.

A record holds ``fn``'s value (pickled) and everything the value was made from:

- the call: ``fn``'s name and a canonical text of its arguments (a record's file name is the
  SHA-256 of it, so a case's record is replaced, not added to);
- the environment (``environment``): the Python version, torch's build and intra-op thread
  count (Inductor's generated code follows it), the ``TORCH*``/``OMP_*``/``MKL_*`` variables
  set, and the installed version of every distribution whose code ran (torch, transformers,
  ...: a library the trace never ran does not count);
- every function, method, class and module of this repository (``memplan/`` and ``tests/``)
  that ran while ``fn`` ran (``sys.settrace``, calls only), with the classes and functions
  each sits in, and every class of this repository with an object in the value: each as a
  digest of its compiled code (bytecode, names and constants, not line numbers: a change
  elsewhere in the same file does not count). A function's or a class's digest covers the code
  inside it, so a nested function or a method that torch.compile's Dynamo reads without
  running it (``sys.settrace`` never sees it) still counts; a module counts with its own top
  level (constants, imports), its functions and classes by name only. A function of this
  repository that only Dynamo reads, in no class or function that ran, is not followed.
  Besides code, what that code read from another module of the repository counts: the top
  level of a module it read an attribute of or imported a value from (a table, a constant),
  and the whole of a class it named (an enum, a model's fields).

A record matches when the call and the environment are the same and each of those digests is
unchanged in today's source; a change in any of them, or a source file gone, makes the call run
again. Functions of this repository that ran before ``fn`` and left a result behind (a cache)
are cleared first where they are ``functools`` caches, so that they run, and are recorded, inside
``fn``.

``MEMPLAN_TRACES`` chooses what a run does:

- ``use`` (the default): a matching record, else run ``fn``; nothing is written;
- ``record``: a matching record, else run ``fn`` and write its record;
- ``fresh``: run ``fn`` and ignore the records (the suite as it ran before records existed);
- ``verify``: run ``fn`` and fail if a matching record holds another value.

Re-record after changing tracing code or a library version with
``MEMPLAN_TRACES=record pytest tests/traced`` (docs/contributing.md).
"""

from __future__ import annotations

import enum
import functools
import gzip
import hashlib
import importlib.metadata
import os
import pickle
import sys
import threading
import types
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent.parent
RECORDS = ROOT / "tests" / "data" / "recorded"
# the source trees whose code a record follows (not the virtual environment inside the root)
_SOURCES = tuple(str(ROOT / d) + os.sep for d in ("memplan", "tests"))
_SELF = str(Path(__file__).resolve())  # the records' own machinery, not what made a value
_ENV_PREFIXES = ("TORCH", "OMP_", "MKL_")
_ENV_IGNORED = ("TORCHINDUCTOR_CACHE_DIR",)  # where compiled artefacts live, not what they are
MODES = ("use", "record", "fresh", "verify")
FORMAT = 1


class RecordMismatch(AssertionError):
    """``verify``: a matching record holds another value than the call just made."""


def mode() -> str:
    m = os.environ.get("MEMPLAN_TRACES", "use")
    if m not in MODES:
        raise ValueError(f"MEMPLAN_TRACES={m!r}: expected one of {', '.join(MODES)}")
    return m


def recorded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, from its record where one matches (see the module's text)."""
    m = mode()
    try:
        call = f"{fn.__module__}.{fn.__qualname__}{canonical((args, kwargs))}"
    except TypeError:  # arguments with no text the same in every process: no record
        return fn(*args, **kwargs)
    key = hashlib.sha256(call.encode()).hexdigest()
    path = RECORDS / fn.__qualname__.replace(".", "_") / f"{key[:24]}.pkl.gz"
    if m == "fresh":
        return fn(*args, **kwargs)
    _note_used(path)
    record = _load(path, call) if path.exists() else None
    if m == "use":
        return record["value"] if record is not None else fn(*args, **kwargs)
    if m == "verify":
        value = fn(*args, **kwargs)
        if record is not None and not _same(record["value"], value):
            raise RecordMismatch(f"{path.relative_to(ROOT)}: the record of {call[:200]} holds "
                                 "another value than the call made now")
        return value
    if record is not None:
        return record["value"]
    value, code, libraries = _run_collecting(fn, args, kwargs)
    _write(path, call, value, code, environment(libraries))
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal values (their own ``==``: dataclasses and models field by field), or, for types
    without one, the same pickled bytes (which a shared object pickled once or twice can
    make differ between equal values)."""
    try:
        if a == b:
            return True
    except Exception:  # an ``==`` that raises (a tensor's): compare the bytes
        pass
    return pickle.dumps(a) == pickle.dumps(b)


def _note_used(path: Path) -> None:
    """``MEMPLAN_TRACES_USED=FILE``: each record a call looks up, a line of ``FILE`` (for
    ``prune``)."""
    out = os.environ.get("MEMPLAN_TRACES_USED")
    if out:
        with open(out, "a") as f:
            f.write(f"{path.relative_to(RECORDS)}\n")


def prune(used: Path) -> list[Path]:
    """Delete the records no call looked up in the run that wrote ``used``
    (``MEMPLAN_TRACES_USED``): the records of cases since removed. The deleted paths."""
    keep = set(used.read_text().split())
    gone = [p for p in sorted(RECORDS.rglob("*.pkl.gz"))
            if str(p.relative_to(RECORDS)) not in keep]
    for p in gone:
        p.unlink()
    return gone


# --- the call and the environment as text ----------------------------------------------------

def canonical(obj: Any) -> str:
    """A text of ``obj`` that is the same in every process: dict keys and set members sorted,
    dataclasses and pydantic models by their fields, enums by name. Raises ``TypeError`` for an
    object whose text would name its address."""
    if isinstance(obj, (str, int, float, bool, type(None), bytes)):
        return repr(obj)
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__qualname__}.{obj.name}"
    if isinstance(obj, dict):
        items = sorted((canonical(k), canonical(v)) for k, v in obj.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(obj, (set, frozenset)):
        return f"{type(obj).__name__}({{{', '.join(sorted(canonical(v) for v in obj))}}})"
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__}[{', '.join(canonical(v) for v in obj)}]"
    if is_dataclass(obj) and not isinstance(obj, type):
        inner = ", ".join(f"{f.name}={canonical(getattr(obj, f.name))}" for f in fields(obj))
        return f"{type(obj).__qualname__}({inner})"
    dump = getattr(obj, "model_dump", None)
    if callable(dump):  # a pydantic model
        return f"{type(obj).__qualname__}({canonical(dump())})"
    if isinstance(obj, types.FunctionType):  # by name, with what its closure and defaults hold
        cells = [c.cell_contents for c in obj.__closure__ or ()]
        return (f"<{obj.__module__}.{obj.__qualname__} {canonical(cells)} "
                f"{canonical(obj.__defaults__)} {canonical(obj.__kwdefaults__)}>")
    if isinstance(obj, type):
        return f"<{obj.__module__}.{obj.__qualname__}>"
    text = repr(obj)
    if " at 0x" in text:
        raise TypeError(f"no canonical text for {type(obj).__qualname__}: {text[:80]}")
    return text


@functools.cache
def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def environment(libraries: Iterable[str] = ()) -> dict[str, Any]:
    """What a trace depends on beyond its call and this repository's code: the Python
    version, torch's build and intra-op thread count (Inductor's generated code follows it),
    the ``TORCH*``/``OMP_*``/``MKL_*`` variables set, and the installed versions of the
    distributions ``libraries`` (those whose code ran; torch always)."""
    import torch

    env = {k: v for k, v in os.environ.items()
           if k.startswith(_ENV_PREFIXES) and k not in _ENV_IGNORED}
    return {"python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "versions": {d: _version(d) for d in sorted({"torch", *libraries})},
            "torch_git": torch.version.git_version, "threads": torch.get_num_threads(),
            "env": dict(sorted(env.items())), "format": FORMAT}


@functools.cache
def _distributions() -> dict[str, tuple[str, ...]]:
    return {k: tuple(v) for k, v in importlib.metadata.packages_distributions().items()}


def _libraries(files: Iterable[str]) -> set[str]:
    """The installed distributions the source files ``files`` belong to."""
    tops = set()
    for file in files:
        for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
            _, found, rest = file.partition(marker)
            if found:
                tops.add(rest.split(os.sep, 1)[0].removesuffix(".py"))
    dists = _distributions()
    return {d for top in tops for d in dists.get(top, ())}


# --- the code a call ran ----------------------------------------------------------------------

def _const_text(c: Any, nested: bool) -> str:
    if isinstance(c, types.CodeType):
        return _digest(c) if nested else f"<code {c.co_qualname}>"
    if isinstance(c, frozenset):
        return "frozenset(" + ",".join(sorted(_const_text(v, nested) for v in c)) + ")"
    if isinstance(c, tuple):
        return "(" + ",".join(_const_text(v, nested) for v in c) + ")"
    return repr(c)


def _digest(code: types.CodeType, top: bool = False) -> str:
    """A code object's own instructions, names and constants, not its line numbers or file;
    with the digests of the code inside it (a function's nested functions, a class's
    methods: code that torch.compile's Dynamo reads without running it, unseen by
    ``sys.settrace``), except at a module's top level (``top``), where they are named."""
    h = hashlib.sha256()
    for part in (code.co_code, repr(code.co_names).encode(), repr(code.co_varnames).encode(),
                 repr(code.co_freevars).encode(), repr(code.co_cellvars).encode(),
                 f"{code.co_argcount},{code.co_posonlyargcount},{code.co_kwonlyargcount},"
                 f"{code.co_flags}".encode(),
                 "|".join(_const_text(c, not top) for c in code.co_consts).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:32]


MODULE = "<module>"


@functools.lru_cache(maxsize=None)
def _index_of(path: str, source: bytes) -> dict[str, frozenset[str]] | None:
    """Each code object's qualified name in ``source`` (the file ``path``; ``<module>`` for its
    top level) and the digests of the code objects of that name (lambdas and comprehensions
    share theirs). None when it does not compile."""
    try:
        top = compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return None
    out: dict[str, set[str]] = {}
    stack = [top]
    while stack:
        code = stack.pop()
        name = MODULE if code is top else code.co_qualname
        out.setdefault(name, set()).add(_digest(code, top=code is top))
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return {k: frozenset(v) for k, v in out.items()}


def index(path: str) -> dict[str, frozenset[str]] | None:
    """``_index_of`` the file as it is now (read each time; compiled once per content). None
    when it is gone."""
    try:
        source = Path(path).read_bytes()
    except OSError:
        return None
    return _index_of(path, source)


def _enclosing(qualname: str) -> list[str]:
    """The classes and functions a qualified name sits in (``A.f.<locals>.g``: ``A``,
    ``A.f``), whose bodies made it."""
    out, prefix = [], []
    for p in qualname.split(".")[:-1]:
        prefix.append(p)
        if p != "<locals>":
            out.append(".".join(prefix))
    return out


def _ran_code(code_objects: Iterable[types.CodeType], classes: set[type],
              modules: set[str] = frozenset()) -> dict[str, dict[str, list[str]]]:
    """{file relative to the root: {qualified name: digests}} for the code that ran and the
    classes named, with their modules' top levels and the bodies they sit in, and the top
    levels of the source files ``modules``."""
    names: dict[str, set[str]] = {file: {MODULE} for file in modules}
    for code in code_objects:
        names.setdefault(code.co_filename, set()).update(
            [code.co_qualname, MODULE, *_enclosing(code.co_qualname)])
    for cls in classes:
        file = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if file and file.startswith(_SOURCES):
            names.setdefault(file, set()).update(
                [cls.__qualname__, MODULE, *_enclosing(cls.__qualname__)])
    out: dict[str, dict[str, list[str]]] = {}
    for file, quals in sorted(names.items()):
        idx = index(file)
        if idx is None:
            raise RuntimeError(f"{file}: ran during a recorded call but has no source")
        rel = os.path.relpath(file, ROOT)
        # a name compiled from no file entry (a generated method) is followed by its class
        out[rel] = {q: sorted(idx[q]) for q in sorted(quals) if q in idx}
    return out


def _matches(code: dict[str, dict[str, list[str]]]) -> bool:
    for rel, quals in code.items():
        idx = index(str(ROOT / rel))
        if idx is None:
            return False
        for q, digests in quals.items():
            if q not in idx or not set(digests) <= idx[q]:
                return False
    return True


def _clear_repo_caches() -> None:
    """Empty the ``functools`` caches of this repository's functions, so that what they compute
    is computed again inside the recorded call, and recorded."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None) or ""
        if not file.startswith(_SOURCES):
            continue
        for value in list(vars(module).values()):
            candidates = [value, *(vars(value).values() if isinstance(value, type) else ())]
            for c in candidates:
                clear = getattr(c, "cache_clear", None)
                if callable(clear) and getattr(c, "__module__", None) == module.__name__:
                    clear()


def _run_collecting(fn: Callable[..., T], args: tuple, kwargs: dict
                    ) -> tuple[T, dict[str, dict[str, list[str]]], set[str]]:
    _clear_repo_caches()
    seen: dict[types.CodeType, dict[str, Any]] = {}  # the code that ran, and its globals
    others: set[str] = set()  # the files of other code that ran (installed libraries)

    def tracer(frame: types.FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if code in seen:
            return None
        if code.co_filename.startswith(_SOURCES):
            if code.co_filename != _SELF:
                seen[code] = frame.f_globals
        else:
            others.add(code.co_filename)
        return None

    try:  # Dynamo would compile the tracer's own frames (and fail on ``seen``'s code keys)
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        pass
    else:
        skip_code(tracer.__code__)
    old, old_threading = sys.gettrace(), threading.gettrace()
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        value = fn(*args, **kwargs)
    finally:
        sys.settrace(old)
        threading.settrace(old_threading)  # type: ignore[arg-type]
    modules, named = _globals_read(seen)
    return value, _ran_code(seen, _repo_classes(value) | named, modules), _libraries(others)


_SCALARS = (int, float, complex, str, bytes, bool, type(None))


def _repo_file(obj: Any) -> str | None:
    file = getattr(obj, "__file__", None) or ""
    return file if file.startswith(_SOURCES) and file != _SELF else None


@functools.lru_cache(maxsize=None)
def _imported_names(path: str, source: bytes) -> frozenset[str]:
    """The names the module's top level binds by ``import`` (values defined elsewhere)."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return frozenset()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(out)


def _globals_read(seen: dict[types.CodeType, dict[str, Any]]) -> tuple[set[str], set[type]]:
    """What the code that ran read from other modules of this repository, besides code: the
    source files whose top level defines a value it named (a module it reads attributes of;
    a table, an object or a constant it imported: the module that defines it, not those that
    import it) and the classes it named (an enum's members, a model's fields)."""
    defined: dict[str, list[tuple[str, Any]]] = {}  # name -> (file, value) where defined
    for module in [m for m in list(sys.modules.values()) if _repo_file(m)]:
        file = module.__file__
        try:
            imported = _imported_names(file, Path(file).read_bytes())
        except OSError:
            continue
        for name, value in vars(module).items():
            if name.startswith("__") or name in imported or isinstance(
                    value, (types.ModuleType, type, types.FunctionType)):
                continue
            defined.setdefault(name, []).append((file, value))
    by_id = {id(v): f for entries in defined.values() for f, v in entries
             if not isinstance(v, _SCALARS)}
    files: set[str] = set()
    classes: set[type] = set()
    for code, g in seen.items():
        for name in code.co_names:
            if name.startswith("__") or name not in g:
                continue
            value = g[name]
            if isinstance(value, types.ModuleType):
                files.update(f for f in [_repo_file(value)] if f)
            elif isinstance(value, type):
                if _repo_file(sys.modules.get(value.__module__)):
                    classes.add(value)
            elif isinstance(value, _SCALARS):
                files.update(f for f, v in defined.get(name, ())
                             if type(v) is type(value) and v == value)
            elif not isinstance(value, types.FunctionType):
                # where it is defined under this name, else under any name
                same = [f for f, v in defined.get(name, ()) if v is value]
                if not same and id(value) in by_id:
                    same = [by_id[id(value)]]
                files.update(same)
    return files, classes


def _repo_classes(value: Any) -> set[type]:
    """The classes of this repository with an object in ``value`` (as pickle walks it)."""
    found: set[type] = set()

    class Walker(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            cls = obj if isinstance(obj, type) else type(obj)
            module = sys.modules.get(getattr(cls, "__module__", ""), None)
            if (getattr(module, "__file__", None) or "").startswith(_SOURCES):
                found.add(cls)
            return NotImplemented

    import io

    Walker(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return found


# --- records on disk --------------------------------------------------------------------------

def _load(path: Path, call: str) -> dict[str, Any] | None:
    try:
        with gzip.open(path, "rb") as f:
            head = pickle.load(f)
            if head.get("call") != call or head.get("format") != FORMAT:
                return None
            recorded_env = head["environment"]
            if recorded_env != environment(recorded_env["versions"]):
                return None
            if not _matches(head["code"]):
                return None
            head["value"] = pickle.load(f)
    except Exception:  # a record that cannot be read is no record: the call runs
        return None
    return head


def _write(path: Path, call: str, value: Any, code: dict[str, dict[str, list[str]]],
           env: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    head = {"format": FORMAT, "call": call, "environment": env, "code": code}
    try:
        # mtime 0: the same record is the same bytes
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            pickle.dump(head, f, protocol=4)
            pickle.dump(value, f, protocol=4)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# --- memplan.profile.frameworks' traces, kept ------------------------------------------------

def kept_trace_case(case: Any, *, fake: bool | None = None, steps: int = 2) -> tuple[Any, Any]:
    """``frameworks.trace_case`` through the records (``recorded``)."""
    from kept_traces import framework_trace  # tests/traced/kept_traces.py

    return recorded(framework_trace, case, fake, steps)


def compare_framework(case: Any, *, fake: bool | None = None, steps: int = 2) -> Any:
    """``frameworks.compare_framework`` with the trace through the records: the estimate and
    the comparison run every time."""
    from memplan.profile import frameworks

    return frameworks.compare_framework(case, fake=fake, steps=steps, trace=kept_trace_case)


def fake_real_check(case: Any, steps: int = 2) -> Any:
    """``frameworks.fake_real_check`` with both traces through the records."""
    from memplan.profile import frameworks

    return frameworks.fake_real_check(case, steps=steps, trace=kept_trace_case)


# --- memplan.profile.compiled_trace's compiled layers, kept ----------------------------------

def compiled_layer_step(*args: Any, **kwargs: Any) -> Any:
    """``compiled_trace.compiled_layer_step`` through the records."""
    from memplan.profile import compiled_trace

    return recorded(compiled_trace.compiled_layer_step, *args, **kwargs)


def compiled_layer_peaks(*args: Any, **kwargs: Any) -> Any:
    """``compiled_trace.compiled_layer_peaks`` through the records."""
    from memplan.profile import compiled_trace

    return recorded(compiled_trace.compiled_layer_peaks, *args, **kwargs)


def compiled_layer_saved(*args: Any, **kwargs: Any) -> Any:
    """``compiled_trace.compiled_layer_saved`` through the records."""
    from memplan.profile import compiled_trace

    return recorded(compiled_trace.compiled_layer_saved, *args, **kwargs)


# --- memplan.profile.compare's reference-model traces, kept ----------------------------------

def compare(spec: Any, par: Any, wl: Any, *, steps: int = 2, fake: bool = True) -> Any:
    """``compare.compare`` with the reference model's trace through the records: the estimate
    and the comparison run every time."""
    from memplan.profile import compare as module

    def kept(spec: Any, par: Any, wl: Any, *, steps: int, fake: bool) -> Any:
        return recorded(module.run_trace, spec, par, wl, steps=steps, fake=fake)

    return module.compare(spec, par, wl, steps=steps, fake=fake, trace=kept)


if __name__ == "__main__":
    # python tests/traced/recorded.py prune USED: after a whole run of tests/traced with
    # MEMPLAN_TRACES=record MEMPLAN_TRACES_USED=USED
    if len(sys.argv) != 3 or sys.argv[1] != "prune":
        sys.exit("usage: python tests/traced/recorded.py prune USED")
    for gone in prune(Path(sys.argv[2])):
        print(f"deleted {gone.relative_to(ROOT)}")
