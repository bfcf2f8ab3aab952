"""Op-level checkpointing of one fused gate/up projection (``memplan.model.sac_ops``), bytes
and policy indices derived by hand.

tiny-fused: tiny (h 64, 4 heads / 2 KV heads of d 16, SwiGLU f 176, 2 layers) with Phi-3's
MLP (``fused_gate_up``: models/phi3/modeling_phi3.py Phi3MLP.forward, ``up_states =
gate_up_proj(x)``, ``gate, up_states = up_states.chunk(2, dim=-1)``, ``up_states * act_fn(
gate)``, then down_proj). At seq 128 and micro-batch 2 in bf16 a layer's tokens are T = 256:
the gate_up ``mm`` makes T x 2f = 256 x 352 x 2 B = 180,224 B (the saved gate and up terms,
90,112 B each, are its two halves), 2 x 64 x 352 = 45,056 FLOPs a token; the activation
(``silu`` of the gate view) and the product (``mul``) 256 x 176 x 2 = 90,112 B each.
"""

from __future__ import annotations

import pytest
from memplan.api import estimate, make_layout, make_workload
from memplan.errors import MemplanError
from memplan.model.dims import Dims
from memplan.model.layer import layer_kind, ops_items
from memplan.model.sac_ops import ops_refusal
from memplan.report.sac_policy import emit_for
from memplan.spec import ModelSpec, load_model
from memplan.workload import Recompute

TINY_FUSED = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-fused",
                                       "fused_gate_up": True})
FIELDS = dict(seq_len=128, micro_batch_size=2)


def _wl(save: str = "", **fields):
    return make_workload(TINY_FUSED, **FIELDS, **fields, recompute="ops", recompute_save=save)


def test_fused_gate_up_items_by_hand() -> None:
    """The MLP's items in execution order: gate_up (the 352-wide mm, both terms), the
    activation, the product; no separate gate or up item."""
    wl = _wl()
    mlp = [(i.name, i.terms, i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.own_extra)
           for i in ops_items(TINY_FUSED, wl, Dims.of(TINY_FUSED, make_layout(1), wl))
           if i.block == "mlp"]
    assert mlp == [
        ("mlp.gate_up", ("mlp.gate", "mlp.up"), 180_224, 45_056.0, "matmul", 352, 0, False),
        ("mlp.act", ("mlp.act",), 90_112, 176.0, "act", 176, 0, False),
        ("mlp.prod", ("mlp.prod",), 90_112, 176.0, "mul", 176, 0, False),
    ]
    assert ops_refusal(TINY_FUSED, wl) is None


def test_fused_gate_up_adds_its_bytes_not_its_forward_peak() -> None:
    """Kept in both layers, gate_up adds 2 x 180,224 B of saved activations beyond full
    recompute (named by either term it covers, mlp.gate or mlp.up); a layer's forward peak
    does not rise, since Phi3MLP.forward's ``gate`` (a view of it) holds it to the MLP's end
    whether kept or not; nor does the product's (the down projection's input, alive there
    anyway). The activation kept is alive at the down projection: there the layer holds its
    checkpointed input, the residual and the MLP's input (3 x T x h x 2 = 98,304 B), gate_up,
    the activation, the product and the down projection's output (32,768 B): 491,520 B, one
    residual-sized tensor above the MLP's working-set moment without it (98,304 + 4 x 90,112
    = 458,752 B, the layer's forward peak keeping nothing)."""
    def act(save: str) -> int:
        return estimate(TINY_FUSED, **FIELDS, recompute="ops",
                        recompute_save=save).stages[0].activations_bytes

    base = act("")
    assert act("mlp.gate_up") - base == act("mlp.up") - base == 2 * 180_224
    dm = Dims.of(TINY_FUSED, make_layout(1), _wl())

    def peak(save: str) -> int:
        return layer_kind(TINY_FUSED, _wl(save), dm, False, Recompute.OPS).forward_peak_bytes

    assert peak("mlp.gate_up") == peak("mlp.prod") == peak("") == 458_752
    assert peak("mlp.act") == peak("mlp") == 491_520


def test_fused_gate_up_policy_and_other_targets() -> None:
    """The torch policy names the 352-wide mm (the layer's only one) and the 176-wide silu;
    torchtitan's Llama has no fused gate/up module: refused by name; Megatron's closest
    setting keeps the MLP (no mlp module recomputed) with gate_up kept."""
    est = estimate(TINY_FUSED, **FIELDS, recompute="ops", recompute_save="mlp.gate_up,mlp.act")
    text = emit_for("torch", est)
    compile(text, "policy.py", "exec")
    assert "SAVE = {('act', 176, 0), ('matmul', 352, 0)}" in text
    assert "('matmul', 352): 1" in text
    with pytest.raises(MemplanError, match="mlp.gate_up has no module in torchtitan"):
        emit_for("torchtitan", est)
    assert "--recompute-modules core_attn layernorm" in emit_for("megatron", est)
