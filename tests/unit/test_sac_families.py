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

import pytest
from memplan.api import estimate, make_layout, make_workload
from memplan.errors import LayoutError
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


def test_qk_norms_in_fp32_are_refused_when_kept() -> None:
    """In fp32 the norms' casts are no ops: their tensors are no items a policy names (not
    searched), and a save list keeping one is refused (before, counted kept while the
    emitted policy recomputed it)."""
    items = {i.name: i.op for i in _items(precision="fp32") if i.name.startswith("attn.q_norm")}
    assert set(items.values()) == {sac_ops.NORM}
    with pytest.raises(LayoutError, match=r"no policy names kept \(attn\.q_norm\.stats\)"):
        estimate(TINY_QK, **FIELDS, precision="fp32", recompute="ops",
                 recompute_save="attn.q_norm.stats")


def test_qwen3_auto_fits() -> None:
    """qwen3-8b (40 GiB) and qwen3-30b-a3b (80 GiB: its model states alone take 71.5 GiB)
    on the hf preset, ZeRO 3 on 8 GPUs, 4,096 tokens: ``--recompute auto`` chooses a set
    that fits, with the q/k norms' items among those searched."""
    for name, memory in (("qwen3-8b", "40GiB"), ("qwen3-30b-a3b", "80GiB")):
        est = estimate(name, gpus=8, zero=3, seq_len=4096, gpu_memory=memory,
                       framework="hf", recompute="auto")
        assert est.fits and est.workload.recompute == "ops" and est.workload.recompute_save, \
            name


# a model of dense and MoE layers (DeepSeek-V3's first_k_dense_replace, Qwen3-MoE's
# mlp_only_layers): tiny with 3 layers, the first dense, the others MoE of 4 stacked experts of
# f 96, top-2, run as transformers' grouped experts
MIXED = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-moe-mixed",
                                  "num_layers": 3, "moe": {
                                      "num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 96,
                                      "stacked_experts": True, "first_dense_layers": 1}})
MIXED_FIELDS = dict(seq_len=128, micro_batch_size=2, moe_impl="grouped")


def _mixed_search():
    from memplan.api import resolve
    from memplan.model.layer import ops_forward_peaks, ops_search_items
    from memplan.planning.save_sets import frontier

    spec, par, wl = resolve(MIXED, recompute="ops", **MIXED_FIELDS)
    dm = Dims.of(spec, par, wl)
    items = ops_search_items(spec, wl, dm)
    sets = frontier(items)
    return items, sets, ops_forward_peaks(spec, wl, dm, sets)


def test_mixed_search_items_are_scoped_and_weighted() -> None:
    """The search's items are each kind's, scoped: the dense layer's q (T*q*e = 32,768 B,
    one layer) and the MoE layers' (two layers: 65,536 B), the MoE gate/up output (196,608 B
    per layer, test_sac_moe: 393,216 B); FLOPs alike (q 8,192 per token per layer)."""
    items, sets, forward = _mixed_search()
    by = {i.name: (i.size_bytes, i.flops_per_token) for i in items}
    assert by["dense:attn.q"] == (32_768, 8_192.0)
    assert by["moe:attn.q"] == (65_536, 16_384.0)
    assert by["moe:moe.expert.gate_up"] == (393_216, 98_304.0)
    assert "dense:mlp.gate" in by and "moe:mlp.gate" not in by
    # every set's forward: (dense bytes, MoE bytes, dense forward peak, MoE forward peak),
    # each kind's bytes per layer
    last = forward[-1]
    assert last[0] == sum(b for n, (b, _) in by.items() if n.startswith("dense:")
                          and n in sets[-1].kept)
    assert 2 * last[1] == sum(b for n, (b, _) in by.items() if n.startswith("moe:")
                              and n in sets[-1].kept)


