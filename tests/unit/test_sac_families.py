"""Op-level checkpointing beyond Llama's layer (``memplan.model.sac_ops``): per-head q/k
norms (Qwen3), bytes and policy indices derived by hand.

tiny-qk: tiny (h 64, 4 heads / 2 KV heads of d 16, SwiGLU f 176, 2 layers) with Qwen3's
per-head RMSNorms on q and k (``qk_norm = "head"``: models/qwen3/modeling_qwen3.py
Qwen3Attention.forward, ``q_norm(q_proj(x).view(..., head_dim))``, then k's, then RoPE). At
seq 128 and micro-batch 2 in bf16 a layer's tokens are T = 256; the q norm runs on T x 4 =
1,024 rows of 16, the k norm on T x 2 = 512: q norm's fp32 input 1,024 x 16 x 4 = 65,536 B,
its rsqrt 1,024 x 4 = 4,096 B, its bf16 cast back 1,024 x 16 x 2 = 32,768 B; the k norm's
half of each (32,768, 2,048, 16,384 B). Its output goes to RoPE, which saves nothing of it.
"""

from __future__ import annotations

from memplan.api import estimate, make_layout, make_workload
from memplan.model import sac_ops
from memplan.model.dims import Dims
from memplan.model.layer import ops_items
from memplan.report.sac_policy import emit_for
from memplan.spec import ModelSpec, load_model

TINY_QK = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-qk",
                                    "qk_norm": "head"})
FIELDS = dict(seq_len=128, micro_batch_size=2)


def _items(spec: ModelSpec = TINY_QK, **fields):
    wl = make_workload(spec, **FIELDS, **fields, recompute="ops")
    return ops_items(spec, wl, Dims.of(spec, make_layout(1), wl))


def test_qk_norm_items_by_hand() -> None:
    """Each norm's fp32 input (``_to_copy``), rsqrt and bf16 cast, in the attention block:
    bytes as above, one FLOP per element of the rank's q (64) or k (32) width per token.
    Indices among the layer's ops of a family and width: the rsqrts (width 1) run attention
    norm, q norm, k norm, MLP norm (0-3); the 16-wide casts q norm's (0, 1) then k norm's
    (2, 3)."""
    qk = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.block)
          for i in _items() if "_norm." in i.name and i.name.startswith("attn.")}
    assert qk == {
        "attn.q_norm.input_fp32": (65_536, 64.0, "copy", 16, 0, "attn"),
        "attn.q_norm.stats": (4_096, 64.0, "rsqrt", 1, 1, "attn"),
        "attn.q_norm.normed": (32_768, 64.0, "copy", 16, 1, "attn"),
        "attn.k_norm.input_fp32": (32_768, 32.0, "copy", 16, 2, "attn"),
        "attn.k_norm.stats": (2_048, 32.0, "rsqrt", 1, 2, "attn"),
        "attn.k_norm.normed": (16_384, 32.0, "copy", 16, 3, "attn"),
    }
    norms = {i.name: i.nth for i in _items() if i.op == "rsqrt" or i.block == "mlp_norm"}
    assert norms["attn_norm.stats"] == 0 and norms["mlp_norm.stats"] == 3
    # the MLP norm's casts stay the 2nd and 3rd of width h (the q/k norms' are 16 wide)
    assert (norms["mlp_norm.input_fp32"], norms["mlp_norm.normed"]) == (2, 3)


def test_qk_norm_items_add_their_bytes() -> None:
    """The q norm's rsqrt and the k norm's fp32 input kept in both layers: 2 x (4,096 +
    32,768) B beyond full recompute; the group ``attention`` takes both norms' six tensors
    (2 x 153,600 B) with the projections' and kernel's (135,168 B per layer: test_sac_ops)."""
    def act(**fields) -> int:
        return estimate(TINY_QK, **FIELDS, **fields).stages[0].activations_bytes

    full = act(recompute="full")
    assert act(recompute="ops", recompute_save="attn.q_norm.stats,attn.k_norm.input_fp32") \
        - full == 2 * (4_096 + 32_768)
    assert act(recompute="ops", recompute_save="attention") - full == 2 * (135_168 + 153_600)


def test_qk_norm_policy_names_its_ops() -> None:
    """The q norm's rsqrt is the layer's 1st rsqrt, the k norm's bf16 cast its 3rd 16-wide
    ``_to_copy``; one layer runs 4 rsqrts and 4 casts of width 16. No item is a 16-wide
    ``mul`` (the norms' products and RoPE's are kept by none): not counted."""
    est = estimate(TINY_QK, **FIELDS, recompute="ops",
                   recompute_save="attn.q_norm.stats,attn.k_norm.normed")
    text = emit_for("torch", est)
    compile(text, "policy.py", "exec")
    assert "SAVE = {('copy', 16, 3), ('rsqrt', 1, 1)}" in text
    assert "('rsqrt', 1): 4" in text and "('copy', 16): 4" in text
    assert "('mul', 16)" not in text


def test_qk_norms_in_fp32_are_kept_but_not_named() -> None:
    """In fp32 the norms' casts are no ops: their tensors are kept by the estimate, not
    searched, and the policy says it cannot name them."""
    items = {i.name: i.op for i in _items(precision="fp32") if i.name.startswith("attn.q_norm")}
    assert set(items.values()) == {sac_ops.NORM}
    est = estimate(TINY_QK, **FIELDS, precision="fp32", recompute="ops",
                   recompute_save="attn.q_norm.stats")
    assert "Not expressible, recomputed instead: attn.q_norm.stats" in emit_for("torch", est)


def test_qwen3_auto_fits() -> None:
    """qwen3-8b (40 GiB) and qwen3-30b-a3b (80 GiB: its model states alone take 71.5 GiB)
    on the hf preset, ZeRO 3 on 8 GPUs, 4,096 tokens: ``--recompute auto`` chooses a set
    that fits, with the q/k norms' items among those searched."""
    for name, memory in (("qwen3-8b", "40GiB"), ("qwen3-30b-a3b", "80GiB")):
        est = estimate(name, gpus=8, zero=3, seq_len=4096, gpu_memory=memory,
                       framework="hf", recompute="auto")
        assert est.fits and est.workload.recompute == "ops" and est.workload.recompute_save, \
            name
