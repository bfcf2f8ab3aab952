"""Op-level checkpointing of a parallel layer (``ModelSpec.parallel_block``: models/cohere2/
modeling_cohere2.py Cohere2DecoderLayer.forward, one input_layernorm feeding self_attn and
mlp, ``residual + hidden_states_attention + hidden_states_mlp``), bytes derived by hand.

tiny-par: tiny (h 64, 4 heads / 2 KV heads of d 16, SwiGLU f 176, 2 layers) as a parallel
layer. At seq 128 and micro-batch 2 in bf16 a layer's tokens are T = 256: a residual-sized
tensor is T x h x 2 = 32,768 B, an MLP intermediate T x f x 2 = 90,112 B.
"""

from __future__ import annotations

from memplan.api import make_layout, make_workload
from memplan.model.dims import Dims
from memplan.model.layer import _first_output_grad, forward_moments, layer_kind, ops_items
from memplan.model.layer import layer_blocks
from memplan.spec import ModelSpec, load_model
from memplan.workload import Recompute

TINY_PAR = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-par",
                                     "parallel_block": True})
FIELDS = dict(seq_len=128, micro_batch_size=2)


def _wl(save: str = "", **fields):
    return make_workload(TINY_PAR, **FIELDS, **fields, recompute="ops", recompute_save=save)


def _dm(**fields) -> Dims:
    return Dims.of(TINY_PAR, make_layout(1), _wl(**fields))


def test_parallel_items_have_no_mlp_norm() -> None:
    """One norm, then the attention's items, then the MLP's: no ``mlp_norm`` item, and the
    MLP's ops numbered after the attention's (gate the 176-wide mm 0, up 1)."""
    items = ops_items(TINY_PAR, _wl(), _dm())
    assert {i.block for i in items} == {"attn_norm", "attn", "mlp"}
    assert [(i.name, i.nth) for i in items if i.block == "mlp"] == [
        ("mlp.gate", 0), ("mlp.act", 0), ("mlp.up", 1), ("mlp.prod", 0)]


def test_checkpointed_mlp_runs_beside_norm_and_attention_outputs() -> None:
    """Full recompute's MLP moment: the checkpointed input, the norm's output (the MLP's
    input) and the attention's output (waiting for the layer's sum), 3 x 32,768 B, beside
    the MLP's working set, gate, activation and up alive at the product: 3 x 90,112 B;
    368,640 B, the layer's forward peak."""
    moments = forward_moments(TINY_PAR, _wl(), _dm(), moe_layer=False,
                              recompute=Recompute.FULL)
    mlp = [m.alive_bytes + m.transient_bytes for m in moments if m.block == "mlp"]
    assert mlp == [3 * 32_768 + 3 * 90_112] == [368_640]


def test_kept_output_projection_adds_nothing_at_the_mlp() -> None:
    """Kept, the output projection's output is the attention's output the MLP's moment
    holds anyway: the forward peak stays 368,640 B, as does keeping the MLP's activation (at
    the down projection: 32,768 x 4 + 2 x 90,112 = 311,296 B). The kernel's output (with its
    logsumexp, 32,768 + 4,096 B) is alive beside the MLP: 405,504 B."""
    dm = _dm()

    def peak(save: str) -> int:
        return layer_kind(TINY_PAR, _wl(save), dm, False, Recompute.OPS).forward_peak_bytes

    assert peak("") == peak("attn.o_proj") == peak("mlp.act") == 368_640
    assert peak("attn.out") == 368_640 + 36_864


def test_attention_output_gradient_waits_under_autocast() -> None:
    """Under amp-bf16 the layer's sum casts the fp32 gradient to the attention output's bf16
    before the MLP's backward: 32,768 B beside the MLP's moments, none beside the
    attention's; without autocast the adds pass the gradient itself."""
    blocks = {b.name: b for b in layer_blocks(TINY_PAR, False)}
    amp = _dm(precision="amp-bf16")
    assert _first_output_grad(TINY_PAR, amp, blocks["mlp"]) == 32_768
    assert _first_output_grad(TINY_PAR, amp, blocks["attn"]) == 0
    assert _first_output_grad(TINY_PAR, _dm(), blocks["mlp"]) == 0
