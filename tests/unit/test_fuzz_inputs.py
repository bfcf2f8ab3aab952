"""Fuzzing the boundary: mutated model files, option values, cut and damaged evidence; every
option of every command and every file reader with hostile values (digits past Python's
limit, size bombs, links to nothing, encodings).

Whatever the input, ``memplan`` answers (exit 0) or refuses in one line (exit 2, ``memplan:
error: ...``), never with a traceback or another exit code; a refused model file is named in
the line. ``monitor-summary`` and ``diagnose --monitor`` read the same files the same way.
Examples are few and derandomised (the same on every run), so the suite stays deterministic
and fast; ``HYPOTHESIS_PROFILE=explore`` searches further.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import pickle
import re
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from toml_literals import toml_value  # tests/unit/toml_literals.py

import memplan
from memplan.cli import COMMANDS, _app_of, main

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE_GZ = (DATA / "traces" / "gloo_2rank" / "rank0.json.gz").read_bytes()
LLAMA = json.loads((DATA / "hf" / "Meta-Llama-3-8B" / "config.json").read_text())
TINY = {
    "source": "fuzz", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 176,
    "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 128,
    "max_seq_len": 256, "norm": "rmsnorm", "mlp": "swiglu", "position": "rope",
    "tied_embeddings": False,
}
FEW = settings(max_examples=40, derandomize=True, deadline=None, database=None)


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_answered_or_refused(argv: list[str], name: str | None = None,
                               no_answer: bool = False) -> tuple[int, str]:
    """``no_answer``: exit 1 with one ``memplan:`` line is allowed too (``plan`` when no
    layout fits)."""
    code, out, err = run(argv)
    assert code in ((0, 1, 2) if no_answer else (0, 2)), (argv, code, err)
    assert "Traceback" not in out + err
    if code == 1:
        assert err.startswith("memplan: ") and err.count("\n") == 1, err
    if code == 2:
        assert err.startswith("memplan: error: ") and err.count("\n") == 1, err
        assert out == ""
        if name is not None:
            assert name in err, err
    return code, out


scalars = st.one_of(
    st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 3, 10**9, 2**63]), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["64", "rmsnorm", "swiglu", "", "true"]))
values = st.one_of(scalars, st.lists(scalars, max_size=3),
                   st.dictionaries(st.sampled_from(["num_experts", "top_k", "x"]), scalars,
                                   max_size=2))
# (key, value) to set, or (key, None) to delete
mutations = st.lists(st.tuples(st.sampled_from([*TINY, "moe", "dropout", "name", "num_layer",
                                                "qkv_bias"]),
                               st.one_of(st.none(), values)), min_size=1, max_size=3)


def mutated(base: dict[str, Any], changes: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes:
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


@FEW
@given(mutations)
def test_mutated_model_toml(changes: list[tuple[str, Any]]) -> None:
    fields = mutated(TINY, changes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.toml"
        path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in fields.items()))
        code, out = assert_answered_or_refused(["estimate", "-m", str(path), "--json"],
                                               name=str(path))
        if code == 0:
            assert json.loads(out)["num_params"] > 0


@FEW
@given(st.lists(st.tuples(st.sampled_from([*LLAMA, "n_layer", "head_dim"]),
                          st.one_of(st.none(), values)), min_size=1, max_size=3))
def test_mutated_hf_config(changes: list[tuple[str, Any]]) -> None:
    data = mutated(LLAMA, changes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(data))
        assert_answered_or_refused(["estimate", "-m", str(path), "-n", "8", "--json"],
                                   name=str(path))


@FEW
@given(st.integers(min_value=0, max_value=400), st.binary(max_size=8),
       st.sampled_from(["toml", "json"]))
def test_damaged_model_bytes(cut: int, noise: bytes, kind: str) -> None:
    """A model file cut at any byte, with any bytes spliced in."""
    text = ("".join(f"{k} = {toml_value(v)}\n" for k, v in TINY.items()) if kind == "toml"
            else json.dumps(LLAMA)).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("m.toml" if kind == "toml" else "config.json")
        path.write_bytes(text[:cut] + noise + text[cut:] if noise else text[:cut])
        assert_answered_or_refused(["estimate", "-m", str(path), "--json"], name=str(path))


option_values = st.one_of(
    st.integers(min_value=-10, max_value=2**40).map(str),
    st.sampled_from(["nan", "inf", "-inf", "1e3", "0x10", "", " 8", "8 ", "1_000", "½", "٣",
                     "2.0", "-0", "true", "none", "80GiB", "0.5GB"]),
    st.text(alphabet="0123456789.-eEGiBxyz ", max_size=8))
ESTIMATE_OPTIONS = ["--gpus", "--tp", "--pp", "--vpp", "--cp", "--ep", "--dp", "--mbs", "--gbs",
                    "--seq", "--zero", "--loss-chunks", "--recompute-layers", "--gpu-memory",
                    "--precision", "--attention", "--schedule", "--framework"]


@FEW
@given(st.lists(st.tuples(st.sampled_from(ESTIMATE_OPTIONS), option_values), min_size=1,
                max_size=3))
def test_estimate_option_values(pairs: list[tuple[str, str]]) -> None:
    argv = ["estimate", "-m", "tiny", "--json"]
    for flag, value in pairs:
        argv += [flag, value]
    code, out = assert_answered_or_refused(argv)
    if code == 0:
        assert json.loads(out)["peak_bytes"] > 0


@settings(max_examples=25, derandomize=True, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from(["--gpus", "--top", "--max-tp", "--safety", "--tp",
                                           "--gbs", "--seq"]), option_values),
                min_size=1, max_size=2))
def test_plan_option_values(pairs: list[tuple[str, str]]) -> None:
    argv = ["plan", "-m", "tiny", "--json"]
    for flag, value in pairs:
        argv += [flag, value]
    assert_answered_or_refused(argv, no_answer=True)


@settings(max_examples=25, derandomize=True, deadline=None, database=None)
@given(st.integers(min_value=0, max_value=len(TRACE_GZ)), st.booleans())
def test_cut_traces(cut: int, plain: bool) -> None:
    """A trace cut anywhere (gzip or plain JSON): read as far as it goes, or refused."""
    data = gzip.decompress(TRACE_GZ) if plain else TRACE_GZ
    data = data[:cut * (len(data) // len(TRACE_GZ)) if plain else cut]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("t.json" if plain else "t.json.gz")
        path.write_bytes(data)
        code, out, err = run(["analyze-trace", str(path), "--json"])
        assert code in (0, 2) and "Traceback" not in err
        assert err.count("\n") <= 1 and str(path) in err or not err
        if code == 0:
            assert json.loads(out)["ranks"][0]["path"] == str(path)


def _records(n: int) -> bytes:
    return "".join(json.dumps({"rank": 0, "step": s, "time": 1.7e9 + s, "step_time_s": 0.5,
                               "allocated_bytes": s * 2**20, "reserved_bytes": 2**30,
                               "peak_bytes": (s + 1) * 2**20, "warnings": []}) + "\n"
                   for s in range(1, n + 1)).encode()


@settings(max_examples=30, derandomize=True, deadline=None, database=None)
@given(st.integers(min_value=0, max_value=len(_records(4))), st.binary(max_size=4),
       st.integers(min_value=0, max_value=len(_records(4))))
def test_monitor_files_read_alike(cut: int, noise: bytes, at: int) -> None:
    """Monitor records cut at any byte, with any bytes spliced in: ``monitor-summary`` and
    ``diagnose --monitor`` accept and refuse the same files, and count the same steps."""
    data = _records(4)[:cut]
    data = data[:at] + noise + data[at:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory_rank0.jsonl"
        path.write_bytes(data)
        summary_code, summary = assert_answered_or_refused(["monitor-summary", str(path),
                                                            "--json"])
        diagnose_code, diagnosed = assert_answered_or_refused(
            ["diagnose", "-m", "tiny", "--no-fixes", "--monitor", str(path), "--json"])
        assert summary_code == diagnose_code
        if summary_code == 0:
            steps = json.loads(summary)["ranks"]["0"]["num_steps"]
            finding = next(f for f in json.loads(diagnosed)["findings"]
                           if f["kind"] == "monitor_peak")
            assert f"{steps} steps" in finding["message"]


# --- every file reader and every option, with hostile values --------------------------------

HUGE_DIGITS = st.integers(min_value=4000, max_value=6000).map(lambda n: "7" * n)
HOSTILE = st.one_of(
    HUGE_DIGITS,  # past int()'s 4300-digit limit
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["nan", "inf", "-inf", "1e999", "-0", "0", "", " ", "\u0663", "\u00b2",
                     "1_0", "9" * 400 + "TiB", "1x99999999999", "[0]*4096*4096*4096",
                     "../../escape", "/dev/zero", "/", "n" * 300, "dangling", "loop", "folder",
                     "\u200b", "\U0001f600", "-m", "--json", "x.png", "tiny", "fp8"]),
    st.text(max_size=16).filter(lambda t: "\x00" not in t))  # argv holds no NUL byte


def _tree(root: Path) -> dict[str, Any]:
    """What is under ``root``: each path's kind and bytes (a link: where it points)."""
    out: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = ("link", os.readlink(path))
        elif path.is_file():
            out[key] = path.read_bytes()
        else:
            out[key] = "dir"
    return out


