"""Fuzzing the boundary: mutated model files, option values, cut and damaged evidence.

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
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from toml_literals import toml_value  # tests/unit/toml_literals.py

from memplan.cli import main

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
