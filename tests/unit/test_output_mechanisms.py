"""The output names the mechanisms it modelled: compile, float8 and async TP change bytes or
time, so the text's assumptions and ``--json``'s workload say they were read (before, an
estimate with ``--compile --float8 tensorwise`` printed neither)."""

from __future__ import annotations

import json

from memplan.api import estimate
from memplan.cli import main


def test_compile_float8_and_async_tp_are_said() -> None:
    est = estimate("llama-3-8b", gpus=8, tp=2, zero=3, framework="torchtitan", compile=True,
                   recompute="full", float8="tensorwise", float8_all_gather=True,
                   async_tp=True)
    lines = [a for a in est.assumptions if "compiled" in a or "float8" in a or "async" in a]
    assert len(lines) == 3
    assert lines[0].startswith("each decoder layer compiled (torch.compile, Inductor)")
    assert "tensorwise scaling" in lines[1] and "all-gathered by FSDP2 in float8" in lines[1]
    assert lines[2].startswith("async TP") and "step time only" in lines[2]
    plain = estimate("llama-3-8b", gpus=8, zero=3, framework="torchtitan")
    assert not [a for a in plain.assumptions if "compiled" in a or "float8" in a]


def test_json_workload_names_compile_and_float8(capsys) -> None:
    assert main(["estimate", "-m", "llama-3-8b", "-n", "8", "--zero", "3", "--framework",
                 "torchtitan", "--compile", "--float8", "rowwise", "--json"]) == 0
    wl = json.loads(capsys.readouterr().out)["workload"]
    assert (wl["compile"], wl["float8"]) == (True, "rowwise")


def test_compiled_micro_batch_below_the_mlp_threshold_is_said() -> None:
    """Below T (f + h) < f h Inductor reorders a compiled layer's backward, which memplan
    follows for one block only: the output says where a job is there. Llama 3.1 8B (h 4,096,
    f 14,336): f h / (f + h) = 58,720,256 / 18,432 = 3,185.8, so 3,186 tokens is the first
    at or above it; under TP 2 the rank's f is 7,168: 29,360,128 / 11,264 = 2,606.5."""
    from memplan.model.compiled import mlp_grad_threshold_tokens
    from memplan.spec import load_model

    spec = load_model("llama-3.1-8b")
    assert mlp_grad_threshold_tokens(spec) == 3186
    assert mlp_grad_threshold_tokens(spec, 2) == 2607
    assert mlp_grad_threshold_tokens(load_model("mixtral-8x7b")) is None

    def said(**kw) -> list[str]:
        est = estimate("llama-3.1-8b", gpus=8, zero=3, compile=True, **kw)
        return [a for a in est.assumptions if "weight-gradient threshold" in a]

    line, = said(seq_len=2048)
    assert line.startswith("2,048 tokens a micro-batch") and "threshold of 3,186" in line
    assert said(seq_len=4096) == []
    assert said(seq_len=1024, micro_batch_size=4) == []  # 4,096 tokens
    line, = said(seq_len=4096, cp=2)  # 2,048 tokens a rank
    assert line.startswith("2,048 tokens")
    eager = estimate("llama-3.1-8b", gpus=8, zero=3, seq_len=2048)
    assert not [a for a in eager.assumptions if "weight-gradient threshold" in a]


def test_compiled_float8_rowwise_without_recompute_states_dfs_bound() -> None:
    """Rowwise float8, compiled, no recompute: the bytes Inductor's dfs order may hold beyond
    the estimate at one layer's backward are said. Llama 3.1 8B at 8,192 tokens: h h + f h
    float8 weight casts (16,777,216 + 58,720,256) and T h for the gradient's cast
    (33,554,432): 109,051,904 B; TP 2 halves the weights' shares: 71,303,168 B. Each traced
    under-estimate (benchmarks/data/compiled_backward.json's rowwise rows without recompute)
    is within it: dim 512, 1 x 256, 272,900 B against 1,179,648."""
    from memplan.model.compiled import float8_rowwise_dfs_bytes
    from memplan.spec import load_model

    spec = load_model("llama-3.1-8b")
    assert float8_rowwise_dfs_bytes(spec, 1, 8192) == 109_051_904
    assert float8_rowwise_dfs_bytes(spec, 2, 8192) == 71_303_168

    def said(**kw) -> list[str]:
        est = estimate("llama-3.1-8b", gpus=8, zero=3, framework="torchtitan", compile=True,
                       **kw)
        return [a for a in est.assumptions if a.startswith("float8 rowwise without")]

    line, = said(float8="rowwise", recompute="none", seq_len=8192)
    assert "up to 109,051,904 B more" in line
    assert said(float8="rowwise", recompute="full", seq_len=8192) == []
    assert said(float8="tensorwise", recompute="none", seq_len=8192) == []
