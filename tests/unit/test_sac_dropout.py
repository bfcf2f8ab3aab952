"""Op-level checkpointing with dropout on each mixer's output (``ModelSpec.dropout``), derived
by hand.

tiny-drop: tiny (h 64, 4 heads / 2 KV heads of d 16, SwiGLU f 176, 2 layers, no biases) with
dropout 0.1. At seq 128 and micro-batch 2 in bf16 a layer's tokens are T = 256. The MLP's
dropout saves a mask of its output, which the rerun rebuilds (from the forward's RNG state,
restored by torch/utils/checkpoint.py under ``preserve_rng_state``) by running the down
projection again: an item, ``mlp.down``, T x h x 2 = 32,768 B, 2 x 176 x 64 = 22,528 FLOPs a
token, the third 64-wide matmul of the layer (after q and the output projection; k and v are
32 wide).
"""

from __future__ import annotations

from memplan.api import estimate, make_layout, make_workload
from memplan.model.dims import Dims
from memplan.model.layer import ops_items
from memplan.model.sac_ops import ops_refusal, rerun_flops_per_token, resolve
from memplan.spec import ModelSpec, load_model

TINY_DROP = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-drop",
                                      "dropout": 0.1})
FIELDS = dict(seq_len=128, micro_batch_size=2)


def _items():
    wl = make_workload(TINY_DROP, **FIELDS, recompute="ops")
    assert ops_refusal(TINY_DROP, wl) is None
    return ops_items(TINY_DROP, wl, Dims.of(TINY_DROP, make_layout(1), wl))


def test_down_projection_is_an_item_with_dropout() -> None:
    down = [i for i in _items() if i.name == "mlp.down"]
    assert [(i.size_bytes, i.flops_per_token, i.op, i.width, i.nth) for i in down] == [
        (32_768, 22_528.0, "matmul", 64, 2)]
    # not kept, the rerun runs it: its FLOPs among the rerun's
    items = _items()
    assert rerun_flops_per_token(items, ()) - rerun_flops_per_token(
        items, resolve(items, ("mlp.down",), TINY_DROP)) == 22_528.0


def test_kept_down_output_adds_its_bytes() -> None:
    """Kept in both layers: 2 x 32,768 B of saved activations beyond full recompute; the
    assumptions say the down projection reruns otherwise."""
    def run(save: str):
        return estimate(TINY_DROP, **FIELDS, recompute="ops", recompute_save=save)

    assert run("mlp.down").stages[0].activations_bytes - \
        run("").stages[0].activations_bytes == 2 * 32_768
    assert any("down projection reruns: its dropout's mask is rebuilt" in a
               for a in run("").assumptions)
