"""Op-level checkpointing (``--recompute ops``) under autocast (``amp-bf16``, ``amp-fp16``: fp32
weights, the forward under torch.autocast): bytes derived by hand for the tiny spec, and the
phase peaks traced (tests/traced/test_sac_policy.py, the reference model on fake tensors).

tiny: 2 layers, h 64, 4 heads / 2 KV heads of d 16 (q 64, kv 32), SwiGLU f 176. At seq 128 and
micro-batch 2 a layer's tokens are T = 256. Under autocast the ops an item keeps run in the
low dtype (e = 2): the projections' ``mm`` on bf16 casts of their input and weight, so q
T*q*e = 32,768, k and v T*kv*e = 16,384 each, the output projection's T*h*e = 32,768; the
SDPA kernel's output T*q*e = 32,768 with its fp32 logsumexp b*heads*s*4 = 4,096 (36,864
together); gate, act, up and product T*f*e = 90,112 each. Per layer ``attention`` keeps
32,768 + 2*16,384 + 36,864 + 32,768 = 135,168 and ``mlp`` 4*90,112 = 360,448. The casts
(``aten._to_copy``) are no item: they rerun, the weight casts held by autocast's cache to
the forward's end, as under full recompute.
"""

from __future__ import annotations

import pytest
from memplan.api import estimate, make_layout, make_workload
from memplan.errors import LayoutError
from memplan.model.dims import Dims
from memplan.model.layer import ops_items, ops_unkept
from memplan.model.sac_ops import resolve
from memplan.report.sac_policy import _counts, _save_set, emit_for
from memplan.spec import ModelSpec, load_model

TINY = dict(seq_len=128, micro_batch_size=2)


def _stage(spec: str | ModelSpec = "tiny", **fields):
    return estimate(spec, **TINY, **fields).stages[0]


@pytest.mark.parametrize("precision", ["amp-bf16", "amp-fp16"])
def test_empty_list_under_autocast_is_full_recompute(precision: str) -> None:
    """Keeping nothing keeps each layer's input alone: the fully recomputed layer, autocast's
    cached weight casts included."""
    ops = _stage(recompute="ops", precision=precision)
    full = _stage(recompute="full", precision=precision)
    assert ops.activations_bytes == full.activations_bytes
    assert ops.steady == full.steady and ops.first_step == full.first_step


@pytest.mark.parametrize(("precision", "save", "per_layer"), [
    ("amp-bf16", "attention", 135_168), ("amp-bf16", "mlp", 360_448),
    ("amp-bf16", "attn.k,attn.o_proj,mlp.up", 16_384 + 32_768 + 90_112),
    ("amp-fp16", "attn.out,mlp.prod", 36_864 + 90_112)])
def test_kept_outputs_are_the_low_precision_ops(precision: str, save: str,
                                                per_layer: int) -> None:
    """Each kept item adds its op's low-precision output (the module docstring's bytes) per
    layer, 2 layers, beyond full recompute's saved activations."""
    kept = _stage(recompute="ops", recompute_save=save, precision=precision)
    full = _stage(recompute="full", precision=precision)
    assert kept.activations_bytes - full.activations_bytes == 2 * per_layer


# traced: the reference model under autocast on fake tensors with the emitted policy
# (tests/traced/test_sac_policy.py TINY amp cases): saved activations and the first and steady
# steps' forward and backward peaks, all exact
TRACED = [("", (463_880, 1_280_264, 1_925_128, 2_151_176, 2_796_040)),
          ("attention", (734_216, 1_550_600, 1_941_000, 2_421_512, 2_811_912)),
          ("mlp", (1_184_776, 2_001_160, 2_166_280, 2_872_072, 3_037_192))]


@pytest.mark.parametrize(("save", "traced"), TRACED, ids=[s or "input" for s, _ in TRACED])
def test_phase_peaks_match_the_trace(save: str, traced: tuple[int, ...]) -> None:
    """amp-bf16: the kept outputs of both layers are alive at the forward's peak (2*135,168
    = 270,336 over keeping nothing with ``attention``, 2*360,448 = 720,896 with ``mlp``)."""
    est = estimate("tiny", **TINY, precision="amp-bf16", recompute="ops", recompute_save=save)
    stage = est.stages[0]
    got = (stage.activations_bytes, stage.first_step.forward,
           stage.first_step.backward, stage.steady.forward,
           stage.steady.backward)
    assert got == traced