@contextlib.contextmanager
def _sandbox():
    """An empty working folder with a link to nothing, a link loop and a folder in it, and
    torch unimportable (the torch commands stop at their check for it, after every option
    was checked)."""
    # only these entries of sys.modules are set aside and put back (a whole copy put back
    # would drop modules first imported inside, and numpy cannot be imported twice)
    hidden = {n: m for n, m in sys.modules.items()
              if n == "torch" or n.startswith(("memplan.profile.", "torch."))}
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp), \
            mock.patch.dict(os.environ):
        os.environ.pop("MEMPLAN_DEBUG", None)
        for name in hidden:
            del sys.modules[name]
        sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            root = Path(tmp)
            (root / "dangling").symlink_to(root / "missing")
            (root / "loop").symlink_to(root / "loop")
            (root / "folder").mkdir()
            yield root
        finally:
            for name in [n for n in sys.modules if n == "torch"
                         or n.startswith(("memplan.profile.", "torch."))]:
                del sys.modules[name]
            sys.modules.update(hidden)


def assert_clean(argv: list[str], root: Path, names: tuple[str, ...] = ()) -> int:
    """Exit 0, 1 (``plan``: nothing fits; one line) or 2 (one ``memplan: error:`` line naming
    one of ``names`` when given, nothing on stdout, nothing under ``root`` changed)."""
    before = _tree(root)
    code, out, err = run(argv)
    assert code in (0, 1, 2), (argv, code, err[-2000:])
    assert "Traceback" not in out + err, err[-2000:]
    if code == 0:  # only memplan's own warnings (a cut file read as far as it goes)
        assert all(line.startswith("memplan: warning: ") for line in err.splitlines()), err
    if code in (1, 2):
        assert err.startswith("memplan: ") and err.count("\n") == 1, (argv, err)
    if code == 2:
        assert err.startswith("memplan: error: ") and out == "", (argv, err)
        assert _tree(root) == before, (argv, "changed the file system")
        if "needs torch" not in err:  # (the torch commands stop there, torch hidden)
            assert not names or any(n in err for n in names), (argv, err)
    return code


