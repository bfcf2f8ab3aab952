"""FSDP units as buckets (``FsdpUnits.BUCKETS``: Megatron-FSDP's optim_grads_params and
optim_grads), in bytes derived by hand.

The stage: ``tiny`` with 4 layers (model_specs/models/tiny.toml: h=64, f=176, 4 heads and 2
KV heads of 16, V=128, untied), as tests/unit/test_step_states.py counts it:

    embedding 8,192; each layer 46,208; final norm 64 + head 8,192 = 8,256
    N = 8,192 + 4 * 46,208 + 8,256 = 201,280 elements; the other weights (root) 16,448

at dp=3, bf16 weights with fp32 main gradients, fp32 main weights and Adam states
(bf16-fp32-grads). This rank's shards: ceil(201,280 / 3) = 67,094 elements.

Megatron-FSDP's communication unit is 1e9 elements here (twice the mean layer, 92,416, is
below the floor): 5e8 are prefetched, ceil(5e8 / 46,208) = 10,821 layers, so the window is
all 4 blocks; the queue keeps floor(1e9 / 46,208) + 2 = 21,642 buckets, so all 4 blocks'
gradient buckets are alive at the end of backward.
"""

from __future__ import annotations

import memplan
import memplan.api
import memplan.spec
from memplan.model.fsdp_buckets import communication_unit, gathered_units, queued_units
from memplan.model.model_states import sharding_buffers, stage_params, state_bytes
from memplan.model.sharding import Held, data_parallel, end_moments, run_positions

LAYER, ROOT, N = 46_208, 16_448, 201_280


def _stage(zero: int, gpus: int = 3):
    spec = memplan.spec.load_model("tiny").model_copy(update={"num_layers": 4})
    spec, par, wl = memplan.api.resolve(spec, gpus=gpus, zero=zero, framework="megatron",
                                        fsdp_units="buckets", precision="bf16-fp32-grads",
                                        seq_len=64)
    params = stage_params(spec, par, [0, 1, 2, 3], first=True, last=True)
    states = state_bytes(params, par, wl)
    shard = sharding_buffers(params, par, wl)
    return params, states, shard, data_parallel(shard, params.total, states.grads_bytes,
                                                wl.precision.policy)


def test_the_window_and_the_queue_at_two_scales() -> None:
    """The 4-block stage: the communication unit is the 1e9 floor; the window and the
    queue are bounded by its 4 layers. Llama-3-8B's layer on one TP rank: 4,096 * 4,096 * 2
    (q, o) + 4,096 * 1,024 * 2 (k, v) + 3 * 4,096 * 14,336 (MLP) + 2 * 4,096 (norms) =
    218,112,000 elements, 32 of them: the unit stays 1e9 (twice the layer is 436,224,000),
    ceil(5e8 / 218,112,000) = 3 layers follow the running one (4 gathered), and
    floor(1e9 / 218,112,000) + 2 = 6 buckets are alive. A layer of 6e8 elements raises the
    unit to 1.2e9: 1 follows (2 gathered), 1.2e9 // 6e8 + 2 = 4 buckets."""
    assert communication_unit((LAYER,) * 4) == 1_000_000_000
    assert (gathered_units((LAYER,) * 4), queued_units((LAYER,) * 4)) == (4, 4)
    llama = (218_112_000,) * 32
    assert communication_unit(llama) == 1_000_000_000
    assert (gathered_units(llama), queued_units(llama)) == (4, 6)
    big = (600_000_000,) * 8
    assert communication_unit(big) == 1_200_000_000
    assert (gathered_units(big), queued_units(big)) == (2, 4)


def test_optim_grads_params_of_a_four_block_stage_at_dp3() -> None:
    """--zero 3 as buckets. States: weights 67,094 * 2 = 134,188 B, main gradients 67,094 *
    4 = 268,376 B (a buffer from the wrap on), main weights and Adam 67,094 * 12 = 805,128 B
    and fused Adam's fp32 step per tensor (1 + 4 * 9 + 2 = 39 tensors, 156 B): 805,284 B.

    Gathered in bf16: the root and the window of 4 blocks, (16,448 + 4 * 46,208) * 2 =
    402,560 B beside a block in forward and in backward; at the loss, the head's backward
    and the embedding's, the root alone: 32,896 B; at the stage's first block's backward
    (the last), the root and that block: (16,448 + 46,208) * 2 = 125,312 B. Gradient
    buckets: the 4 blocks' and the root's, whole, in fp32: (4 * 46,208 + 16,448) * 4 =
    805,120 B. At the end of backward the stage's gradients wait whole (805,120 B, not less
    the rank's shard as ZeRO-2's reduce buffer) beside the root's weights: 838,016 B."""
    params, states, shard, dp = _stage(3)
    assert (params.total, states.params_bytes, states.grads_bytes) == (N, 134_188, 268_376)
    assert states.optimizer_bytes == 805_284
    assert (shard.gathered_bytes, shard.gathered_at_loss_bytes) == (402_560, 32_896)
    assert (dp.in_block_forward, dp.in_block, dp.in_first_block) == (402_560, 402_560,
                                                                      125_312)
    assert (dp.at_head, dp.at_loss, dp.at_embedding) == (32_896, 32_896, 32_896)
    assert (shard.grad_bytes, dp.grad_cap) == (805_120, 805_120)
    assert not dp.per_unit and dp.queued_whole
    assert dp.buffer(states.grads_bytes) == 805_120  # all of it, whole
    assert dp.buffer(10 * states.grads_bytes) == 805_120  # the queue's capacity
    embedding = 10_923  # any split of the stage's held bytes: only their sum counts here
    held = Held(states.grads_bytes - embedding, 0, 0, 4)
    assert end_moments(dp, held, 0, embedding, False) == (838_016, ())