def test_policy_counts_the_fp32_norms_products() -> None:
    """With f = h = 64 the MLP's product shares its width with each norm's two fp32
    products (x * rstd, weight * normed: the norm runs in fp32 on the fp32 stream under
    autocast); RoPE's products are 16 wide. In execution order: attn_norm's two (0, 1),
    mlp_norm's two (2, 3), the product (4): the policy keeps ('mul', 64, 4) of 5 per layer.
    The casts (``copy``) and rsqrt are counted by no item: no key of theirs."""
    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-f64",
                                     "ffn_hidden_size": 64})
    wl = make_workload(spec, **TINY, precision="amp-bf16", recompute="ops",
                       recompute_save="mlp.prod")
    dm = Dims.of(spec, make_layout(1), wl)
    items = ops_items(spec, wl, dm)
    counts = _counts(items, ops_unkept(spec, wl, dm))
    assert _save_set(resolve(items, wl.recompute_save, spec)) == "{('mul', 64, 4)}"
    assert counts[("mul", 64)] == 5
    assert not any(op in ("copy", "rsqrt") for op, _ in counts)


def test_emitted_policy_keeps_no_cast() -> None:
    """``attention`` under autocast: q (mm, 64 wide, as are the output and down projections:
    nth 0), k and v (mm, 32 wide: 0, 1), the kernel (sdpa 64: 0), the output projection
    (mm 64: nth 1), as without autocast; no cast or rsqrt counted."""
    est = estimate("tiny", **TINY, precision="amp-bf16", recompute="ops",
                   recompute_save="attention")
    text = emit_for("torch", est)
    assert ("SAVE = {('matmul', 32, 0), ('matmul', 32, 1), ('matmul', 64, 0), "
            "('matmul', 64, 1), ('sdpa', 64, 0)}") in text
    per_layer = next(line for line in text.splitlines() if line.startswith("PER_LAYER"))
    assert "copy" not in per_layer and "rsqrt" not in per_layer


@pytest.mark.parametrize("save", ["attn_norm.output", "attn.q,mlp_norm.stats"])
def test_norm_tensors_refused_under_autocast(save: str) -> None:
    with pytest.raises(LayoutError, match="a norm's tensors kept under autocast"):
        _stage(recompute="ops", recompute_save=save, precision="amp-bf16")


def test_the_norms_group_under_autocast_keeps_nothing() -> None:
    """Under autocast no norm tensor is an op a policy names: the ``norms`` group keeps none
    of them (full recompute's saved bytes), where naming one is refused above."""
    assert _stage(recompute="ops", recompute_save="norms", precision="amp-bf16"
                  ).activations_bytes == _stage(recompute="full", precision="amp-bf16"
                                                ).activations_bytes


def test_down_projection_weight_cast_at_the_mlps_end() -> None:
    """h 256, f 896 at 2 x 1,024 tokens keeping the gate, SiLU and up outputs: the forward
    peaks at a down projection, whose weight autocast casts before the
    matmul: h*f*e = 256*896*2 = 458,752 B there beyond the working set's moments. Keeping
    the product too peaks elsewhere. Both traced on the reference model (tests/traced/
    test_sac_policy.py WIDE_MLP): first forward 45,782,016 and 52,638,728 B."""
    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(),
                                     "name": "tiny-wide-mlp", "hidden_size": 256,
                                     "ffn_hidden_size": 896, "num_attention_heads": 8,
                                     "num_kv_heads": 2, "head_dim": 32, "vocab_size": 64,
                                     "max_seq_len": 2048})
    kw = dict(seq_len=1024, micro_batch_size=2, precision="amp-bf16", recompute="ops")
    some = estimate(spec, **kw, recompute_save="mlp.act,mlp.gate,mlp.up").stages[0]
    every = estimate(spec, **kw, recompute_save="mlp").stages[0]
    assert some.first_step.forward == 45_782_016
    assert every.first_step.forward == 52_638_728