def _options(command: str) -> list[str]:
    """The options ``command`` takes a value for (typer's own completion options aside)."""
    click = typer.main.get_command(_app_of([command]))
    return sorted(p.opts[0] for p in click.params if p.param_type_name == "option"
                  and not getattr(p, "is_flag", False) and "completion" not in p.opts[0])


MONITOR_SEED = _records(3)
TRACE_SEED = json.dumps({"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": [
    {"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "ts": 0, "dur": 100,
     "tid": 1},
    {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 10, "dur": 50, "tid": 1}]}).encode()
# a command's fixed part: what it needs besides the options fuzzed ({trace}, {monitor}:
# seed files written into the sandbox)
BASES = {"estimate": ["-m", "tiny"], "plan": ["-m", "tiny"],
         "diagnose": ["-m", "tiny", "--no-fixes"], "trace": ["-m", "tiny"],
         "profile": ["-m", "tiny"], "calibrate": ["--device", "cpu"],
         "analyze-trace": ["{trace}"], "monitor-summary": ["{monitor}"],
         "models": [], "gpus": []}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_of_every_command(command: str) -> None:
    """Any value for any option of any command (digits past Python's limit, inf, size bombs,
    links to nothing, device files, long names, words): answered, or refused in one line with
    nothing written."""
    options = _options(command)
    if not options:
        options = ["--width"]

    @settings(max_examples=30, derandomize=True, deadline=None, database=None)
    @given(st.lists(st.tuples(st.sampled_from(options), HOSTILE), min_size=1, max_size=3))
    def check(pairs: list[tuple[str, str]]) -> None:
        with _sandbox() as root:
            (root / "t.json").write_bytes(TRACE_SEED)
            (root / "memory_rank0.jsonl").write_bytes(MONITOR_SEED)
            base = [a.replace("{trace}", "t.json").replace("{monitor}", "memory_rank0.jsonl")
                    for a in BASES[command]]
            argv = [command, *base]
            for flag, value in pairs:
                argv += [flag, value]
            assert_clean(argv, root, names=tuple(f for f, _ in pairs) + tuple(
                v for _, v in pairs if v) + tuple(f.lstrip("-") for f, _ in pairs))

    check()