def test_mixed_auto_is_exact_at_every_budget() -> None:
    """``--recompute auto`` on a model of dense and MoE layers: at each frontier set's own
    peak as the budget, ``choose`` given each set's per-kind bytes and forward peaks returns
    the set of most bytes whose peak fits (brute force over the frontier's sets)."""
    from memplan.planning.save_sets import choose

    _, sets, forward = _mixed_search()
    peaks = {c.kept: estimate(MIXED, **MIXED_FIELDS, recompute="ops",
                              recompute_save=list(c.kept)).peak_bytes for c in sets}
    budgets = sorted(set(peaks.values()))
    for budget in budgets[:: max(1, len(budgets) // 40)] + budgets[-1:]:
        want = max(i for i, c in enumerate(sets) if peaks[c.kept] <= budget)
        got, _ = choose(sets, lambda kept: peaks[kept] <= budget, forward=forward)
        assert got is not None and sets.index(got) == want, budget


def test_mixed_auto_keeps_a_list_per_kind() -> None:
    """Between full recompute's peak and no recompute's, auto fits and keeps a list scoped
    per kind (``dense:``, ``moe:``), which ``--recompute ops`` estimates alike."""
    full = estimate(MIXED, **MIXED_FIELDS, recompute="full").peak_bytes
    none = estimate(MIXED, **MIXED_FIELDS, recompute="none").peak_bytes
    est = estimate(MIXED, **MIXED_FIELDS, recompute="auto", gpu_memory=(full + none) // 2)
    save = est.workload.recompute_save
    assert est.fits and save and all(n.split(":")[0] in ("dense", "moe") for n in save)
    again = estimate(MIXED, **MIXED_FIELDS, recompute="ops", recompute_save=list(save))
    assert again.peak_bytes == est.peak_bytes <= (full + none) // 2


def test_mixed_torch_policy_per_layer_index() -> None:
    """Layer 0 (dense) keeps its MLP's gate (the 0th 176-wide matmul), layers 1 and 2 (MoE)
    the experts' SiLU (the 0th act of width 96): SAVE and PER_LAYER are the MoE layers',
    layer 0 its own set and op counts (LAYER_SAVE, LAYER_COUNTS); torchtitan and Megatron-LM
    say what they cannot express."""
    est = estimate(MIXED, **MIXED_FIELDS, recompute="ops",
                   recompute_save="dense:mlp.gate,moe:moe.expert.act")
    import ast

    text = emit_for("torch", est)
    tree = ast.parse(text)  # (a valid module; not run: the unit suite is torch-free)
    space = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
             if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
             and node.targets[0].id in ("SAVE", "LAYER_SAVE", "PER_LAYER", "LAYER_COUNTS")}
    assert space["SAVE"] == {("act", 96, 0)}
    assert space["LAYER_SAVE"] == {0: {("matmul", 176, 0)}}
    assert set(space["LAYER_COUNTS"]) == {0}
    assert space["LAYER_COUNTS"][0][("matmul", 176)] == 2
    assert ("grouped_mm", 192) in space["PER_LAYER"]
    assert ("grouped_mm", 192) not in space["LAYER_COUNTS"][0]
    for target in ("torchtitan", "megatron"):
        assert "Not expressible: a save list per layer kind" in emit_for(target, est)


def test_mixed_plan_auto() -> None:
    """plan --recompute ops (auto's save-set search) on the model of dense and MoE layers (2
    GPUs, 1,024 tokens, 490 MB): each candidate keeps a list per kind, its estimate with that
    list fits and peaks where the plan says."""
    from memplan.api import plan

    result = plan(MIXED, gpus=2, seq_len=1024, recompute=["ops"], top=3, reserved=False,
                  gpu_memory="490MB", moe_impl="grouped", global_batch_size=16)
    assert result.candidates
    for c in result.candidates:
        assert c.recompute == "ops" and c.peak_bytes <= result.budget_bytes
        assert c.estimate.peak_bytes == c.peak_bytes
        assert {n.split(":")[-2] for n in c.recompute_save} <= {"dense", "moe"}


def test_sliding_window_below_its_length_is_the_generic_layer() -> None:
    """A sliding window longer than the sequence masks nothing (transformers' SDPA path gets
    no mask: masking_utils.py ``_ignore_causal_mask_sdpa``): the layer's items are those of
    the same model without a window, and it keeps the same bytes. At a sequence as long as
    the window (an explicit mask) the items are the same ops (K and V repeated and the mask
    converted by ops no policy counts): keeping k and up adds T*kv*e + T*f*e = 512*32*2 +
    512*176*2 = 212,992 B per layer (T = 2 x 256) to full recompute's saved activations,
    425,984 B over 2 layers, and the empty list is full recompute's (the mask, s*s = 65,536
    B, each checkpointed layer's input in both)."""
    tiny = load_model("tiny")
    window = ModelSpec.model_validate({**tiny.model_dump(), "name": "tiny-window",
                                       "sliding_window": 256})
    assert _items(window) == _items(tiny)
    kept = dict(**FIELDS, recompute="ops", recompute_save="attn.k,mlp.up")
    assert estimate(window, **kept).stages[0].activations_bytes == \
        estimate(tiny, **kept).stages[0].activations_bytes
    at = dict(seq_len=256, micro_batch_size=2, framework="hf")
    full = estimate(window, **at, recompute="full").stages[0].activations_bytes
    assert estimate(window, **at, recompute="ops").stages[0].activations_bytes == full
    assert estimate(window, **at, recompute="ops", recompute_save="attn.k,mlp.up").stages[0] \
        .activations_bytes - full == 2 * 212_992
