"""A corpus of bad input, damaged files and wrong outputs: one clear line every time.

Every case runs ``memplan`` the way a user would (``memplan.cli.main`` with a command line,
files written to a temporary folder, the working directory an empty folder) and asserts the
contract: exit code 2, exactly one line on stderr (``memplan: error: ...``) naming the field or
file and the numbers, nothing on stdout, no traceback, and the file system afterwards exactly
as before (nothing created, nothing changed, nothing half-written). The Python API's cases
assert a ``MemplanError`` naming the argument, and no other exception.

Kinds: option types and ranges of every command; model files (TOML and JSON: booleans,
strings and floats where integers belong, absurd sizes, nesting, syntax, encodings, devices);
every evidence reader (profiler traces, monitor records, OOM logs, snapshots, profile
summaries, calibration profiles) on missing, non-regular, binary, cut and wrong-shaped files;
output folders (an existing file, a file in the way, a run name that leaves ``--out``); the
Python API's arguments.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from toml_literals import toml_value  # tests/unit/toml_literals.py

import memplan
from memplan.cli import main
from memplan.errors import MemplanError

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE_GZ = (DATA / "traces" / "gloo_2rank" / "rank0.json.gz").read_bytes()
TRACE = json.loads(gzip.decompress(TRACE_GZ))
LLAMA_CONFIG = json.loads((DATA / "hf" / "Meta-Llama-3-8B" / "config.json").read_text())
TINY_TOML = {
    "source": "test", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 176,
    "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 128,
    "max_seq_len": 256, "norm": "rmsnorm", "mlp": "swiglu", "position": "rope",
    "tied_embeddings": False,
}


# --- helpers -------------------------------------------------------------------------------

def toml_text(fields: dict[str, Any]) -> str:
    return "".join(f"{k} = {toml_value(v)}\n" for k, v in fields.items())


def tiny_toml(**changes: Any) -> str:
    """The tiny spec as TOML with ``changes`` (a value of ``...`` removes the key)."""
    fields = {**TINY_TOML, **changes}
    return toml_text({k: v for k, v in fields.items() if v is not ...})


def llama_json(**changes: Any) -> str:
    return json.dumps({k: v for k, v in {**LLAMA_CONFIG, **changes}.items() if v is not ...})


def record(rank: int = 0, step: int = 1, **changes: Any) -> dict[str, Any]:
    """One MemoryMonitor record (memplan.monitor's keys)."""
    return {"rank": rank, "step": step, "time": 1.7e9 + step, "step_time_s": 0.5,
            "allocated_bytes": 2**30, "reserved_bytes": 2**31, "peak_bytes": 2**30,
            "capacity_bytes": 80 * 2**30, "fragmentation_bytes": 2**30,
            "headroom_bytes": 78 * 2**30, "warnings": [], **changes}


def jsonl(*records: Any) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def trace_with(*events: Any, **top: Any) -> str:
    return json.dumps({"distributedInfo": {"rank": 0, "world_size": 1}, **top,
                       "traceEvents": list(events)})


X = {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 10.0, "dur": 5.0, "tid": 1}


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _tree(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every file and folder under ``root``: its kind, size and content hash (and mode)."""
    out: dict[str, tuple[Any, ...]] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():  # a link (maybe to nothing, or to itself): where it points
            out[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            out[rel] = ("dir", path.stat().st_mode)
        elif path.is_file():
            out[rel] = ("file", path.stat().st_size, hashlib.sha1(path.read_bytes()).hexdigest())
        else:  # a FIFO: reading it would wait for a writer
            out[rel] = ("special", path.stat().st_mode)
    return out


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An input folder ``in`` and an empty working directory ``cwd`` under ``tmp_path``."""
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    (tmp_path / "in").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


def assert_refused(argv: list[str], mentions: list[str], root: Path,
                   capsys: pytest.CaptureFixture[str]) -> str:
    """``memplan argv`` exits 2 with one line naming ``mentions`` and leaves ``root`` as it was."""
    before = _tree(root)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, out[-300:], err)
    assert err.startswith("memplan: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in out + err and out == "", (out, err)
    for text in mentions:
        assert text in err, (text, err)
    assert _tree(root) == before, "the command changed the file system"
    return err


# --- 1. options of every command -----------------------------------------------------------

E = ["estimate", "-m", "tiny"]
P = ["plan", "-m", "tiny"]
OPTION_CASES: dict[str, tuple[list[str], list[str]]] = {
    "gpus-zero": ([*E, "--gpus", "0"], ["gpus", "0"]),
    "gpus-negative": ([*E, "-n", "-3"], ["gpus", "-3"]),
    "gpus-fraction": ([*E, "--gpus", "1.5"], ["--gpus", "1.5"]),
    "gpus-word": ([*E, "--gpus", "eight"], ["--gpus", "eight"]),
    "gpus-over-limit": ([*E, "--gpus", str(2**25)], ["gpus", "16777216", str(2**25)]),
    "tp-zero": ([*E, "--tp", "0"], ["tp", "0"]),
    "tp-splits-no-gpus": ([*E, "-n", "8", "--tp", "3"], ["gpus (8)", "tp", "3"]),
    "tp-over-heads": ([*E, "-n", "8", "--tp", "8"], ["tp (8)", "num_attention_heads (4)"]),
    "pp-negative": ([*E, "--pp", "-1"], ["pp", "-1"]),
    "pp-over-layers": ([*E, "-n", "4", "--pp", "4"], ["pp", "4", "2"]),
    "vpp-zero": ([*E, "--vpp", "0"], ["vpp", "0"]),
    "cp-zero": ([*E, "--cp", "0"], ["cp", "0"]),
    "ep-zero": ([*E, "--ep", "0"], ["ep", "0"]),
    "ep-dense": ([*E, "-n", "2", "--ep", "2"], ["ep (2)"]),
    "dp-zero": ([*E, "--dp", "0"], ["dp", "0"]),
    "dp-mismatch": ([*E, "-n", "8", "--dp", "3"], ["dp", "3", "8"]),
    "zero-five": ([*E, "--zero", "5"], ["--zero", "5"]),
    "zero-word": ([*E, "--zero", "full"], ["--zero", "full"]),
    "mbs-zero": ([*E, "--mbs", "0"], ["mbs", "0"]),
    "mbs-fraction": ([*E, "--mbs", "1.5"], ["--mbs", "1.5"]),
    "mbs-over-limit": ([*E, "--mbs", str(2**30)], ["mbs", str(2**30), "16777216"]),
    "gbs-zero": ([*E, "--gbs", "0"], ["gbs", "0"]),
    "gbs-not-a-multiple": ([*E, "-n", "8", "--mbs", "2", "--gbs", "12"], ["gbs (12)", "16"]),
    "gbs-over-limit": ([*E, "--gbs", str(10**21)], ["gbs", str(10**21)]),
    "seq-zero": ([*E, "--seq", "0"], ["seq", "0"]),
    "seq-over-limit": ([*E, "--seq", str(2**30)], ["seq", str(2**30), "16777216"]),
    "seq-cp-odd": ([*E, "-n", "2", "--cp", "2", "--seq", "127"], ["seq (127)", "cp"]),
    "recompute-word": ([*E, "--recompute", "some"], ["--recompute", "some"]),
    "recompute-layers-negative": ([*E, "--recompute", "full", "--recompute-layers", "-1"],
                                  ["recompute-layers", "-1"]),
    "recompute-layers-over": ([*E, "--recompute", "full", "--recompute-layers", "100"],
                              ["recompute_layers", "100", "2"]),
    "recompute-layers-without-full": ([*E, "--recompute-layers", "1"], ["recompute_layers"]),
    "recompute-every-zero": ([*E, "--recompute", "full", "--recompute-every", "0"],
                             ["recompute-every", "0"]),
    "recompute-every-without-full": ([*E, "--recompute-every", "2"], ["recompute_every"]),
    "precision-word": ([*E, "--precision", "bf17"], ["--precision", "bf17"]),
    "optimizer-word": ([*E, "--optimizer", "adamz"], ["--optimizer", "adamz"]),
    "optimizer-impl-word": ([*E, "--optimizer-impl", "turbo"], ["--optimizer-impl", "turbo"]),
    "attention-word": ([*E, "--attention", "sparse"], ["--attention", "sparse"]),
    "norm-word": ([*E, "--norm", "batch"], ["--norm", "batch"]),
    "loss-chunks-zero": ([*E, "--loss-chunks", "0"], ["loss-chunks", "0"]),
    "loss-chunks-fraction": ([*E, "--loss-chunks", "2.5"], ["--loss-chunks", "2.5"]),
    "framework-word": ([*E, "--framework", "jax"], ["--framework", "jax"]),
    "tp-style-word": ([*E, "--tp-style", "zz"], ["--tp-style", "zz"]),
    "grad-buffers-word": ([*E, "--grad-buffers", "zz"], ["--grad-buffers", "zz"]),
    "offload-word": ([*E, "--offload", "everything"], ["--offload", "everything"]),
    "offload-without-zero": ([*E, "--offload", "optimizer"], ["offload", "zero"]),
    "schedule-word": ([*E, "--schedule", "zigzag"], ["--schedule", "zigzag"]),
    "gpu-unknown": ([*E, "--gpu", "h900"], ["h900"]),
    "gpu-memory-unit": ([*E, "--gpu-memory", "80XB"], ["gpu_memory", "80XB"]),
    "gpu-memory-zero": ([*E, "--gpu-memory", "0GB"], ["gpu_memory", "0GB"]),
    "gpu-memory-negative": ([*E, "--gpu-memory", "-5GiB"], ["gpu_memory", "-5GiB"]),
    "gpu-memory-nan": ([*E, "--gpu-memory", "nan"], ["gpu_memory", "nan"]),
    "gpu-memory-empty": ([*E, "--gpu-memory", ""], ["gpu_memory"]),
    "model-unknown": (["estimate", "-m", "llama-9"], ["llama-9"]),
    "model-empty": (["estimate", "-m", ""], ["model"]),
    "model-missing": (["estimate", "-n", "8"], ["--model"]),
    "option-unknown": ([*E, "--bogus"], ["--bogus"]),
    "calibration-missing": ([*E, "--calibration", "nowhere.json"], ["nowhere.json"]),
    "plan-top-negative": ([*P, "--top", "-1"], ["--top", "-1"]),
    "plan-top-zero": ([*P, "--top", "0"], ["--top", "0"]),
    "plan-max-tp-negative": ([*P, "--max-tp", "-4"], ["--max-tp", "-4"]),
    "plan-max-tp-zero": ([*P, "--max-tp", "0"], ["--max-tp", "0"]),
    "plan-safety-one": ([*P, "--safety", "1"], ["safety", "1"]),
    "plan-safety-negative": ([*P, "--safety", "-0.1"], ["--safety", "-0.1"]),
    "plan-safety-nan": ([*P, "--safety", "nan"], ["--safety", "nan"]),
    "plan-gpus-zero": ([*P, "-n", "0"], ["gpus", "0"]),
    "plan-gpus-fraction": ([*P, "-n", "1.5"], ["--gpus", "1.5"]),
    "plan-tp-splits-no-gpus": ([*P, "-n", "8", "--tp", "3"], ["gpus (8)", "tp (3)"]),
    "plan-tp-over-heads": ([*P, "-n", "8", "--tp", "8"], ["tp (8)", "num_attention_heads (4)"]),
    "plan-pp-over-layers": ([*P, "-n", "6", "--pp", "3"], ["pp (3)", "num_layers (2)"]),
    "plan-recompute-word": ([*P, "--recompute", "most"], ["--recompute", "most"]),
    "plan-zero-four": ([*P, "--zero", "4"], ["--zero", "4"]),
    "plan-gbs-zero": ([*P, "--gbs", "0"], ["gbs", "0"]),
    "diagnose-oom-missing": (["diagnose", "-m", "tiny", "--oom", "none.txt"], ["none.txt"]),
    "diagnose-monitor-missing": (["diagnose", "-m", "tiny", "--monitor", "none"], ["none"]),
    "diagnose-profile-missing": (["diagnose", "-m", "tiny", "--profile", "none"], ["none"]),
    "diagnose-snapshot-untrusted": (["diagnose", "-m", "tiny", "--snapshot", "s.pickle"],
                                    ["s.pickle", "--trust-pickle"]),
    "diagnose-snapshot-missing": (["diagnose", "-m", "tiny", "--snapshot", "s.pickle",
                                   "--trust-pickle"], ["s.pickle"]),
    "trace-steps-one": (["trace", "-m", "tiny", "--steps", "1"], ["steps (1)"]),
    "trace-layers-zero": (["trace", "-m", "tiny", "--layers", "0"], ["layers (0)", "2"]),
    "trace-pp": (["trace", "-m", "tiny", "-n", "2", "--pp", "2"], ["pipeline"]),
    "profile-steps-one": (["profile", "-m", "tiny", "--steps", "1"], ["steps (1)"]),
    "profile-layers-over": (["profile", "-m", "tiny", "--layers", "9"], ["layers (9)", "2"]),
    "profile-perf-fake": (["profile", "-m", "tiny", "--perf"], ["--perf", "--real"]),
    "profile-device-word": (["profile", "-m", "tiny", "--device", "tpu"], ["--device", "tpu"]),
    "calibrate-nproc-zero": (["calibrate", "--nproc", "0"], ["nproc (0)"]),
    "calibrate-module-on-cuda": (["calibrate", "--module", "m.py:f"], ["module", "--device cpu"]),
    "calibrate-module-no-factory": (["calibrate", "--device", "cpu", "--module", "m.py"],
                                    ["module", "m.py"]),
    "calibrate-fsdp-precision": (["calibrate", "--precision", "fsdp-bf16"], ["fsdp-bf16"]),
    "analyze-pct-negative": (["analyze-trace", "--straggler-pct", "-5", "t.json"],
                             ["--straggler-pct", "-5"]),
    "analyze-pct-over": (["analyze-trace", "--straggler-pct", "101", "t.json"],
                         ["--straggler-pct", "101"]),
    "analyze-pct-nan": (["analyze-trace", "--straggler-pct", "nan", "t.json"],
                        ["--straggler-pct", "nan"]),
    "analyze-missing": (["analyze-trace", "t.json"], ["t.json", "no such file"]),
    "analyze-no-paths": (["analyze-trace"], ["paths"]),
    "monitor-summary-missing": (["monitor-summary", "none"], ["none", "no such file"]),
    "monitor-summary-no-paths": (["monitor-summary"], ["paths"]),
    "command-unknown": (["estimat", "-m", "tiny"], ["estimat"]),
}


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_bad_option(case: str, sandbox: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, mentions = OPTION_CASES[case]
    assert_refused(argv, mentions, sandbox, capsys)


# --- 2. model files ------------------------------------------------------------------------

# name -> (file name, content, mentions); "{f}" in a mention is the file's path
MODEL_CASES: dict[str, tuple[str, str | bytes, list[str]]] = {
    "toml-bool-layers": ("m.toml", tiny_toml(num_layers=True),
                         ["{f}", "num_layers", "integer", "true"]),
    "toml-bool-false-heads": ("m.toml", tiny_toml(num_attention_heads=False),
                              ["num_attention_heads", "false"]),
    "toml-string-hidden": ("m.toml", tiny_toml(hidden_size="64"), ["hidden_size", "'64'"]),
    "toml-float-heads": ("m.toml", tiny_toml(num_kv_heads=2.0), ["num_kv_heads", "2.0"]),
    "toml-negative-vocab": ("m.toml", tiny_toml(vocab_size=-128), ["vocab_size", "-128"]),
    "toml-zero-layers": ("m.toml", tiny_toml(num_layers=0), ["num_layers", "0"]),
    "toml-billion-layers": ("m.toml", tiny_toml(num_layers=10**9),
                            ["num_layers", "10000", "1000000000"]),
    "toml-huge-layers": ("m.toml", tiny_toml(num_layers=2**62), ["num_layers", str(2**62)]),
    "toml-unknown-key": ("m.toml", tiny_toml(num_layer=3), ["num_layer", "Extra"]),
    "toml-missing-key": ("m.toml", tiny_toml(vocab_size=...), ["vocab_size", "required"]),
    "toml-bad-enum": ("m.toml", tiny_toml(norm="batchnorm"), ["norm", "batchnorm"]),
    "toml-int-bool": ("m.toml", tiny_toml(tied_embeddings=1), ["tied_embeddings", "1"]),
    "toml-string-dropout": ("m.toml", tiny_toml(dropout="0.1"), ["dropout", "'0.1'"]),
    "toml-dropout-one": ("m.toml", tiny_toml(dropout=1.5), ["dropout", "1.5"]),
    "toml-nan-dropout": ("m.toml", tiny_toml(dropout=float("nan")), ["dropout", "nan"]),
    "toml-kv-heads-divide": ("m.toml", tiny_toml(num_kv_heads=3),
                             ["num_kv_heads (3)", "num_attention_heads (4)"]),
    "toml-moe-bool-experts": ("m.toml", tiny_toml(moe={"num_experts": True, "top_k": 1,
                                                        "expert_ffn_hidden_size": 8}),
                              ["moe.num_experts", "true"]),
    "toml-moe-million-experts": ("m.toml", tiny_toml(moe={"num_experts": 10**7, "top_k": 1,
                                                          "expert_ffn_hidden_size": 8}),
                                 ["num_experts", "1000000"]),
    "toml-moe-not-a-table": ("m.toml", tiny_toml(moe=5), ["moe", "5"]),
    "toml-name-number": ("m.toml", tiny_toml(name=5), ["name", "5"]),
    "toml-list-layers": ("m.toml", tiny_toml(num_layers=[2]), ["num_layers", "[2]"]),
    "toml-deep-array": ("m.toml", "source = \"t\"\nx = " + deep(3000) + "\n",
                        ["{f}", "64 levels"]),
    "toml-moderately-deep": ("m.toml", "source = \"t\"\nx = " + deep(100) + "\n",
                             ["{f}", "64 levels"]),
    "toml-syntax": ("m.toml", 'source = "t"\nnum_layers = 2\nhidden_size = = 64\n',
                    ["{f}", "line 3"]),
    "toml-binary": ("m.toml", bytes(range(256)), ["{f}", "UTF-8", "byte offset"]),
    "toml-empty": ("m.toml", "", ["{f}", "required"]),
    "toml-over-size": ("m.toml", tiny_toml() + "#" * (1024 * 1024 + 1), ["{f}", "1 MiB"]),
    "json-bool-layers": ("config.json", llama_json(num_hidden_layers=True),
                         ["{f}", "num_hidden_layers", "True"]),
    "json-string-hidden": ("config.json", llama_json(hidden_size="4096"),
                           ["hidden_size", "'4096'"]),
    "json-float-layers": ("config.json", llama_json(num_hidden_layers=1e9),
                          ["num_hidden_layers", "1000000000.0"]),
    "json-billion-layers": ("config.json", llama_json(num_hidden_layers=10**9),
                            ["num_layers", "10000"]),
    "json-negative-vocab": ("config.json", llama_json(vocab_size=-1), ["vocab_size", "-1"]),
    "json-string-tie": ("config.json", llama_json(tie_word_embeddings="yes"),
                        ["tie_word_embeddings", "'yes'"]),
    "json-unsupported-type": ("config.json", llama_json(model_type="rwkv"),
                              ["model_type", "rwkv"]),
    "json-missing-type": ("config.json", llama_json(model_type=...), ["model_type"]),
    "json-array": ("config.json", "[1, 2, 3]", ["{f}", "object", "list"]),
    "json-deep": ("config.json", deep(100000), ["{f}", "64 levels"]),
    "json-cut": ("config.json", llama_json()[:200], ["{f}", "line", "column"]),
    "json-binary": ("config.json", b"\x89PNG\r\n\x1a\n" + bytes(200), ["{f}", "byte offset"]),
    "json-utf16": ("config.json", llama_json().encode("utf-16"), ["{f}", "UTF-8"]),
    "json-over-size": ("config.json", " " * (1024 * 1024 + 1) + llama_json(), ["1 MiB"]),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_bad_model_file(case: str, sandbox: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name, content, mentions = MODEL_CASES[case]
    path = sandbox / "in" / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    assert_refused(["estimate", "-m", str(path), "-n", "8"],
                   [m.replace("{f}", str(path)) for m in mentions], sandbox, capsys)


def test_model_paths_that_are_not_files(sandbox: Path, capsys) -> None:
    assert_refused(["estimate", "-m", "/dev/zero"], ["/dev/zero", "not a regular file"],
                   sandbox, capsys)
    folder = sandbox / "in"
    assert_refused(["estimate", "-m", str(folder)], [str(folder), "without a config.json"],
                   sandbox, capsys)
    (folder / "config.json").mkdir()
    assert_refused(["estimate", "-m", str(folder)], ["config.json", "folder"], sandbox, capsys)
    fifo = sandbox / "in" / "fifo.toml"
    os.mkfifo(fifo)
    assert_refused(["estimate", "-m", str(fifo)], [str(fifo), "not a regular file"],
                   sandbox, capsys)


# --- 3. evidence files ---------------------------------------------------------------------

def _gz(text: str) -> bytes:
    return gzip.compress(text.encode(), mtime=0)


# name -> (command before the path, file name, content or None for "{in}" itself, mentions)
EVIDENCE_CASES: dict[str, tuple[list[str], str, Any, list[str]]] = {
    "trace-empty": (["analyze-trace"], "t.json", "", ["{f}", "traceEvents"]),
    "trace-garbage-text": (["analyze-trace"], "t.json", "hello world", ["{f}", "line 1"]),
    "trace-binary": (["analyze-trace"], "t.json", bytes(range(128, 256)) * 4,
                     ["{f}", "UTF-8", "byte offset 0"]),
    "trace-corrupt-gzip": (["analyze-trace"], "t.json.gz", b"\x1f\x8b\x08" + b"\xff" * 64,
                           ["{f}", "damaged gzip", "compressed bytes 0"]),
    "trace-gzip-of-text": (["analyze-trace"], "t.json.gz", _gz("not json at all"),
                           ["{f}", "invalid JSON", "line 1"]),
    "trace-gzip-cut-in-header": (["analyze-trace"], "t.json.gz", TRACE_GZ[:40],
                                 ["{f}", "cut"]),
    "trace-events-number": (["analyze-trace"], "t.json", json.dumps({"traceEvents": 5}),
                            ["{f}", "traceEvents is int"]),
    "trace-event-not-object": (["analyze-trace"], "t.json", trace_with(X, 7),
                               ["{f}", "event 1", "7"]),
    "trace-dur-text": (["analyze-trace"], "t.json", trace_with({**X, "dur": "5"}),
                       ["{f}", "event 0", "dur", "'5'"]),
    "trace-dur-negative": (["analyze-trace"], "t.json", trace_with({**X, "dur": -5}),
                           ["{f}", "event 0", "negative", "-5"]),
    "trace-ts-bool": (["analyze-trace"], "t.json", trace_with({**X, "ts": True}),
                      ["{f}", "ts", "true"]),
    "trace-name-number": (["analyze-trace"], "t.json", trace_with({**X, "name": 3}),
                          ["{f}", "name", "3"]),
    "trace-rank-text": (["analyze-trace"], "t.json",
                        trace_with(X, distributedInfo={"rank": "zero"}),
                        ["{f}", "distributedInfo.rank", "'zero'"]),
    "trace-info-list": (["analyze-trace"], "t.json", trace_with(X, distributedInfo=[0]),
                        ["{f}", "distributedInfo", "[0]"]),
    "trace-top-number": (["analyze-trace"], "t.json", "5", ["{f}", "5"]),
    "trace-no-complete-events": (["analyze-trace"], "t.json",
                                 trace_with({"ph": "M", "name": "process_name"}),
                                 ["{f}", "no complete"]),
    "trace-folder": (["analyze-trace"], "", None, ["{f}", "folder"]),
    "trace-garbage-inside": (["analyze-trace"], "t.json",
                             json.dumps(TRACE)[:5000] + "@@@" + json.dumps(TRACE)[5000:],
                             ["{f}", "invalid JSON", "line 1"]),
    "monitor-list": (["monitor-summary"], "memory_rank0.jsonl", "[1, 2]\n",
                     ["{f} line 1 (byte offset 0)", "JSON object"]),
    "monitor-rank-text": (["monitor-summary"], "memory_rank0.jsonl", jsonl(record(rank="a")),
                          ["{f} line 1", "'rank' is 'a'"]),
    "monitor-no-rank": (["monitor-summary"], "memory_rank0.jsonl",
                        jsonl({"step": 1, "step_time_s": 1.0}), ["{f} line 1", "'rank'"]),
    "monitor-rank-bool": (["monitor-summary"], "memory_rank0.jsonl", jsonl(record(rank=True)),
                          ["{f} line 1", "'rank' is true"]),
    "monitor-step-zero": (["monitor-summary"], "memory_rank0.jsonl", jsonl(record(step=0)),
                          ["{f} line 1", "'step' is 0"]),
    "monitor-time-text": (["monitor-summary"], "memory_rank0.jsonl",
                          jsonl(record(step_time_s="x")), ["{f} line 1", "'step_time_s'"]),
    "monitor-time-negative": (["monitor-summary"], "memory_rank0.jsonl",
                              jsonl(record(step_time_s=-1)), ["step_time_s", "-1"]),
    "monitor-peak-text": (["monitor-summary"], "memory_rank0.jsonl",
                          jsonl(record(), record(step=2, peak_bytes="8GiB")),
                          ["{f} line 2", "'peak_bytes' is '8GiB'"]),
    "monitor-bytes-negative": (["monitor-summary"], "memory_rank0.jsonl",
                               jsonl(record(reserved_bytes=-1)), ["'reserved_bytes' is -1"]),
    "monitor-warnings-number": (["monitor-summary"], "memory_rank0.jsonl",
                                jsonl(record(warnings=3)), ["'warnings' is 3"]),
    "monitor-binary": (["monitor-summary"], "memory_rank0.jsonl", b"\xff\xfe\x00garbage\n" * 2,
                       ["{f} line 1", "UTF-8"]),
    "monitor-garbage-between": (["monitor-summary"], "memory_rank0.jsonl",
                                jsonl(record()) + "#garbage\n" + jsonl(record(step=2)),
                                ["{f} line 2", "not JSON"]),
    "monitor-only-a-cut-line": (["monitor-summary"], "memory_rank0.jsonl",
                                json.dumps(record())[:30], ["{f}", "holds no records", "cut"]),
    "monitor-empty": (["monitor-summary"], "memory_rank0.jsonl", "\n\n", ["holds no records"]),
    "monitor-long-line": (["monitor-summary"], "memory_rank0.jsonl",
                          "{" + " " * (1024 * 1024 + 10) + "}\n", ["line 1", "1 MiB"]),
    "monitor-deep-line": (["monitor-summary"], "memory_rank0.jsonl",
                          jsonl(record()) + deep(50000) + "\n" + jsonl(record(step=2)),
                          ["{f} line 2", "not JSON"]),
    "monitor-folder-empty": (["monitor-summary"], "", None, ["{f}", "no memory_rank"]),
    "diagnose-monitor-rank-text": (["diagnose", "-m", "tiny", "--monitor"],
                                   "memory_rank0.jsonl", jsonl(record(rank="a")),
                                   ["--monitor", "{f} line 1", "'rank' is 'a'"]),
    "diagnose-monitor-binary": (["diagnose", "-m", "tiny", "--monitor"], "memory_rank0.jsonl",
                                bytes(range(11, 256)), ["--monitor", "{f}", "UTF-8"]),
    "oom-no-message": (["diagnose", "-m", "tiny", "--oom"], "err.txt", "all is well\n",
                       ["--oom", "{f}", "no PyTorch out-of-memory message"]),
    "oom-binary": (["diagnose", "-m", "tiny", "--oom"], "err.txt", bytes(range(256)) * 8,
                   ["--oom", "{f}"]),
    "oom-folder": (["diagnose", "-m", "tiny", "--oom"], "", None, ["--oom", "{f}", "folder"]),
    "oom-half-message": (["diagnose", "-m", "tiny", "--oom"], "err.txt",
                         "CUDA out of memory. Tried to allocate lots", ["--oom", "{f}"]),
    "snapshot-binary": (["diagnose", "-m", "tiny", "--trust-pickle", "--snapshot"], "s.pickle",
                        bytes(range(256)), ["--snapshot", "{f}", "not a readable pickle"]),
    "snapshot-text": (["diagnose", "-m", "tiny", "--trust-pickle", "--snapshot"], "s.pickle",
                      "hello", ["--snapshot", "{f}"]),
    "snapshot-no-segments": (["diagnose", "-m", "tiny", "--trust-pickle", "--snapshot"],
                             "s.pickle", pickle.dumps({"device_traces": []}),
                             ["--snapshot", "{f}", "segments"]),
    "snapshot-segment-number": (["diagnose", "-m", "tiny", "--trust-pickle", "--snapshot"],
                                "s.pickle", pickle.dumps({"segments": [5]}),
                                ["--snapshot", "segment 0", "int"]),
    "snapshot-payload": (["diagnose", "-m", "tiny", "--trust-pickle", "--snapshot"], "s.pickle",
                         b"cos\nsystem\n(S'true'\ntR.", ["os.system", "not one"]),
    "snapshot-cut": (["diagnose", "-m", "tiny", "--trust-pickle", "--snapshot"], "s.pickle",
                     pickle.dumps({"segments": [{"total_size": 1, "allocated_size": 1}]})[:20],
                     ["--snapshot", "{f}", "not a readable pickle"]),
    "profile-binary": (["diagnose", "-m", "tiny", "--profile"], "summary.json",
                       bytes(range(256)), ["--profile", "{f}", "UTF-8", "byte offset"]),
    "profile-list": (["diagnose", "-m", "tiny", "--profile"], "summary.json", "[1, 2]",
                     ["--profile", "{f}", "[1, 2]"]),
    "profile-empty-object": (["diagnose", "-m", "tiny", "--profile"], "summary.json", "{}",
                             ["--profile", "{f}", "phases is missing"]),
    "profile-phases-list": (["diagnose", "-m", "tiny", "--profile"], "summary.json",
                            json.dumps({"phases": [], "num_steps": 2}), ["phases is []"]),
    "profile-steps-bool": (["diagnose", "-m", "tiny", "--profile"], "summary.json",
                           json.dumps({"phases": {}, "num_steps": True}),
                           ["num_steps is true"]),
    "profile-peak-text": (["diagnose", "-m", "tiny", "--profile"], "summary.json",
                          json.dumps({"phases": {"1": {"forward": {"peak_bytes": "big"}}},
                                      "num_steps": 1}),
                          ["phases.1.forward.peak_bytes", "'big'"]),
    "profile-cut": (["diagnose", "-m", "tiny", "--profile"], "summary.json", '{"phases": {"1',
                    ["--profile", "{f}", "line 1"]),
    "profile-deep": (["diagnose", "-m", "tiny", "--profile"], "summary.json", deep(200),
                     ["--profile", "{f}", "64 levels"]),
    "profile-folder-without-summary": (["diagnose", "-m", "tiny", "--profile"], "", None,
                                       ["--profile", "summary.json", "no such file"]),
    "calibration-binary": (["estimate", "-m", "tiny", "--calibration"], "p.json",
                           bytes(range(256)), ["calibration profile", "{f}", "UTF-8"]),
    "calibration-list": (["estimate", "-m", "tiny", "--calibration"], "p.json", "[]",
                         ["calibration profile", "{f}", "schema_version"]),
    "calibration-no-version": (["estimate", "-m", "tiny", "--calibration"], "p.json", "{}",
                               ["{f}", "schema_version None"]),
    "calibration-no-fields": (["estimate", "-m", "tiny", "--calibration"], "p.json",
                              json.dumps({"schema_version": 1}), ["{f}", "required"]),
    "calibration-deep": (["estimate", "-m", "tiny", "--calibration"], "p.json", deep(500),
                         ["{f}", "64 levels"]),
    "calibration-cut": (["estimate", "-m", "tiny", "--calibration"], "p.json",
                        '{"schema_version": 1, "kind": "dev', ["{f}", "line 1"]),
}


@pytest.mark.parametrize("case", sorted(EVIDENCE_CASES))
def test_bad_evidence(case: str, sandbox: Path, capsys: pytest.CaptureFixture[str]) -> None:
    command, name, content, mentions = EVIDENCE_CASES[case]
    path = sandbox / "in" / name if name else sandbox / "in"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert_refused([*command, str(path)], [m.replace("{f}", str(path)) for m in mentions],
                   sandbox, capsys)


DEVICE_READERS = {
    "monitor-summary": ["monitor-summary"],
    "analyze-trace": ["analyze-trace"],
    "oom": ["diagnose", "-m", "tiny", "--oom"],
    "monitor": ["diagnose", "-m", "tiny", "--monitor"],
    "snapshot": ["diagnose", "-m", "tiny", "--trust-pickle", "--snapshot"],
    "profile": ["diagnose", "-m", "tiny", "--profile"],
    "calibration": ["estimate", "-m", "tiny", "--calibration"],
}


@pytest.mark.parametrize("reader", sorted(DEVICE_READERS))
def test_dev_zero_is_refused_by_every_reader(reader: str, sandbox: Path, capsys) -> None:
    """/dev/zero never ends: each reader refuses it before reading a byte."""
    assert_refused([*DEVICE_READERS[reader], "/dev/zero"], ["/dev/zero", "not a regular file"],
                   sandbox, capsys)


def test_two_traces_of_one_rank(sandbox: Path, capsys) -> None:
    paths = []
    for k in range(2):
        path = sandbox / "in" / f"r{k}.json.gz"
        path.write_bytes(TRACE_GZ)
        paths.append(str(path))
    assert_refused(["analyze-trace", *paths], [f"{paths[0]} and {paths[1]} are both rank 0"],
                   sandbox, capsys)
    assert_refused(["analyze-trace", paths[0], paths[0]], [paths[0], "given twice"], sandbox,
                   capsys)
    assert_refused(["analyze-trace", str(sandbox / "in")], [f"{paths[0]} and {paths[1]}"],
                   sandbox, capsys)


# --- 3c. encodings and what a message names ------------------------------------------------

BOM = b"\xef\xbb\xbf"


def _analyzed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert err == "", err
    return json.loads(out)


BOM_CASES: dict[str, tuple[list[str], str, bytes]] = {
    "model-toml": (["estimate", "-m"], "m.toml", tiny_toml().encode()),
    "hf-config": (["estimate", "-n", "8", "-m"], "config.json", llama_json().encode()),
    "megatron-args": (["estimate", "--megatron-args"], "args.sh",
                      b"pretrain_gpt.py --num-layers 4 --hidden-size 64 "
                      b"--num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
                      b"--vocab-size 128"),
    "torchtitan": (["estimate", "--torchtitan-config"], "job.toml",
                   b'[model]\nname = "llama3"\nflavor = "debugmodel"\n'
                   b'[activation_checkpoint]\nmode = "full"\n'),
    "monitor": (["monitor-summary"], "memory_rank0.jsonl", jsonl(record()).encode()),
    "trace": (["analyze-trace"], "t.json", gzip.decompress(TRACE_GZ)),
}


@pytest.mark.parametrize("case", sorted(BOM_CASES))
def test_a_utf8_byte_order_mark_is_accepted(case: str, sandbox: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A file saved by an editor that puts the UTF-8 byte-order mark first reads as the same
    file without it (the same answer, no warning)."""
    command, name, content = BOM_CASES[case]
    path = sandbox / "in" / name
    path.write_bytes(content)
    want = _analyzed([*command, str(path)], capsys)
    path.write_bytes(BOM + content)  # the same file, saved with the mark
    assert _analyzed([*command, str(path)], capsys) == want


def test_a_folder_of_traces_is_read_as_its_files(sandbox: Path, capsys) -> None:
    """analyze-trace takes a folder as monitor-summary does (and as Holistic Trace Analysis
    takes a run's trace folder): its .json and .json.gz files, in name order; other files
    and hidden ones are left out."""
    folder = sandbox / "in" / "run"
    folder.mkdir()
    for rank in (0, 1):
        (folder / f"rank{rank}.json.gz").write_bytes(
            (DATA / "traces" / "gloo_2rank" / f"rank{rank}.json.gz").read_bytes())
    (folder / "notes.txt").write_text("not a trace")
    (folder / ".rank9.json").write_text("{}")
    files = _analyzed(["analyze-trace", str(folder / "rank0.json.gz"),
                       str(folder / "rank1.json.gz")], capsys)
    assert _analyzed(["analyze-trace", str(folder)], capsys) == files
    assert [r["path"] for r in files["ranks"]] == [str(folder / "rank0.json.gz"),
                                                   str(folder / "rank1.json.gz")]


MESSAGE_CASES: dict[str, tuple[list[str], str, Any, list[str]]] = {
    "torchtitan-empty": (["estimate", "--torchtitan-config"], "job.toml", "",
                         ["{f}", "empty", "[model]"]),
    "torchtitan-no-model": (["estimate", "--torchtitan-config"], "job.toml",
                            "[training]\nseq_len = 128\n", ["{f}", "no [model] table"]),
    "torchtitan-ac-option-word": (["estimate", "--torchtitan-config"], "job.toml",
                                  '[model]\nname = "llama3"\nflavor = "debugmodel"\n'
                                  '[activation_checkpoint]\nselective_ac_option = "two"\n',
                                  ["selective_ac_option", "two", "a number of layers"]),
    "trace-folder-without-traces": (["analyze-trace"], "", None,
                                    ["{f}", "without trace files"]),
    "snapshot-shared-references": (
        ["diagnose", "-m", "tiny", "--trust-pickle", "--snapshot"], "s.pickle",
        pickle.dumps({"segments": [{"total_size": 1000, "allocated_size": 1000, "blocks": [
            {"size": 1, "state": "active_allocated"}] * 1000}] * 100_000}),
        ["--snapshot", "{f}", "100,100,000 segments, blocks and events", "shared references"]),
    "model-toml-utf16": (["estimate", "-m"], "m.toml", tiny_toml().encode("utf-16"),
                         ["{f}", "UTF-8", "byte offset 0"]),
    "model-toml-bom-then-binary": (["estimate", "-m"], "m.toml", BOM + b"\xff\xfe",
                                   ["{f}", "UTF-8", "byte offset 3"]),
    "monitor-utf16": (["monitor-summary"], "memory_rank0.jsonl",
                      jsonl(record()).encode("utf-16"), ["{f}", "UTF-8"]),
}


@pytest.mark.parametrize("case", sorted(MESSAGE_CASES))
def test_message_names_what(case: str, sandbox: Path, capsys) -> None:
    command, name, content, mentions = MESSAGE_CASES[case]
    path = sandbox / "in" / name if name else sandbox / "in"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert_refused([*command, str(path)], [m.replace("{f}", str(path)) for m in mentions],
                   sandbox, capsys)


@pytest.mark.parametrize("data", [b"\xff\xfe\xfd" * 100, b"", b"CUDA out of memory. Tried"])
def test_oom_from_stdin_without_a_message(data: bytes, sandbox: Path, capsys,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert_refused(["diagnose", "-m", "tiny", "--oom", "-"], ["--oom", "standard input"],
                   sandbox, capsys)


# --- 3b. numbers and sizes: past Python's digit limit, past memplan's bounds, size bombs ---

HUGE = "1" * 5000  # past int()'s 4300-digit limit: a ValueError that is no syntax error
MEGATRON = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
            "--max-position-embeddings 128 --vocab-size 128")
MOE = MEGATRON + " --num-experts 4 --moe-layer-freq "
NUMBER_OPTION_CASES: dict[str, tuple[list[str], list[str]]] = {
    "gpus-5000-digits": ([*E, "--gpus", HUGE], ["--gpus"]),
    "seq-5000-digits": ([*E, "--seq", HUGE], ["--seq"]),
    "gpu-memory-5000-digits": ([*E, "--gpu-memory", HUGE + "GiB"], ["gpu_memory", "1 PiB"]),
    "gpu-memory-inf-as-float": ([*E, "--gpu-memory", "9" * 400 + "TiB"],
                                ["gpu_memory", "1 PiB"]),
    "gpu-memory-over-limit": ([*E, "--gpu-memory", "1025TiB"], ["gpu_memory", "'1025TiB'"]),
    "gpu-memory-bytes-over-limit": ([*E, "--gpu-memory", str(2**50 + 1)],
                                    ["gpu_memory", str(2**50 + 1)]),
    "stage-layers-bomb": ([*E, "-n", "2", "--pp", "2", "--stage-layers", "1x99999999999"],
                          ["stage_layers", "10000", "'1x99999999999'"]),
    "stage-layers-many-runs": ([*E, "-n", "2", "--pp", "2", "--stage-layers",
                                ",".join(["1x9999"] * 3)], ["stage_layers", "10000"]),
    "stage-layers-5000-digits": ([*E, "-n", "2", "--pp", "2", "--stage-layers", "1x" + HUGE],
                                 ["stage_layers", "..."]),
    "megatron-pattern-bomb": (["estimate", "--megatron-args", MOE + "[0]*4096*4096*4096"],
                              ["--moe-layer-freq", "10000 layers"]),
    "megatron-pattern-product": (["estimate", "--megatron-args", MOE + "[0]*100*101"],
                                 ["--moe-layer-freq", "10000 layers"]),
    "megatron-pattern-long": (["estimate", "--megatron-args", MOE + "[0]+" * 12000 + "[1]"],
                              ["--moe-layer-freq", "characters"]),
    "megatron-pattern-deep": (["estimate", "--megatron-args", MOE + "[0]+" * 9000 + "[1]"],
                              ["--moe-layer-freq"]),
    "megatron-layers-5000-digits": (["estimate", "--megatron-args",
                                     MEGATRON.replace("--num-layers 4", "--num-layers " + HUGE)],
                                    ["--num-layers", "expected an integer"]),
    "megatron-layers-inf": (["estimate", "--megatron-args",
                             MEGATRON.replace("--num-layers 4", "--num-layers 1e999")],
                            ["--num-layers", "'1e999'", "expected an integer"]),
    "megatron-dropout-inf": (["estimate", "--megatron-args", MEGATRON + " --hidden-dropout 1e999"],
                             ["--hidden-dropout", "'1e999'", "expected a number"]),
    "megatron-dropout-nan": (["estimate", "--megatron-args", MEGATRON + " --hidden-dropout nan"],
                             ["--hidden-dropout", "'nan'", "expected a number"]),
    "calibrate-nproc-cpu-bomb": (["calibrate", "--device", "cpu", "--nproc", "100000"],
                                 ["nproc (100000)", "--device cpu", "process"]),
    "width-5000-digits": (["--width", HUGE, "models"], ["--width", "10000"]),
    "width-superscript": (["--width", "\u00b2", "models"], ["--width"]),
    "width-over-limit": (["--width", "99999", "models"], ["--width", "99999"]),
}


@pytest.mark.parametrize("case", sorted(NUMBER_OPTION_CASES))
def test_bad_number_option(case: str, sandbox: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, mentions = NUMBER_OPTION_CASES[case]
    err = assert_refused(argv, mentions, sandbox, capsys)
    assert len(err) < 600, err  # the value is quoted cut short, never whole


def _with_huge(text: str, value: str) -> str:
    """``text`` with its ``value`` (a number written once in it) replaced by HUGE."""
    assert text.count(value) == 1, value
    return text.replace(value, HUGE)


# name -> (command before the path, file name, content, mentions); as EVIDENCE_CASES
NUMBER_FILE_CASES: dict[str, tuple[list[str], str, Any, list[str]]] = {
    "toml-5000-digit-layers": (["estimate", "-m"], "m.toml",
                               _with_huge(tiny_toml(num_layers=4242), "4242"),
                               ["{f}", "4300 digits"]),
    "json-5000-digit-layers": (["estimate", "-m"], "config.json",
                               _with_huge(llama_json(num_hidden_layers=7777), "7777"),
                               ["{f}", "4300 digits"]),
    "json-inf-layers": (["estimate", "-m"], "config.json",
                        llama_json(num_hidden_layers=12345).replace("12345", "1e999"),
                        ["num_hidden_layers", "inf"]),
    "trace-5000-digit-ts": (["analyze-trace"], "t.json",
                            _with_huge(trace_with({**X, "ts": 424242}), "424242"),
                            ["{f}", "4300 digits"]),
    "trace-5000-digit-rank": (["analyze-trace"], "t.json",
                              _with_huge(trace_with(X, distributedInfo={"rank": 424242}),
                                         "424242"), ["{f}", "4300 digits"]),
    "trace-gz-5000-digit-dur": (["analyze-trace"], "t.json.gz",
                                _gz(_with_huge(trace_with({**X, "dur": 424242}), "424242")),
                                ["{f}", "4300 digits"]),
    "monitor-5000-digit-bytes": (["monitor-summary"], "memory_rank0.jsonl",
                                 _with_huge(jsonl(record(allocated_bytes=424242)), "424242"),
                                 ["{f}", "line 1", "4300 digits"]),
    "monitor-5000-digit-step": (["diagnose", "-m", "tiny", "--monitor"], "memory_rank0.jsonl",
                                jsonl(record()) + _with_huge(jsonl(record(step=9876543, time=1.0)),
                                                             "9876543"),
                                ["--monitor", "{f}", "line 2", "4300 digits"]),
    "profile-5000-digit-steps": (["diagnose", "-m", "tiny", "--profile"], "summary.json",
                                 _with_huge(json.dumps({"phases": {}, "num_steps": 424242}),
                                            "424242"), ["--profile", "{f}", "4300 digits"]),
    "calibration-5000-digit-version": (["estimate", "-m", "tiny", "--calibration"], "p.json",
                                       _with_huge(json.dumps({"schema_version": 424242}),
                                                  "424242"), ["{f}", "4300 digits"]),
    "oom-5000-digit-size": (["diagnose", "-m", "tiny", "--oom"], "oom.txt",
                            f"CUDA out of memory. Tried to allocate {HUGE}.00 GiB. GPU 0 has a "
                            "total capacity of 79.10 GiB of which 1.00 MiB is free.",
                            ["out-of-memory message", "too long"]),
    "oom-5000-digit-device": (["diagnose", "-m", "tiny", "--oom"], "oom.txt",
                              "CUDA out of memory. Tried to allocate 2.00 GiB (GPU " + HUGE
                              + "; 79.35 GiB total capacity; 70.00 GiB already allocated; "
                              "1.00 GiB free; 75.00 GiB reserved in total by PyTorch)",
                              ["out-of-memory message", "too long"]),
    "megatron-file-5000-digits": (["estimate", "--megatron-args"], "args.sh",
                                  "pretrain_gpt.py " + MEGATRON.replace("--hidden-size 64",
                                                                        "--hidden-size " + HUGE),
                                  ["--hidden-size", "expected an integer"]),
    "torchtitan-5000-digit-layers": (["estimate", "--torchtitan-config"], "job.toml",
                                     "[model]\nname = \"llama3\"\nflavor = \"debugmodel\"\n"
                                     "[training]\nseq_len = " + HUGE + "\n",
                                     ["{f}", "4300 digits"]),
}


@pytest.mark.parametrize("case", sorted(NUMBER_FILE_CASES))
def test_bad_number_in_a_file(case: str, sandbox: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    command, name, content, mentions = NUMBER_FILE_CASES[case]
    path = sandbox / "in" / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    err = assert_refused([*command, str(path)], [m.replace("{f}", str(path)) for m in mentions],
                         sandbox, capsys)
    assert len(err) < 600 + len(str(path)), err


@pytest.mark.parametrize("digits", [20, 400])
@pytest.mark.parametrize("case", sorted(NUMBER_FILE_CASES))
def test_integer_past_64_bits_in_a_file(case: str, digits: int, sandbox: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The same numbers 20 and 400 digits long: within Python's digit limit, past the 64-bit
    range of any count or size these files hold (and a 400-digit one past a float's). Each
    reader refuses in one line naming the file or the option that gave it, where such a
    number used to overflow into a traceback where results are computed."""
    command, name, content, _ = NUMBER_FILE_CASES[case]
    path = sandbox / "in" / name
    long = "7" * digits
    if isinstance(content, bytes):  # gzip: the number inside the stream
        path.write_bytes(_gz(gzip.decompress(content).decode().replace(HUGE, long)))
    else:
        path.write_text(content.replace(HUGE, long))
    err = assert_refused([*command, str(path)], [], sandbox, capsys)
    assert str(path) in err or command[-1] in err, err
    assert len(err) < 600 + len(str(path)), err


# --- 4. outputs ----------------------------------------------------------------------------

def _existing_file(root: Path) -> Path:
    path = root / "in" / "results"
    path.write_text("an earlier result\n")
    return path


def _dangling(root: Path) -> Path:
    link = root / "in" / "out"
    link.symlink_to(root / "in" / "missing")
    return link


def _loop(root: Path) -> Path:
    link = root / "in" / "out"
    link.symlink_to(link)
    return link


def _linked_inside(root: Path, name: str) -> Path:
    """An --out folder whose ``name`` subfolder is a link planted to a folder outside it."""
    out, elsewhere = root / "in" / "cal", root / "in" / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / name).symlink_to(elsewhere)
    return out


LONG = "n" * 300  # over the 255 bytes a file or folder name may have (ext4, xfs, tmpfs)
OUTPUT_CASES: dict[str, tuple[Callable[[Path], list[str]], list[str]]] = {
    "profile-out-dangling-link": (lambda r: ["profile", "-m", "tiny", "--out", str(_dangling(r))],
                                  ["--out", "symbolic link to nothing"]),
    "profile-out-link-loop": (lambda r: ["profile", "-m", "tiny", "--out", str(_loop(r))],
                              ["--out", "symbolic link to nothing"]),
    "profile-out-under-a-dangling-link": (lambda r: ["profile", "-m", "tiny", "--out",
                                                     str(_dangling(r) / "a" / "b")],
                                          ["--out", "symbolic link to nothing"]),
    "profile-out-300-characters": (lambda r: ["profile", "-m", "tiny", "--out",
                                              str(r / "in" / LONG)], ["--out", "too long"]),
    "profile-out-300-characters-deeper": (lambda r: ["profile", "-m", "tiny", "--out",
                                                     str(r / "in" / LONG / "sub")],
                                          ["--out", "too long"]),
    "calibrate-out-dangling-link": (lambda r: ["calibrate", "--device", "cpu", "--out",
                                               str(_dangling(r))],
                                    ["--out", "symbolic link to nothing"]),
    "calibrate-out-300-characters": (lambda r: ["calibrate", "--device", "cpu", "--out",
                                                str(r / "in" / LONG)], ["--out", "too long"]),
    "plot-300-characters": (lambda r: ["estimate", "-m", "tiny", "--plot",
                                       str(r / "in" / (LONG + ".png"))], ["--plot", "too long"]),
    "plot-in-a-dangling-link": (lambda r: ["estimate", "-m", "tiny", "--plot",
                                           str(_dangling(r) / "p.png")],
                                ["--plot", "symbolic link to nothing"]),
    "monitor-plot-link-loop": (lambda r: ["monitor-summary", "x", "--plot",
                                          str(_loop(r) / "p.svg")],
                               ["--plot", "symbolic link to nothing"]),
    "profile-out-is-a-file": (lambda r: ["profile", "-m", "tiny", "--out",
                                         str(_existing_file(r))],
                              ["--out", "existing file"]),
    "profile-out-under-a-file": (lambda r: ["profile", "-m", "tiny", "--out",
                                            str(_existing_file(r) / "sub")],
                                 ["--out", "is a file"]),
    "calibrate-out-is-a-file": (lambda r: ["calibrate", "--device", "cpu", "--out",
                                           str(_existing_file(r))],
                                ["--out", "existing file"]),
    "calibrate-out-under-a-file": (lambda r: ["calibrate", "--device", "cpu", "--out",
                                              str(_existing_file(r) / "cal")],
                                   ["--out", "is a file"]),
    "calibrate-records-a-link": (lambda r: ["calibrate", "--device", "cpu", "--out",
                                            str(_linked_inside(r, "records"))],
                                 ["--out", "records is a symbolic link", "inside"]),
    "calibrate-profiles-a-link": (lambda r: ["calibrate", "--refit", "--out",
                                             str(_linked_inside(r, "profiles"))],
                                  ["--out", "profiles is a symbolic link"]),
    "calibrate-name-climbs-out": (lambda r: ["calibrate", "--device", "cpu", "--out",
                                             str(r / "in" / "cal"), "--name", "../../x"],
                                  ["name", "'../../x'", "inside --out"]),
    "calibrate-name-has-a-slash": (lambda r: ["calibrate", "--device", "cpu", "--out",
                                              str(r / "in" / "cal"), "--name", "a/b"],
                                   ["name", "'a/b'"]),
    "calibrate-name-dot-dot": (lambda r: ["calibrate", "--device", "cpu", "--out",
                                          str(r / "in" / "cal"), "--name", ".."],
                               ["name", "'..'"]),
    "calibrate-name-absolute": (lambda r: ["calibrate", "--device", "cpu", "--out",
                                           str(r / "in" / "cal"), "--name", "/tmp/x"],
                                ["name", "'/tmp/x'"]),
    "calibrate-name-hidden": (lambda r: ["calibrate", "--device", "cpu", "--out",
                                         str(r / "in" / "cal"), "--name", ".x"],
                              ["name", "'.x'"]),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_bad_output(case: str, sandbox: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build, mentions = OUTPUT_CASES[case]
    assert_refused(build(sandbox), mentions, sandbox, capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize("command", [["profile", "-m", "tiny"], ["calibrate", "--device", "cpu"]])
def test_read_only_output_folder(command: list[str], sandbox: Path, capsys) -> None:
    folder = sandbox / "in" / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert_refused([*command, "--out", str(folder / "new")], ["--out", "permission denied"],
                       sandbox, capsys)
    finally:
        folder.chmod(0o755)


# --- 5. the Python API ---------------------------------------------------------------------

API_CASES: dict[str, tuple[Callable[..., Any], tuple, dict[str, Any], list[str]]] = {
    "gpus-string": (memplan.estimate, ("tiny",), {"gpus": "8"}, ["gpus", "'8'"]),
    "gpus-float": (memplan.estimate, ("tiny",), {"gpus": 1.5}, ["gpus", "1.5"]),
    "gpus-bool": (memplan.estimate, ("tiny",), {"gpus": True}, ["gpus", "true"]),
    "gpus-none": (memplan.estimate, ("tiny",), {"gpus": None}, ["gpus", "null"]),
    "gpus-zero": (memplan.estimate, ("tiny",), {"gpus": 0}, ["gpus", "0"]),
    "gpu-none": (memplan.estimate, ("tiny",), {"gpu": None}, ["gpu", "null"]),
    "gpu-number": (memplan.estimate, ("tiny",), {"gpu": 100}, ["gpu", "100"]),
    "gpu-unknown": (memplan.estimate, ("tiny",), {"gpu": "h900"}, ["h900"]),
    "schedule-word": (memplan.estimate, ("tiny",), {"schedule": "zigzag"},
                      ["schedule", "zigzag"]),
    "schedule-number": (memplan.estimate, ("tiny",), {"schedule": 3}, ["schedule", "3"]),
    "tp-float": (memplan.estimate, ("tiny",), {"tp": 2.0}, ["tp", "2.0"]),
    "tp-bool": (memplan.estimate, ("tiny",), {"tp": True}, ["tp", "true"]),
    "tp-string": (memplan.estimate, ("tiny",), {"tp": "2"}, ["tp", "'2'"]),
    "pp-list": (memplan.estimate, ("tiny",), {"pp": [1]}, ["pp", "[1]"]),
    "dp-string": (memplan.estimate, ("tiny",), {"dp": "2"}, ["dp", "'2'"]),
    "zero-string": (memplan.estimate, ("tiny",), {"zero": "1"}, ["zero", "'1'"]),
    "zero-four": (memplan.estimate, ("tiny",), {"zero": 4}, ["zero", "4"]),
    "zero-bool": (memplan.estimate, ("tiny",), {"zero": True}, ["zero", "true"]),
    "sp-string": (memplan.estimate, ("tiny",), {"sequence_parallel": "on"},
                  ["sequence_parallel", "'on'"]),
    "vocab-parallel-none": (memplan.estimate, ("tiny",), {"vocab_parallel": None},
                            ["vocab_parallel"]),
    "tp-style-number": (memplan.estimate, ("tiny",), {"tp_style": 1}, ["tp_style", "1"]),
    "grad-buffers-word": (memplan.estimate, ("tiny",), {"grad_buffers": "zz"},
                          ["grad_buffers", "zz"]),
    "offload-number": (memplan.estimate, ("tiny",), {"offload": 5}, ["offload", "5"]),
    "framework-word": (memplan.estimate, ("tiny",), {"framework": "jax"}, ["framework", "jax"]),
    "mbs-string": (memplan.estimate, ("tiny",), {"micro_batch_size": "2"}, ["mbs", "'2'"]),
    "mbs-bool": (memplan.estimate, ("tiny",), {"micro_batch_size": True}, ["mbs", "true"]),
    "seq-float": (memplan.estimate, ("tiny",), {"seq_len": 2.5}, ["seq", "2.5"]),
    "gbs-negative": (memplan.estimate, ("tiny",), {"global_batch_size": -1}, ["gbs", "-1"]),
    "logits-fp32-string": (memplan.estimate, ("tiny",), {"logits_fp32": "yes"},
                           ["logits-fp32", "'yes'"]),
    "precision-word": (memplan.estimate, ("tiny",), {"precision": "bf17"},
                       ["precision", "bf17"]),
    "recompute-word": (memplan.estimate, ("tiny",), {"recompute": "zzz"}, ["recompute", "zzz"]),
    "workload-typo": (memplan.estimate, ("tiny",), {"micro_batch": 2}, ["micro_batch"]),
    "calibration-number": (memplan.estimate, ("tiny",), {"calibration": 5},
                           ["calibration", "5"]),
    "overheads-string": (memplan.estimate, ("tiny",), {"overheads": "x"}, ["overheads", "'x'"]),
    "gpu-memory-bool": (memplan.estimate, ("tiny",), {"gpu_memory": True}, ["gpu_memory"]),
    "gpu-memory-list": (memplan.estimate, ("tiny",), {"gpu_memory": [1]}, ["gpu_memory"]),
    "gpu-memory-unit": (memplan.estimate, ("tiny",), {"gpu_memory": "80XB"},
                        ["gpu_memory", "80XB"]),
    "model-none": (memplan.estimate, (None,), {}, ["model", "null"]),
    "model-number": (memplan.estimate, (5,), {}, ["model", "5"]),
    "model-empty": (memplan.estimate, ("",), {}, ["model"]),
    "model-unknown": (memplan.estimate, ("llama-9",), {}, ["llama-9"]),
    "plan-gpus-string": (memplan.plan, ("tiny",), {"gpus": "8"}, ["gpus", "'8'"]),
    "plan-gpus-zero": (memplan.plan, ("tiny",), {"gpus": 0}, ["gpus", "0"]),
    "plan-tp-splits-no-gpus": (memplan.plan, ("tiny",), {"gpus": 8, "tp": 3},
                               ["gpus (8)", "tp (3)"]),
    "plan-max-tp-negative": (memplan.plan, ("tiny",), {"gpus": 8, "max_tp": -4},
                             ["max_tp", "-4"]),
    "plan-safety-string": (memplan.plan, ("tiny",), {"gpus": 8, "safety": "x"},
                           ["safety", "'x'"]),
    "plan-safety-nan": (memplan.plan, ("tiny",), {"gpus": 8, "safety": float("nan")},
                        ["safety", "nan"]),
    "plan-recompute-word": (memplan.plan, ("tiny",), {"gpus": 8, "recompute": ["zz"]},
                            ["recompute", "zz"]),
    "plan-recompute-number": (memplan.plan, ("tiny",), {"gpus": 8, "recompute": 3},
                              ["recompute", "3"]),
    "plan-zero-seven": (memplan.plan, ("tiny",), {"gpus": 8, "zero": 7}, ["zero", "7"]),
    "check-safety-two": (memplan.check, ("tiny",), {"safety": 2}, ["safety", "2"]),
    "make-layout-string": (memplan.make_layout, ("8",), {}, ["gpus", "'8'"]),
    "make-layout-list": (memplan.make_layout, (8,), {"tp": [1]}, ["tp", "[1]"]),
    "make-workload-not-a-spec": (memplan.make_workload, ("tiny",), {}, ["spec", "'tiny'"]),
    "load-model-none": (memplan.load_model, (None,), {}, ["model", "None"]),
    "load-gpu-none": (memplan.load_gpu, (None,), {}, ["gpu", "None"]),
    "diagnose-oom-number": (None, ("tiny",), {"oom": 5}, ["oom", "5"]),
    "diagnose-monitor-number": (None, ("tiny",), {"monitor": 5}, ["monitor", "5"]),
    "diagnose-profile-number": (None, ("tiny",), {"profile": 5}, ["profile", "5"]),
}


# objects that skipped validation (model_copy's update and model_construct do not validate)
TINY_SPEC = memplan.load_model("tiny")
H100 = memplan.load_gpu("h100-sxm")
API_OBJECT_CASES: dict[str, tuple[Callable[..., Any], tuple, dict[str, Any], list[str]]] = {
    "copy-negative-layers": (memplan.estimate, (TINY_SPEC.model_copy(update={"num_layers": -3}),),
                             {}, ["model", "num_layers", "-3"]),
    "copy-billion-layers": (memplan.estimate,
                            (TINY_SPEC.model_copy(update={"num_layers": 10**9}),), {},
                            ["model", "num_layers", "10000"]),
    "copy-zero-heads": (memplan.estimate,
                        (TINY_SPEC.model_copy(update={"num_attention_heads": 0}),), {},
                        ["model", "num_attention_heads", "0"]),
    "copy-heads-do-not-divide": (memplan.estimate,
                                 (TINY_SPEC.model_copy(update={"num_kv_heads": 3}),), {},
                                 ["model", "num_kv_heads (3)"]),
    "copy-moe-as-partial-dict": (memplan.estimate,
                                 (TINY_SPEC.model_copy(update={"moe": {"num_experts": 3}}),), {},
                                 ["model", "moe.top_k", "required"]),
    "copy-unknown-field": (memplan.estimate, (TINY_SPEC.model_copy(update={"layers": 3}),), {},
                           ["model", "layers"]),
    "construct-partial": (memplan.estimate, (memplan.ModelSpec.model_construct(num_layers=2),),
                          {}, ["model", "required"]),
    "construct-empty": (memplan.estimate, (memplan.ModelSpec.model_construct(),), {},
                        ["model", "required"]),
    "plan-copy-negative-layers": (memplan.plan,
                                  (TINY_SPEC.model_copy(update={"num_layers": -3}),),
                                  {"gpus": 8}, ["model", "num_layers", "-3"]),
    "check-construct": (memplan.check, (memplan.ModelSpec.model_construct(num_layers=2),), {},
                        ["model", "required"]),
    "make-workload-construct": (memplan.make_workload,
                                (memplan.ModelSpec.model_construct(num_layers=2),), {},
                                ["spec", "required"]),
    "gpu-copy-zero-memory": (memplan.estimate, ("tiny",),
                             {"gpu": H100.model_copy(update={"memory_bytes": 0})},
                             ["gpu", "memory_bytes", "0"]),
    "gpu-copy-negative-flops": (memplan.estimate, ("tiny",),
                                {"gpu": H100.model_copy(update={"bf16_flops": -1.0})},
                                ["gpu", "bf16_flops"]),
    "gpu-construct": (memplan.estimate, ("tiny",),
                      {"gpu": memplan.GpuSpec.model_construct(name="x")}, ["gpu", "required"]),
    "numpy-float-tp": (memplan.estimate, ("tiny",), {"tp": np.float64(2.0)}, ["tp", "2.0"]),
    "numpy-bool-gpus": (memplan.estimate, ("tiny",), {"gpus": np.bool_(True)}, ["gpus"]),
    "numpy-negative-gpus": (memplan.estimate, ("tiny",), {"gpus": np.int64(-8)},
                            ["gpus", "-8"]),
    "numpy-huge-mbs": (memplan.estimate, ("tiny",), {"micro_batch_size": np.int64(2**40)},
                       ["mbs", str(2**40)]),
    "numpy-stage-layers-2d": (memplan.estimate, ("tiny",),
                              {"gpus": 2, "pp": 2, "stage_layers": np.ones((2, 2), int)},
                              ["stage_layers"]),
}


def _api_report_cases() -> dict[str, tuple[Callable[..., Any], tuple, dict[str, Any],
                                           list[str]]]:
    """Result objects given back to the API (a dataclass is not validated when made)."""
    from memplan.diagnose import diagnose
    from memplan.diagnose.measured import Measured, PhasePeak
    from memplan.diagnose.monitored import Monitored
    from memplan.diagnose.oom import OomReport

    def report(**fields: Any) -> Any:
        return OomReport(**{"kind": "allocator", "version": "2.1+", **fields})

    def measured(first: Any) -> Any:
        return Measured(device="cuda", first=first, steady={}, warnings=())

    def monitored(*records: Any) -> Any:
        return Monitored(files=("m.jsonl",), records={0: records}, summary={"ranks": {}})

    peak = PhasePeak(1, "forward", 2**20, {"activations": 2**20}, None)
    return {
        "oom-report-negative-total": (diagnose, ("tiny",), {"oom": report(total_bytes=-5)},
                                      ["oom.total_bytes", "-5"]),
        "oom-report-text-size": (diagnose, ("tiny",), {"oom": report(free_bytes="8GiB")},
                                 ["oom.free_bytes", "'8GiB'"]),
        "oom-report-bool-device": (diagnose, ("tiny",), {"oom": report(device=True)},
                                   ["oom.device", "true"]),
        "oom-report-huge-bytes": (diagnose, ("tiny",), {"oom": report(requested_bytes=2**70)},
                                  ["oom.requested_bytes", str(2**70)]),
        "oom-report-kind": (diagnose, ("tiny",), {"oom": report(kind="gpu")},
                            ["oom.kind", "'gpu'"]),
        "profile-negative-peak": (diagnose, ("tiny",), {"profile": measured(
            {"forward": PhasePeak(1, "forward", -1, {}, None)})},
            ["profile.first['forward'].peak_bytes", "-1"]),
        "profile-not-a-peak": (diagnose, ("tiny",), {"profile": measured({"forward": 5})},
                               ["profile.first['forward']", "PhasePeak"]),
        "profile-peak-text-bytes": (diagnose, ("tiny",), {"profile": measured(
            {"forward": PhasePeak(1, "forward", 7, {"activations": "1 GiB"}, None)})},
            ["profile.first['forward'].by_category['activations']", "'1 GiB'"]),
        "profile-good-peak-bad-steady": (diagnose, ("tiny",), {"profile": Measured(
            device="cuda", first={"forward": peak}, steady=[], warnings=())},
            ["profile.steady", "dict"]),
        "monitor-bad-record": (diagnose, ("tiny",), {"monitor": monitored(
            {"rank": 0, "step": 0, "step_time_s": 0.5})}, ["monitor", "record 0", "'step'"]),
        "monitor-no-records": (diagnose, ("tiny",), {"monitor": monitored()},
                               ["monitor", "no records"]),
        "monitor-huge-bytes": (diagnose, ("tiny",), {"monitor": monitored(
            {"rank": 0, "step": 1, "step_time_s": 0.5, "allocated_bytes": 2**70})},
            ["monitor", "allocated_bytes", "64-bit"]),
    }


API_OBJECT_CASES.update(_api_report_cases())
def _overheads(**changes: Any) -> Any:
    from memplan.overheads import default_overheads

    return dataclasses.replace(default_overheads(H100), **changes)


API_OBJECT_CASES.update({
    "overheads-negative-context": (memplan.estimate, ("tiny",),
                                   {"overheads": _overheads(cuda_context_bytes=-1)},
                                   ["overheads.cuda_context_bytes", "-1"]),
    "overheads-nan-fraction": (memplan.estimate, ("tiny",),
                               {"overheads": _overheads(allocator_fraction=float("nan"))},
                               ["overheads.allocator_fraction", "nan"]),
    "overheads-text-workspace": (memplan.estimate, ("tiny",),
                                 {"overheads": _overheads(workspace_bytes="32MiB")},
                                 ["overheads.workspace_bytes", "'32MiB'"]),
})


@pytest.mark.parametrize("case", sorted(API_OBJECT_CASES))
def test_api_objects_are_validated(case: str) -> None:
    """Whatever object the API is given, it is validated anew: a MemplanError of one line
    naming the argument and the field, never an IndexError or AttributeError from inside."""
    function, args, kwargs, mentions = API_OBJECT_CASES[case]
    with pytest.raises(MemplanError) as raised:
        function(*args, **kwargs)
    message = str(raised.value)
    assert "\n" not in message
    for text in mentions:
        assert text in message, (text, message)


def test_api_object_given_again_is_answered_by_identity_and_copies_checked_anew() -> None:
    """A spec the API has validated is not validated again when given again (the same
    object back), yet a copy of it made with ``model_copy(update=...)`` (which skips
    validation) is checked: num_layers -1 is refused by name, every time it is given."""
    from memplan.arguments import revalidated

    spec = memplan.load_model("tiny")
    checked = revalidated("model", spec)
    assert revalidated("model", spec) is checked
    broken = spec.model_copy(update={"num_layers": -1})
    for _ in range(2):
        with pytest.raises(MemplanError, match="num_layers"):
            memplan.estimate(broken)
    assert revalidated("model", spec.model_copy()) is not checked


def test_api_object_set_in_place_after_its_check_is_checked_anew() -> None:
    """``object.__setattr__`` gets past ``frozen``: a spec checked once, then given
    num_layers -1 in place, is refused by name when given again (its hash is no longer the
    one checked), and given num_layers 3 in place it is checked anew and read with 3 layers,
    not the 2 it was checked with (``tiny`` has 2 layers)."""
    from memplan.arguments import revalidated

    spec = memplan.load_model("tiny").model_copy()  # (the catalog's own object left as it is)
    assert revalidated("model", spec).num_layers == 2
    object.__setattr__(spec, "num_layers", -1)
    with pytest.raises(MemplanError, match="num_layers"):
        memplan.estimate(spec)
    object.__setattr__(spec, "num_layers", 3)
    assert revalidated("model", spec).num_layers == 3
    object.__setattr__(spec, "num_layers", [2])  # unhashable now: checked, not answered
    with pytest.raises(MemplanError, match="num_layers"):
        revalidated("model", spec)


def test_numpy_and_other_integral_types_are_integers(tmp_path: Path) -> None:
    """np.int64, np.int32, values of np.arange and any class with ``__index__`` are integers
    to the API: the same answers as plain ints (a sweep built with np.arange runs)."""

    class Count:  # an integral type of the user's own
        def __init__(self, n: int) -> None:
            self.n = n

        def __index__(self) -> int:
            return self.n

    plain = memplan.estimate("tiny", gpus=8, tp=2, micro_batch_size=2, seq_len=128)
    for gpus, tp, mbs in ((np.int64(8), np.int32(2), np.int16(2)), (Count(8), Count(2), 2)):
        got = memplan.estimate("tiny", gpus=gpus, tp=tp, micro_batch_size=mbs,
                               seq_len=np.uint16(128))
        assert got.peak_bytes == plain.peak_bytes
    assert [memplan.estimate("tiny", micro_batch_size=b).peak_bytes
            for b in np.arange(1, 3)] == [memplan.estimate("tiny", micro_batch_size=b).peak_bytes
                                          for b in (1, 2)]
    layout = memplan.make_layout(np.int64(4), pp=np.int64(2), stage_layers=np.array([1, 1]))
    assert layout.stage_layers == (1, 1) and type(layout.pp) is int
    assert memplan.plan("tiny", gpus=np.int64(2), top=np.int64(1)).candidates
    from memplan.monitor import MemoryMonitor

    assert MemoryMonitor(tmp_path, rank=np.int64(3), reader=dict).rank == 3


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_bad_api_argument(case: str) -> None:
    function, args, kwargs, mentions = API_CASES[case]
    if function is None:
        from memplan.diagnose import diagnose as function
    with pytest.raises(MemplanError) as raised:
        function(*args, **kwargs)
    message = str(raised.value)
    assert "\n" not in message
    for text in mentions:
        assert text in message, (text, message)


def test_the_corpus_is_large() -> None:
    """At least 120 cases of bad input, across the CLI, the API and each reader."""
    total = (len(OPTION_CASES) + len(MODEL_CASES) + len(EVIDENCE_CASES) + len(OUTPUT_CASES)
             + len(API_CASES) + len(DEVICE_READERS) + len(NUMBER_OPTION_CASES)
             + len(NUMBER_FILE_CASES) + len(API_OBJECT_CASES) + len(BOM_CASES)
             + len(MESSAGE_CASES) + len(RECORD_CASES))
    assert total >= 120, total


# --- 6. calibration records a run left in --out (read by --resume and --refit) --------------

RECORD_CASES: dict[str, tuple[Any, list[str]]] = {
    "fifo": (None, ["not a regular file"]),
    "binary": (bytes(range(256)), ["UTF-8", "byte offset"]),
    "list": (b"[1, 2]", ["calibration record"]),
    "5000-digits": (b'{"schema_version": ' + b"7" * 5000 + b"}", ["calibration record"]),
    "deep": (deep(5000).encode(), ["calibration record"]),
    "empty": (b"", ["calibration record"]),
    "bom-then-garbage": (b"\xef\xbb\xbf{", ["calibration record"]),
}


@pytest.mark.parametrize("case", sorted(RECORD_CASES))
def test_bad_calibration_record(case: str, tmp_path: Path) -> None:
    """A records folder holding a device file, binary, a wrong shape or a number past Python's
    limit: --refit's reader refuses in one line naming the file (a FIFO is not waited on),
    and --resume's count of finished points skips it (that point is measured again)."""
    from memplan.calibrate.records import finished_keys, read_records

    content, mentions = RECORD_CASES[case]
    path = tmp_path / "tp1-x.json"
    if content is None:
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    with pytest.raises(MemplanError) as raised:
        read_records(tmp_path)
    message = str(raised.value)
    assert "\n" not in message and str(path) in message, message
    for text in mentions:
        assert text in message, (text, message)
    assert finished_keys(tmp_path) == set()