OOM_SEED = (b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has "
            b"a total capacity of 79.10 GiB of which 1.00 GiB is free. Including non-PyTorch "
            b"memory, this process has 78.09 GiB memory in use. Of the allocated memory 70.00 "
            b"GiB is allocated by PyTorch, and 6.00 GiB is reserved by PyTorch but unallocated.")
# reader -> (command before the path, file name, seed bytes)
READERS: dict[str, tuple[list[str], str, bytes]] = {
    "model-toml": (["estimate", "-m"], "m.toml",
                   "".join(f"{k} = {toml_value(v)}\n" for k, v in TINY.items()).encode()),
    "hf-config": (["estimate", "-n", "8", "-m"], "config.json", json.dumps(LLAMA).encode()),
    "megatron-args": (["estimate", "--megatron-args"], "args.sh",
                      b"torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 "
                      b"--num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
                      b"--vocab-size 128 --num-experts 4 --moe-layer-freq ([0]*1+[1]*3)"),
    "torchtitan": (["estimate", "--torchtitan-config"], "job.toml",
                   b'[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\nseq_len = 128'
                   b'\nlocal_batch_size = 2\n[activation_checkpoint]\nmode = "full"\n'),
    "trace": (["analyze-trace"], "t.json", TRACE_SEED),
    "trace-gz": (["analyze-trace"], "t.json.gz", gzip.compress(TRACE_SEED, mtime=0)),
    "monitor": (["monitor-summary"], "memory_rank0.jsonl", MONITOR_SEED),
    "diagnose-monitor": (["diagnose", "-m", "tiny", "--no-fixes", "--monitor"],
                         "memory_rank0.jsonl", MONITOR_SEED),
    "oom": (["diagnose", "-m", "tiny", "--no-fixes", "--oom"], "oom.txt", OOM_SEED),
    "snapshot": (["diagnose", "-m", "tiny", "--no-fixes", "--trust-pickle", "--snapshot"],
                 "s.pickle", pickle.dumps({"segments": [{"total_size": 2**21,
                                                         "allocated_size": 2**20,
                                                         "blocks": []}]})),
    "profile-summary": (["diagnose", "-m", "tiny", "--no-fixes", "--profile"], "summary.json",
                        json.dumps({"phases": {"1": {"forward": {"peak_bytes": 4096}}},
                                    "num_steps": 1}).encode()),
    "calibration": (["estimate", "-m", "tiny", "--calibration"], "p.json",
                    json.dumps({"schema_version": 1, "kind": "device"}).encode()),
}


def _digits_to_huge(data: bytes, which: int, digits: int) -> bytes:
    """``data`` with its ``which``-th run of digits (cyclically) made ``digits`` long."""
    runs = list(re.finditer(rb"[0-9]+", data))
    if not runs:
        return data + b"7" * digits
    m = runs[which % len(runs)]
    return data[:m.start()] + b"7" * digits + data[m.end():]


