"""Op-level checkpointing of MLPs whose saved tensors differ from a gated MLP's, derived by
hand.

tiny-relu: tiny (h 64, 4 heads / 2 KV heads of d 16, 2 layers, no biases) with an ungated
ReLU MLP of f 176 (``MlpKind.RELU``: down(relu(up(x)))). At seq 128 and micro-batch 2 in
bf16 a layer's tokens are T = 256. ReLU saves its output, which the down projection saves
too (one term, ``mlp.act``); the up projection's output is saved by no one.
"""

from __future__ import annotations

import pytest

from memplan.api import estimate, make_layout, make_workload
from memplan.errors import MemplanError
from memplan.model.dims import Dims
from memplan.model.layer import ops_items
from memplan.model.sac_ops import ops_refusal, rerun_flops_per_token, resolve
from memplan.report.sac_policy import emit_for
from memplan.spec import ModelSpec, load_model

FIELDS = dict(seq_len=128, micro_batch_size=2)
TINY_RELU = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-relu",
                                      "mlp": "relu"})


def _items(spec: ModelSpec, **fields):
    wl = make_workload(spec, **FIELDS, **fields, recompute="ops")
    assert ops_refusal(spec, wl) is None
    return ops_items(spec, wl, Dims.of(spec, make_layout(1), wl))


def test_relu_mlp_items_by_hand() -> None:
    """mlp.fc1: the up projection's mm, T x f x 2 = 256 x 176 x 2 = 90,112 B, 2 x 64 x 176 =
    22,528 FLOPs a token, the first 176-wide matmul; mlp.act: relu's output, 90,112 B, one
    FLOP an element (176 a token), the first 176-wide activation."""
    mlp = [(i.name, i.terms, i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
           for i in _items(TINY_RELU) if i.block == "mlp"]
    assert mlp == [("mlp.fc1", (), 90_112, 22_528.0, "matmul", 176, 0),
                   ("mlp.act", ("mlp.act",), 90_112, 176.0, "act", 176, 0)]
    items = _items(TINY_RELU)
    assert rerun_flops_per_token(items, ()) - rerun_flops_per_token(
        items, resolve(items, ("mlp",), TINY_RELU)) == 22_528 + 176


def test_relu_kept_outputs_add_their_bytes() -> None:
    """Keeping the MLP (fc1 and act) in both layers: 2 x 2 x 90,112 B beyond keeping
    nothing; the policy names relu as an activation of width 176."""
    def run(save: str):
        return estimate(TINY_RELU, **FIELDS, recompute="ops", recompute_save=save)

    assert run("mlp").stages[0].activations_bytes - \
        run("").stages[0].activations_bytes == 2 * 2 * 90_112
    text = emit_for("torch", run("mlp"))
    assert "SAVE = {('act', 176, 0), ('matmul', 176, 0)}" in text
    assert "_aten.relu.default" in text
    with pytest.raises(MemplanError, match="mlp.fc1 has no module in torchtitan's Llama "
                                           r"\(its feed_forward is gated"):
        emit_for("torchtitan", run("mlp"))
    assert "--recompute-modules core_attn layernorm" in emit_for("megatron", run("mlp"))
