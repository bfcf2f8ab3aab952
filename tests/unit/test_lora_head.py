"""LoRA on the output projection (``--lora-targets output``, peft's ``lm_head``, torchtune's
``apply_lora_to_output``): adapters, saved terms and the head's moments derived by hand.

The toy shape is the one tests/traced/test_finetune.py traces: Llama 3 cut to two layers,
hidden h = 256, q 256 wide, k and v 64, vocabulary V = 1000, untied head; micro-batch 2 of
128 tokens (T = 256), rank r = 8. peft's ``Linear.forward`` (``peft/tuners/lora/layer.py``)
on ``lm_head``: ``result = base_layer(x)`` (frozen: saves no input), ``x.to(fp32)`` for the
fp32 adapters, ``lora_B(lora_A(dropout(x))) * scaling`` added, ``result.to(bf16)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan import api
from memplan.errors import MemplanError
from memplan.hardware import DEFAULT_GPU, load_gpu
from memplan.model import head
from memplan.model.adapters import adapters_of
from memplan.model.dims import Dims
from memplan.model.estimate import estimate
from memplan.overheads import no_overheads
from memplan.spec import spec_from_hf_dict
from memplan.workload import Workload

HF = Path(__file__).resolve().parents[1] / "data" / "hf" / "Meta-Llama-3-8B" / "config.json"


def toy(**extra):
    data = json.loads(HF.read_text())
    data.update(num_hidden_layers=2, hidden_size=256, intermediate_size=896,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, **extra)
    return spec_from_hf_dict(data, "test", "llama3-toy")


def resolved(precision="bf16-pure", **lora):
    return api.resolve(toy(), framework="hf", micro_batch_size=2, seq_len=128,
                       precision=precision, **lora)


def test_output_and_lm_head_name_the_head() -> None:
    """``output`` and ``lm_head`` adapt the head; peft's all-linear never does (it skips the
    output layer), unless the head is named beside it."""
    for name in ("output", "lm_head"):
        assert "head" in adapters_of(Workload(lora_rank=8, lora_targets=f"q,v,{name}")).targets
    assert "head" not in adapters_of(Workload(lora_rank=8, lora_targets="all-linear")).targets
    assert "head" in adapters_of(Workload(lora_rank=8,
                                          lora_targets="all-linear,output")).targets
    assert "head" not in adapters_of(Workload(lora_rank=8)).targets


def test_head_adapter_states_by_hand() -> None:
    """q, v and the head, rank 8: q's 8 x 256 + 256 x 8 = 4,096, v's 8 x 256 + 64 x 8 = 2,560
    per layer, 13,312 for two; the head's lora_A 8 x 256 and lora_B 1,000 x 8 = 10,048; 23,360
    fp32 parameters: gradients 93,440 B, AdamW's two states 186,880 B plus fused AdamW's fp32
    step per tensor (10 tensors: 40 B) = 186,920 B; the bf16 base 4,434,432 B
    (test_adapters.py) plus the adapters: 4,527,872 B (all three as traced)."""
    spec, par, wl = resolved(lora_rank=8, lora_targets="q,v,output")
    st = estimate(spec, load_gpu(DEFAULT_GPU), par, wl, overheads=no_overheads()).stages[0]
    assert st.grads_bytes == 93_440
    assert st.optimizer_bytes == 186_920
    assert st.params_bytes == 4_434_432 + 93_440 == 4_527_872


def test_head_saved_terms_by_hand() -> None:
    """bf16 base: lora_A saves the fp32 cast of the final norm's output, T x h x 4 = 256 x 256
    x 4 = 262,144 B, lora_B the rank-8 intermediate, 256 x 8 x 4 = 8,192 B; the frozen base
    head saves no input (final_norm.output 0). fp32 base, no dropout: lora_A saves the final
    norm's output itself (final_norm.output 262,144 B, no lora_input). Dropout 0.1: the bool
    mask and the fp32 dropout output, 256 x 256 x (1 + 4) = 327,680 B."""
    spec, par, wl = resolved(lora_rank=8, lora_targets="q,v,output")
    terms = dict(head.head_terms(spec, wl, Dims.of(spec, par, wl)))
    assert terms["head.lora_input"] == 262_144
    assert terms["head.lora_rank"] == 8_192
    assert terms["final_norm.output"] == 0
    spec, par, wl = resolved("fp32", lora_rank=8, lora_targets="q,v,lm_head")
    terms = dict(head.head_terms(spec, wl, Dims.of(spec, par, wl)))
    assert terms["head.lora_input"] == 0
    assert terms["final_norm.output"] == 262_144
    spec, par, wl = resolved(lora_rank=8, lora_targets="output", lora_dropout=0.1)
    terms = dict(head.head_terms(spec, wl, Dims.of(spec, par, wl)))
    assert terms["head.lora_input"] == 327_680


def test_head_adapter_moments_by_hand() -> None:
    """bf16 base. Forward, at ``result + lora_B(...) * scaling`` beyond the saved terms: the
    model's final hidden state 256 x 256 x 2 = 131,072, the bf16 base logits 256 x 1,000 x 2
    = 512,000 and two fp32 logits-sized tensors 2 x 1,024,000: 2,691,072 B. Backward: the
    adapter's saved 270,336 B and the larger of the adapter's step (bf16 base gradient share
    512,000 + fp32 gradient and its scaled copy 2 x 1,024,000 = 2,560,000) and the base's
    (512,000 + two bf16 input gradients 2 x 131,072 = 774,144): 2,830,336 B. Unadapted: 0."""
    spec, par, wl = resolved(lora_rank=8, lora_targets="q,v,output")
    dm = Dims.of(spec, par, wl)
    assert head.lora_forward_bytes(spec, wl, dm) == 131_072 + 512_000 + 2_048_000
    assert head.lora_backward_bytes(spec, dm) == 270_336 + 2_560_000
    spec, par, wl = resolved(lora_rank=8)
    dm = Dims.of(spec, par, wl)
    assert head.lora_forward_bytes(spec, wl, dm) == head.lora_backward_bytes(spec, dm) == 0


@pytest.mark.parametrize(("extra", "lora", "message"), [
    ({"tie_word_embeddings": True}, {}, "lora_targets output on llama3-toy: its head is tied"),
    ({}, {"base_quant": "nf4"}, "lora_targets output with base_quant nf4"),
])
def test_refused(extra, lora, message) -> None:
    """A tied head and a quantized base are refused, naming the field."""
    spec, par, wl = api.resolve(toy(**extra), framework="hf", micro_batch_size=2, seq_len=128,
                                precision="bf16-pure", lora_rank=8, lora_targets="q,output",
                                **lora)
    with pytest.raises(MemplanError, match=message):
        estimate(spec, load_gpu(DEFAULT_GPU), par, wl, overheads=no_overheads())