mangles = st.one_of(
    st.tuples(st.just("cut"), st.integers(min_value=0, max_value=2000)),
    st.tuples(st.just("splice"), st.integers(min_value=0, max_value=2000), st.binary(max_size=6)),
    # past 64 bits (20 digits), past a float (309), past Python's int() limit (4301)
    st.tuples(st.just("huge"), st.integers(min_value=0, max_value=50),
              st.sampled_from([19, 20, 40, 309, 400, 4300, 4301, 6000])),
    st.tuples(st.just("bom")), st.tuples(st.just("utf16")), st.tuples(st.just("empty")))


def _mangled(seed: bytes, how: tuple[Any, ...]) -> bytes:
    kind = how[0]
    if kind == "cut":
        return seed[:how[1] % (len(seed) + 1)]
    if kind == "splice":
        at = how[1] % (len(seed) + 1)
        return seed[:at] + how[2] + seed[at:]
    if kind == "huge":
        return _digits_to_huge(seed, how[1], how[2])
    if kind == "bom":
        return b"\xef\xbb\xbf" + seed
    if kind == "utf16":
        return seed.decode("latin-1").encode("utf-16")
    return b""


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_file_reader(reader: str) -> None:
    """Every reader on its file cut anywhere, with bytes spliced in, a number made 19 to 6,000
    digits long, a byte-order mark, UTF-16, or nothing: answered, or refused in one line
    naming the file (or the option that gave it), with nothing written."""
    command, name, seed = READERS[reader]

    @settings(max_examples=25, derandomize=True, deadline=None, database=None)
    @given(mangles)
    def check(how: tuple[Any, ...]) -> None:
        with _sandbox() as root:
            data = _mangled(seed if not name.endswith(".gz") else gzip.decompress(seed), how)
            if name.endswith(".gz") and how[0] != "cut":
                data = gzip.compress(data, mtime=0)
            elif name.endswith(".gz"):
                data = seed[:how[1] % (len(seed) + 1)]
            (root / name).write_bytes(data)
            assert_clean([*command, name], root, names=(name, command[-1]))

    check()


# --- the Python API: objects that skipped validation, numpy and other integral types --------

class _Index:
    """An integral type of a user's own (anything with ``__index__``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __index__(self) -> int:
        return self.n


API_VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 3, 8, 64, 2**24, 2**31, 2**63, -1, True, None, 1.5, float("nan"),
                     "8", "", [2], {"x": 1}]),
    st.integers(min_value=-8, max_value=2**40).map(np.int64),
    st.integers(min_value=0, max_value=64).map(_Index))
SPEC_FIELDS = sorted([
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads",
    "head_dim", "vocab_size", "max_seq_len", "sliding_window", "sliding_window_pattern",
    "dropout", "moe", "mla", "tied_embeddings", "norm", "name"])
API_ARGS = ["gpus", "tp", "pp", "dp", "cp", "ep", "vpp", "zero", "micro_batch_size",
            "global_batch_size", "seq_len", "loss_chunks", "recompute_layers", "gpu_memory",
            "stage_layers", "dp_shard"]


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from(SPEC_FIELDS), API_VALUES), max_size=3),
       st.lists(st.tuples(st.sampled_from(API_ARGS), API_VALUES), max_size=3),
       st.booleans())
def test_api_with_any_object(updates: list[tuple[str, Any]], kwargs: list[tuple[str, Any]],
                             construct: bool) -> None:
    """A ModelSpec changed without validation (model_copy's update, or model_construct), and
    any values of the layout and workload arguments (numpy integers and user integral types
    among them): an Estimate, or a MemplanError of one line; never another exception."""
    base = memplan.load_model("tiny")
    fields = {**base.model_dump(), **dict(updates)}
    spec = (memplan.ModelSpec.model_construct(**fields) if construct
            else base.model_copy(update=dict(updates)))
    try:
        est = memplan.estimate(spec, **dict(kwargs))
    except memplan.MemplanError as err:
        assert "\n" not in str(err) and str(err), err
    else:
        assert est.peak_bytes > 0
