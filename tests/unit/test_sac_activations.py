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


# tiny-gelu-new: tiny with an ungated MLP of f 176 running transformers' gelu_new formula
# (``ActivationImpl.GELU_NEW``), with biases as GPT-2's Conv1D has them
TINY_GELU_NEW = ModelSpec.model_validate({**load_model("tiny").model_dump(),
                                          "name": "tiny-gelu-new", "mlp": "gelu",
                                          "activation_impl": "gelu_new"})


def test_gelu_new_items_by_hand() -> None:
    """bf16, T = 256, f = 176: T x f = 45,056 elements. In execution order (0.5 * input first,
    then pow, 0.044715 * pow, sqrt(2/pi) * (...), tanh, 1.0 + tanh, the product): mlp.fc1
    (90,112 B, 22,528 FLOPs a token), mlp.gelu_half_x (the first of three number-scaled
    tensors 176 wide, 90,112 B), mlp.gelu_tanh (tanh, 90,112 B), mlp.gelu_one_plus_tanh (a
    number added, 90,112 B) and mlp.act (the first 176-wide tensor product, 90,112 B), one
    FLOP an element each (176 a token). Under autocast (amp-bf16) tanh, its sum and the
    product are fp32 (180,224 B each; the product's saved term is the down projection's bf16
    cast, which it does not name), 0.5 * input stays bf16, and the first projection's output
    names no saved term (pow saves an fp32 cast of it)."""
    mlp = [(i.name, i.terms, i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
           for i in _items(TINY_GELU_NEW) if i.block == "mlp"]
    assert mlp == [
        ("mlp.fc1", ("mlp.fc1",), 90_112, 22_528.0, "matmul", 176, 0),
        ("mlp.gelu_half_x", ("mlp.gelu_half_x",), 90_112, 176.0, "scale", 176, 0),
        ("mlp.gelu_tanh", ("mlp.gelu_tanh",), 90_112, 176.0, "tanh", 176, 0),
        ("mlp.gelu_one_plus_tanh", ("mlp.gelu_one_plus_tanh",), 90_112, 176.0, "shift", 176,
         0),
        ("mlp.act", ("mlp.act",), 90_112, 176.0, "mul", 176, 0)]
    amp = {i.name: (i.terms, i.size_bytes) for i in _items(TINY_GELU_NEW, precision="amp-bf16")
           if i.block == "mlp"}
    assert amp == {"mlp.fc1": ((), 90_112),
                   "mlp.gelu_half_x": (("mlp.gelu_half_x",), 90_112),
                   "mlp.gelu_tanh": (("mlp.gelu_tanh",), 180_224),
                   "mlp.gelu_one_plus_tanh": (("mlp.gelu_one_plus_tanh",), 180_224),
                   "mlp.act": ((), 180_224)}


def test_gelu_new_policy_counts_the_scalings() -> None:
    """The torch policy counts three "scale" ops 176 wide a layer (0.5 * input and the two
    inside tanh's argument) and keeps the first; tanh and the sum by their own families."""
    est = estimate(TINY_GELU_NEW, **FIELDS, recompute="ops",
                   recompute_save="mlp.gelu_half_x,mlp.gelu_tanh,mlp.gelu_one_plus_tanh")
    text = emit_for("torch", est)
    assert "SAVE = {('scale', 176, 0), ('shift', 176, 0), ('tanh', 176, 0)}" in text
    assert "('scale', 176): 3" in text
