"""Op-level checkpointing of Granite 4.0-H's Mamba2 and attention layers with their MoE blocks
(``memplan.model.sac_mamba`` composed with ``memplan.model.sac_moe``): the MoE block's items
in a Mamba2 layer derived by hand, the fused shared MLP's gate/up projection as one item,
the kinds a save list scopes, the emitted torch policy and the refusals that remain.

granite-4.0-h-tiny's config (tests/data/hf/heldout/granite-4.0-h-tiny, as transformers 5.3's
GraniteMoeHybrid reads it): 40 layers, attention on 5, 15, 25, 35, Mamba2 on the other 36,
every layer's MLP GraniteMoeHybridMoE (E = 64 experts of f = 512, k = 6 routed a token) with
the shared MLP (GraniteMoeHybridMLP, fs = 1,024, ``input_linear`` h -> 2 fs chunked into gate
and up) after it; h = 1,536. At seq 1,024 and micro-batch 2 in bf16 (e = 2; mamba_kernel
torch, moe_impl grouped) a layer's tokens are T = 2,048 and its routed rows R = T k = 12,288.
The block's ops in a Mamba2 layer, after the mixer's (none of their family and width):

- the router's projection (GraniteMoeTopKRouter.forward as transformers 5.23 writes it,
  ``F.linear(x, w)``): T x E x e = 2,048 x 64 x 2 = 262,144 B, an ``mm`` 64 wide, 2 h E =
  196,608 FLOPs a token;
- the softmax of the top-k fp32 logits: R x 4 = 49,152 B, ``_softmax`` 6 wide, k = 6 FLOPs;
- the rows sorted by expert (integrations/moe.py ``grouped_mm_experts_forward``):
  R x h x e = 37,748,736 B, the first ``index`` 1,536 wide (grouped-token: the second);
- the experts' gate/up: R x 2f x e = 25,165,824 B, ``grouped_mm`` 1,024 wide,
  k x 4 h f = 18,874,368 FLOPs; SiLU and the product R x f x e = 12,582,912 B each (``act``,
  ``mul`` 512 wide, k f = 3,072 FLOPs); the down projection R x h x e = 37,748,736 B
  (``grouped_mm`` 1,536 wide, k x 2 h f = 9,437,184 FLOPs);
- the shared MLP: ``input_linear``'s output T x 2 fs x e = 2,048 x 2,048 x 2 = 8,388,608 B,
  one ``mm`` 2,048 wide (``moe.shared.gate_up``, covering the terms ``moe.shared.gate`` and
  ``moe.shared.up``), 4 h fs = 6,291,456 FLOPs; its SiLU and product T x fs x e = 4,194,304 B
  each (``act``, ``mul`` 1,024 wide, 1,024 FLOPs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from memplan.api import estimate, make_workload
from memplan.errors import LayoutError, MemplanError
from memplan.model.dims import Dims
from memplan.model.layer import ops_items, ops_kinds
from memplan.parallel import ParallelConfig
from memplan.report.sac_policy import emit_for
from memplan.spec import load_model, spec_from_hf_dict

_CONFIG = Path(__file__).resolve().parents[1] / "data" / "hf" / "heldout" / "granite-4.0-h-tiny"
GRANITE_H = spec_from_hf_dict(json.loads((_CONFIG / "config.json").read_text()), "config.json",
                              "granite-4.0-h-tiny")
KW = dict(seq_len=1024, micro_batch_size=2, precision="bf16-pure", framework="hf",
          mamba_kernel="torch", moe_impl="grouped")
HAND = {"moe.router": (262_144, 196_608.0, "matmul", 64, 0),
        "moe.topk_weights": (49_152, 6.0, "softmax", 6, 0),
        "moe.dispatched": (37_748_736, 0.0, "index", 1536, 0),
        "moe.expert.gate_up": (25_165_824, 18_874_368.0, "grouped_mm", 1024, 0),
        "moe.expert.act": (12_582_912, 3072.0, "act", 512, 0),
        "moe.expert.prod": (12_582_912, 3072.0, "mul", 512, 0),
        "moe.expert.down": (37_748_736, 9_437_184.0, "grouped_mm", 1536, 0),
        "moe.shared.gate_up": (8_388_608, 6_291_456.0, "matmul", 2048, 0),
        "moe.shared.act": (4_194_304, 1024.0, "act", 1024, 0),
        "moe.shared.prod": (4_194_304, 1024.0, "mul", 1024, 0)}


def _items(variant: str, **fields) -> dict:
    wl = make_workload(GRANITE_H, **{**KW, **fields}, recompute="ops")
    dm = Dims.of(GRANITE_H, ParallelConfig(), wl)
    return {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
            for i in ops_items(GRANITE_H, wl, dm, True, variant) if i.name.startswith("moe.")}


@pytest.mark.parametrize("variant", ["linear", ""])
def test_moe_items_in_both_kinds_by_hand(variant: str) -> None:
    """A Mamba2 layer's ("linear") and an attention layer's MoE block: the same items, each
    the first of its family and width in the layer."""
    assert _items(variant) == HAND


def test_rows_gathered_by_token_first() -> None:
    """moe_impl grouped-token (5.3's integration: the rows gathered by token, then sorted):
    the dispatched rows are the layer's second ``index`` 1,536 wide."""
    assert _items("linear", moe_impl="grouped-token")["moe.dispatched"] == \
        (37_748_736, 0.0, "index", 1536, 1)


def test_kinds_are_moe_layers_and_lists_add_their_bytes() -> None:
    """Both kinds are MoE layers: ``mamba:moe.shared.gate_up`` adds 8,388,608 B on each of the
    36 Mamba2 layers, ``attn:moe.shared.up`` (a term the fused item covers) the same on the 4
    attention layers; ``mamba:moe.router`` 262,144 B on 36."""
    assert ops_kinds(GRANITE_H) == (("attn", True, 4), ("mamba", True, 36))

    def activations(save: str) -> int:
        return estimate(GRANITE_H, **KW, recompute="ops", recompute_save=save).stages[0] \
            .activations_bytes

    base = activations("")
    assert activations("mamba:moe.shared.gate_up") - base == 36 * 8_388_608
    assert activations("attn:moe.shared.up") - base == 4 * 8_388_608
    assert activations("mamba:moe.router") - base == 36 * 262_144
    with pytest.raises(MemplanError, match="moe.shared.gate_up"):
        activations("mamba:moe.shared.down")


def test_emitted_torch_policy() -> None:
    """The Mamba2 layers keep the router's mm (64 wide) and the shared gate/up's (2,048);
    each runs one ``mm`` 2,048 wide and one 64 wide; torchtitan and Megatron-LM refuse."""
    est = estimate(GRANITE_H, **KW, recompute="ops",
                   recompute_save="mamba:moe.router,mamba:moe.shared.gate_up,attn:attn.q")
    space: dict = {}
    exec(compile(emit_for("torch", est), "<policy>", "exec"), space)  # noqa: S102
    assert space["SAVE"] == {("matmul", 64, 0), ("matmul", 2048, 0)}
    assert space["PER_LAYER"][("matmul", 2048)] == 1 and space["PER_LAYER"][("matmul", 64)] == 1
    assert sorted(space["LAYER_COUNTS"]) == [5, 15, 25, 35]
    for target in ("torchtitan", "megatron"):
        with pytest.raises(MemplanError, match="Mamba2 layers"):
            emit_for(target, est)


def test_assumption_names_the_experts_rerun() -> None:
    est = estimate(GRANITE_H, **KW, recompute="ops", recompute_save="mamba:moe.expert.act")
    line = next(a for a in est.assumptions if a.startswith("recompute ops"))
    assert "the experts' down projection reruns" in line and "dense MLP" not in line


@pytest.mark.parametrize(("options", "why"), [({"moe_impl": "loop"}, "moe_impl loop")])
def test_still_refused(options: dict, why: str) -> None:
    """The experts' loop stays refused, by name."""
    with pytest.raises(LayoutError, match=why):
        estimate(GRANITE_H, **{**KW, **options}, recompute="ops")


def test_moe_blocks_on_some_layers_only_refused() -> None:
    """A kind's layers are MoE layers or not, all alike (``layer.ops_kinds``): MoE blocks
    after a first dense layer (``first_dense_layers`` 1) are refused by name."""
    spec = GRANITE_H.model_copy(update={"moe": GRANITE_H.moe.model_copy(
        update={"first_dense_layers": 1})})
    with pytest.raises(LayoutError, match="MoE blocks on some layers only"):
        estimate(spec, **KW, recompute="ops")


@pytest.mark.parametrize("model", ["granite-4.0-h-tiny", "granite-4.0-h-small"])
def test_catalog_models_estimate(model: str) -> None:
    """The catalog's Granite 4.0-H models estimate with a list per kind (they refused
    "Mamba layers with MoE blocks")."""
    est = estimate(load_model(model), seq_len=1024, micro_batch_size=1, precision="bf16-pure",
                   framework="hf", mamba_kernel="torch", moe_impl="grouped", recompute="ops",
                   recompute_save="attention,mlp")
    assert est.peak_bytes > 0