def test_the_stages_first_block_holds_every_bucket_made_before_it() -> None:
    """The run of 4 blocks in backward, the head's 8,256 * 4 / 3 = 11,008 held gradient bytes
    made before it and 61,611 per block (46,208 * 4 / 3, rounded up): the stage's first
    block (last in backward) runs beside the root and itself gathered (125,312 B) and every
    bucket made so far, whole: 11,008 + 4 * 61,611 = 257,452 held bytes, unsharded (times
    805,120 / 268,376, the stage's fp32 gradients per held byte; truncated) 772,348 B:
    897,660 B. The run's first block: 402,560 B gathered beside the head's and its own
    gradients, 11,008 + 61,611 = 72,619 held bytes, 217,854 B unsharded: 620,414 B. The
    blocks between them are bounded by the first (fewer saved activations, the window
    at most)."""
    _, _, _, dp = _stage(3)
    positions, after = run_positions(dp, Held(11_008, 0, 0, 0), 61_611, 61_611, 4, False,
                                     True)
    assert [p.repeat for p in positions] == [1, 2, 1]
    assert positions[0].beside == 620_414
    assert positions[-1].beside == 897_660
    assert after.made == 257_452


def test_optim_grads_keeps_whole_weights_and_the_queue() -> None:
    """--zero 2 as buckets (optim_grads): the weights whole in their buffer (201,280 * 2 =
    402,560 B), nothing gathered; the gradient shard 268,376 B and the same 805,120 B of
    whole fp32 buckets."""
    params, states, shard, dp = _stage(2)
    assert states.params_bytes == 402_560 and states.grads_bytes == 268_376
    assert (shard.gathered_bytes, shard.grad_bytes) == (0, 805_120)
    assert dp.in_block == 0 and dp.buffer(states.grads_bytes) == 805_120


def test_one_rank_has_no_temporary_bucket() -> None:
    """At dp=1 Megatron-FSDP's buffers are not distributed (``is_data_distributed`` needs a
    group of 2): the weights and gradients are the buffers themselves, nothing temporary."""
    _, states, shard, dp = _stage(3, gpus=1)
    assert states.params_bytes == N * 2
    assert (shard.gathered_bytes, shard.grad_bytes, dp.in_block) == (0, 0, 0)


def test_the_forward_window_shrinks_over_the_stages_last_blocks() -> None:
    """In forward the i-th of the 4 blocks holds min(4, 4 - i) units beside the root:
    402,560 B at the first block, then 3, 2 and 1 units: the second block (16,448 + 3 *
    46,208) * 2 = 310,144 B and the last (16,448 + 46,208) * 2 = 125,312 B; the third (2
    units) is given one unit, its bytes between its neighbours' (a run's moments change
    by the same amount per block). A stage's earlier run keeps the whole window."""
    from memplan.model.sharding import forward_positions
    _, _, _, dp = _stage(3)
    last = forward_positions(dp, 4, True, True)
    assert [(p.repeat, p.beside) for p in last] == [(1, 402_560), (1, 310_144), (1, 125_312),
                                                    (1, 125_312)]
    assert [(p.repeat, p.beside) for p in forward_positions(dp, 4, True, False)] == [
        (4, 402_560)]


def test_the_weights_outside_the_units_stay_gathered_at_the_optimizer_step() -> None:
    """Megatron-FSDP keeps the buckets outside the units (embedding, final norm, head)
    gathered across steps (AllGatherPipeline.reset(preserve_non_fsdp_units=True)): at the
    optimizer step, beside the states (weights 134,188 B, main gradients 268,376 B, main
    weights and Adam 805,284 B), the root's bf16 weights 32,896 B; fused Adam's step
    temporaries are none (memplan.model.optimizer): 1,240,744 B."""
    spec = memplan.spec.load_model("tiny").model_copy(update={"num_layers": 4})
    est = memplan.estimate(spec, gpus=3, zero=3, framework="megatron", fsdp_units="buckets",
                           precision="bf16-fp32-grads", seq_len=64)
    stage = est.stages[0]
    assert stage.optimizer_temp_bytes == 0
    assert stage.steady.optimizer == 134_188 + 268_376 + 805_284 + 32_896
