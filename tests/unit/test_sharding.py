"""The data-parallel mechanism's moments in a stage's backward (``memplan.model.sharding``), on a
hand-made stage of four identical blocks; every byte derived by hand in the docstrings.

The stage: each block saves 100 B and peaks, in its own backward, at 100 B of what it saved
plus 10 B in flight (110 B), none of its gradients made by then; a block's gradients are 50 B
as held (this rank's shard). The last stage's head holds no activations here and makes 20 B of
gradients, the embedding 30 B: 20 + 4 * 50 + 30 = 250 B of gradients at the end. Nothing else
is alive: the backward starts from the four blocks' 400 B of saved bytes.
"""

from __future__ import annotations

from memplan.api import resolve
from memplan.model.embedding import EmbeddingBlock
from memplan.model.head import HeadBlock
from memplan.model.layer import LayerKind, LayerMoment
from memplan.model.model_states import sharding_buffers, stage_params
from memplan.model.moments import timeline
from memplan.model.sharding import DataParallel, data_parallel, with_stream
from memplan.model.walk import Walk, backward_peak, backward_segments, forward_peak
from memplan.model.walk import forward_segments

KIND = LayerKind(terms=(), saved_bytes=100, forward_peak_bytes=120,
                 moments=(LayerMoment("m", 100, 10, ()),))
HEAD = HeadBlock(grads=20)
EMBEDDING = EmbeddingBlock(grads=30)

# FSDP2 at shard degree 2 (unsharded = 2 x held), weights and reduce in the same dtype, units
# of at most 1,000 B: 300 B gathered at the head (root and one block), 400 B while a block's
# backward runs (root, the block, the block it prefetches), 300 B at the stage's first block
# (nothing left to prefetch), 200 B at the embedding (the root alone); the gradient of a unit's
# input is 5 B.
FSDP2 = DataParallel(grad_cap=1_000, unsharded_ratio=2, per_unit=True, at_head=300,
                     in_block=400, in_first_block=300, at_embedding=200, boundary_grad=5)


def _walk(dp: DataParallel) -> Walk:
    return Walk(runs=[(KIND, 50, (0,), 4)], other_bytes=0, rest_saved=0, head=HEAD,
                embedding=EMBEDDING, sharding=dp)


def _instants(dp: DataParallel) -> list[tuple[str, int]]:
    """Every instant of the backward from nothing alive; its largest is ``backward_peak``."""
    instants = [(name, at) for name, _, at in timeline(backward_segments(_walk(dp), 0, 250))]
    assert max(at for _, at in instants) == backward_peak(_walk(dp), 0, 250)
    return instants


def test_fsdp2_moments_of_a_four_block_stage() -> None:
    """FSDP2, one micro-batch (gradients new). The root's 20 B of head gradients are held
    unsharded (40 B): 20 B beyond their shard, ``root_held``, from the head on. A block's
    unit: reduce-scatter input 2 * 50 = 100 B, its unsharded gradients 100 B.

    - loss, head, head's gradient: 400 alive + 300 gathered = 700; then 420 alive.
    - block 1 (first in backward), copy-out: 420 + 20 root + 0 previous input (the root's is
      not reduce-scattered yet) + 300 gathered + 100 unsharded = 840; its backward, 100 B saved
      freed: 320 + 110 + 20 + 0 + 400 = 850; reduce-scatter: 320 + 20 + 100 gradients + 100
      input + 5 + 300 gathered = 845; then 50 B of gradients: 370.
    - block 2 holds block 1's input (100): copy-out 370 + 20 + 100 + 300 + 100 = 890; backward
      270 + 110 + 20 + 100 + 400 = 900 (the peak); its reduce-scatter is not measured (a
      run's are at its ends); 320 after.
    - block 3: copy-out 320 + 520 = 840; backward 220 + 630 = 850; 270 after.
    - block 4 (the stage's first): copy-out 270 + 520 = 790; backward 170 + 110 + 20 + 100 +
      300 = 700; reduce-scatter beside the embedding's gathered weights: 170 + 20 + 100 + 100
      + 5 + 200 = 595; 220 after.
    - embedding: all 250 B of gradients; the head's 20 B made before it unsharded (40 B, 20
      beyond the shard; the embedding's own unsharded gradient is the dense one its backward
      makes, ``EmbeddingBlock.extra``, 0 here), block 4's input (100), the root gathered
      (200): 250 + 320 = 570; the root's
      reduce-scatter: its 100 B unsharded gradients beside their 100 B input, the 50 B shard
      not made yet: 250 - 50 + 200 = 400; then the output beside the input: 250 + 100 = 350.
    """
    assert _instants(FSDP2) == [
        ("loss.backward", 700), ("head.backward", 700), ("head.main_grads", 700),
        ("unit.copy_out", 840), ("layer.backward", 850), ("unit.reduce_scatter", 845),
        ("unit.copy_out", 890), ("layer.backward", 900),
        ("unit.copy_out", 840), ("layer.backward", 850),
        ("unit.copy_out", 790), ("layer.backward", 700), ("unit.reduce_scatter", 595),
        ("embedding.backward", 570), ("root.reduce_scatter_input", 400),
        ("root.reduce_scatter_output", 350)]
    assert backward_peak(_walk(FSDP2), 0, 250) == 900


def test_fsdp2_accumulating_micro_batch() -> None:
    """A later micro-batch: all 250 B of gradients exist from the start (650 alive) and none
    are added; FSDP2 still makes each unit's gradients unsharded before its reduce-scatter,
    but the copy-out and reduce-scatter moments are those of the first micro-batch only.
    Block 2's backward: 650 - 200 (two blocks' saved freed) + 110 + 20 + 100 + 400 = 1,080."""
    assert backward_peak(_walk(FSDP2), 250, 250) == 1_080


def test_torchtitan_units_at_shard_degree_1() -> None:
    """torchtitan's units at shard degree 1 (unsharded = held): the head is its own unit,
    reduced after its backward with 3 copies of its 20 B and the 5 B input gradient beside
    the 420 B alive, its own 20 B replaced: 420 + 60 + 5 - 20 = 465. Nothing gathered (one
    rank gathers nothing beyond its weights). Block 1 holds the head's reduce input (20 B):
    320 + 110 + 20 = 450, then its reduce: 320 + 3 * 50 + 5 = 475; block 2 holds block 1's
    50 B input: 270 + 110 + 50 = 430; block 4's reduce: 170 + 155 = 325. At the embedding:
    250 alive, block 4's input (50 B) beside: 300; its own reduce: 250 - 30 + 90 + 5 - 5 =
    310. Peak 475."""
    dp = DataParallel(grad_cap=1_000, per_unit=True, separate_units=True, reduce_copies=3,
                      boundary_grad=5)
    assert _instants(dp) == [
        ("loss.backward", 400), ("head.backward", 400), ("head.main_grads", 400),
        ("head.reduce", 465),
        ("layer.backward", 450), ("unit.reduce", 475),
        ("layer.backward", 430), ("layer.backward", 380),
        ("layer.backward", 330), ("unit.reduce", 325),
        ("embedding.backward", 300), ("embedding.reduce", 310)]


def test_kept_gathered_under_pipeline_parallelism() -> None:
    """FSDP2 under PP as torchtitan runs it: every unit gathered throughout (250 B beside every
    moment), gradients held as plain accumulators: block 1's backward 320 + 110 + 250 = 680
    is the peak (the loss's 400 + 250 = 650 below it)."""
    dp = DataParallel(at_head=250, in_block=250, in_first_block=250, at_embedding=250)
    assert backward_peak(_walk(dp), 0, 250) == 680


def test_kept_gathered_reduce_at_the_step_end() -> None:
    """Kept gathered under PP, the step's reduce after the last micro-batch's backward is an
    instant of the sequence (``step_end_moments``). The stage: 250 B gathered throughout, 70 B
    of other micro-batches in flight, 40 B of inputs of which the embedding's backward frees
    15 B; the reduce holds a unit's reduce-scatter input and output shard, 300 B.

    From 70 + 40 + 400 saved = 510 B: the loss and the head at 510 + 250 = 760, the head's
    20 B of gradients made (530 alive); block 4 (first walked) at 530 + 10 + 250 = 790, each
    block then 50 B less alive (330 after block 1); the embedding frees 15 B and its 30 B of
    gradients join (345 alive), its backward at 345 + 250 = 595. At the step's end the other
    micro-batches' 70 B are done (275 alive) and the reduce holds 300 B beside the 250 B
    gathered and the 15 B of inputs counted again: 275 + 300 + 250 + 15 = 840 (= 40 inputs +
    250 gradients + 300 + 250 gathered), the peak."""
    dp = DataParallel(at_head=250, in_block=250, in_first_block=250, at_embedding=250,
                      step_reduce=300)
    walk = _walk(dp)._replace(other_bytes=70, rest_saved=40,
                              embedding=EmbeddingBlock(grads=30, freed_before=15))
    instants = [(name, at) for name, _, at in timeline(backward_segments(walk, 0, 250))]
    assert instants[-3:] == [("layer.backward", 640), ("embedding.backward", 595),
                             ("step.reduce_scatter", 840)]
    assert backward_peak(walk, 0, 250) == 840
    # without the reduce (another mechanism), the peak is block 4's
    assert backward_peak(walk._replace(sharding=dp._replace(step_reduce=0)), 0, 250) == 790


def test_zero2_bucket_between_the_ends_of_a_run() -> None:
    """ZeRO-2 at shard degree 2 with a 300 B bucket: beside a block, the gradients made so far
    wait unsharded (twice their held bytes, at most 300), beyond the shard they become.
    Block 1: 20 B made, 40 unsharded, 20 beyond: 320 + 110 + 20 = 450. Block 4: 20 + 150 = 170
    made, 300 unsharded (the cap), 150 beyond: 170 + 110 + 150 = 430. Blocks 2 and 3 are
    measured with block 1's 20 B (the buffer only grows; the run's ends bound them): 270 + 130
    = 400 and 220 + 130 = 350. At the embedding: 250 B made, the cap: 250 + 150 = 400."""
    dp = DataParallel(grad_cap=300, unsharded_ratio=2)
    assert [at for name, at in _instants(dp) if name != "head.main_grads"][2:] == [
        450, 400, 350, 430, 400]
    assert backward_peak(_walk(dp), 0, 250) == 450


def test_fsdp2_gathers_in_forward() -> None:
    """FSDP2 in forward: 400 B gathered while a block computes (it and the one it prefetches
    with the root); at a block's start its all-gather output beside the previous one's and
    its parameters, 600 B, with the 100 B residual stream it is about to read: 700 B; the
    stage's first block gathers beside the root's output instead, 700 + 100 = 800 B. Each
    block keeps 100 B and peaks at 120 B in its compute.

    - block 1: gather 0 + 800 = 800; compute 0 + 120 + 400 = 520; 100 kept.
    - blocks 2-4: gathers at 100 + 700 = 800, 900, 1,000 (the peak: three blocks' saved
      bytes and the gather); computes 620, 720, 820.
    """
    dp = with_stream(DataParallel(per_unit=True, in_block_forward=400, block_start=600,
                                  first_block_start=700), 100)
    assert (dp.block_start, dp.first_block_start, dp.boundary_grad) == (700, 800, 100)
    runs = [(KIND, 50, (0,), 4)]
    assert [at for _, _, at in timeline(forward_segments(runs, dp, 0, 0))] == [
        0, 800, 520, 800, 620, 900, 720, 1_000, 820]
    assert forward_peak(runs, 0, HeadBlock(), dp) == 1_000


def test_torchtitan_head_unit_prefetches_after_the_loss() -> None:
    """torchtitan's units at shard degree 2: 300 B gathered at the head (its own unit's 200 B
    and the 100 B of the last block, which its pre_backward prefetches). That hook sits on the
    head's output, the logits, so it fires once the loss's backward has made their gradient:
    the loss's backward runs beside the head's 200 B alone. A loss of 250 B in flight: 400
    alive + 250 + 200 = 850 at the loss's backward (not 950); the head's backward and its
    gradient beside all 300 B: 400 + 300 = 700."""
    dp = DataParallel(grad_cap=1_000, unsharded_ratio=2, per_unit=True, separate_units=True,
                      at_head=300, head_prefetch=100, in_block=200, in_first_block=200,
                      at_embedding=100)
    walk = _walk(dp)._replace(head=HeadBlock(grads=20, loss=250))
    instants = [(n, at) for n, _, at in timeline(backward_segments(walk, 0, 250))][:3]
    assert instants == [("loss.backward", 850), ("head.backward", 700),
                        ("head.main_grads", 700)]


def test_torchtitan_units_gather_the_head_alone_at_the_loss_of_llama_3_8b() -> None:
    """Llama-3-8B (dim 4096, 8 query and 8 x 128 = 1,024-wide KV projections, ffn 14,336,
    vocabulary 128,256, untied) under torchtitan's FSDP2 on 8 ranks, bf16 gathered weights.
    A block: 2 x 4096^2 (q, o) + 2 x 4096 x 1024 (k, v) + 3 x 4096 x 14336 (ffn) + 2 x 4096
    (norms) = 218,112,000 elements; the [final norm, output] unit: 4096 + 128256 x 4096 =
    525,340,672. At the head's backward both are gathered, (525,340,672 + 218,112,000) x 2 =
    1,486,905,344 B; at the loss's backward the block's 436,224,000 B are not yet."""
    spec, par, wl = resolve("llama-3-8b", gpus=8, zero=3, framework="torchtitan")
    layers = list(range(spec.num_layers))
    shard = sharding_buffers(stage_params(spec, par, layers, first=True, last=True), par, wl)
    assert shard.backward_head_bytes == 1_486_905_344
    assert shard.backward_head_prefetch_bytes == 436_224_000
    dp = data_parallel(shard, 1, 1, wl.precision.policy)
    assert dp.at_loss == 1_050_681_344  # 525,340,672 x 2


def test_root_resharded_units_leave_the_loss_beside_the_last_block_of_llama_3_8b() -> None:
    """torchtitan before 0.3 (``fully_shard`` on each block, the last not resharded after
    forward, then on the model, resharded after forward): Llama-3-8B on 8 ranks, bf16 gathered
    weights. The root: 128,256 x 4096 x 2 (embedding, output) + 4096 (final norm) =
    1,050,677,248 elements, 2,101,354,496 B; a block 218,112,000 elements, 436,224,000 B. At
    the loss's forward and backward only the last block is gathered (436,224,000 B); the root is
    gathered again for the head's backward beside it, 2,537,578,496 B, as memplan's root units
    hold them at the loss too; in forward the root and two blocks, 2,973,802,496 B; under
    pipeline parallelism every unit kept gathered, as torchtitan's units are."""
    spec, par, wl = resolve("llama-3-8b", gpus=8, zero=3, framework="torchtitan",
                            fsdp_units="root-resharded")
    layers = list(range(spec.num_layers))
    params = stage_params(spec, par, layers, first=True, last=True)
    shard = sharding_buffers(params, par, wl)
    assert shard.gathered_at_loss_bytes == 436_224_000
    assert shard.backward_head_bytes == 2_537_578_496
    assert shard.backward_head_prefetch_bytes == 2_101_354_496
    assert shard.gathered_bytes == 2_973_802_496
    dp = data_parallel(shard, 1, 1, wl.precision.policy)
    assert dp.at_loss == dp.at_loss_forward == 436_224_000
    _, _, root_wl = resolve("llama-3-8b", gpus=8, zero=3, framework="torchtitan",
                            fsdp_units="root")
    root = sharding_buffers(params, par, root_wl)
    assert root.gathered_at_loss_bytes == root.backward_head_bytes == 2_537_578_496
    assert root.backward_head_prefetch_bytes == 0
    spec, pp, wl = resolve("llama-3-8b", gpus=16, pp=2, zero=3, framework="torchtitan",
                           fsdp_units="root-resharded")
    kept = sharding_buffers(stage_params(spec, pp, list(range(16)), first=True, last=False),
                            pp, wl)
    assert kept.kept_gathered


def test_shard_of_unsharded_gradients() -> None:
    """At shard degree 2 (``FSDP2``) a rank holds half of the unsharded bytes, whole bytes
    rounded down: 1,000 -> 500, 1,001 -> 500. ZeRO-2's reduce bucket of 1,000 B at degree 4
    (unsharded = 4 x held): 200 B of gradients made are 800 B unsharded, 800 - 800 / 4 = 600 B
    beyond the shard they become."""
    assert (FSDP2.shard_of(1_000), FSDP2.shard_of(1_001)) == (500, 500)
    bucket = DataParallel(grad_cap=1_000, unsharded_ratio=4)
    assert bucket.shard_of(800) == 200
    assert bucket.buffer(200) == 600


def test_fsdp2_root_keeps_its_last_gradient_to_the_reduce_scatter_output() -> None:
    """As ``test_fsdp2_moments_of_a_four_block_stage``, the root's last parameter's gradient
    (8 B held: 16 B unsharded) kept by torch 2.13's foreach_reduce until it returns
    (``root_last_grad``): the root's reduce-scatter output 350 + 16 = 366; every other instant
    as there."""
    got = _instants(FSDP2._replace(root_last=8))
    assert got[-1] == ("root.reduce_scatter_output", 366)
    assert got[:-1] == _instants(FSDP2)[:-1]


def test_root_last_gradient_is_the_head_weight_or_the_embedding() -> None:
    """The root's last tensor in registration order: on the last stage the head's (elements
    [embedding 40, layers 10 and 10, final norm 4, head 40]: 40), on a first stage without
    the head the embedding's last (there 40 of [40, 10]); held at 1.5 B per parameter: 60 B.
    Nothing for other mechanisms (FSDP2 at shard degree 1: units reduced on their own)."""
    from fractions import Fraction

    from memplan.model.sharding import root_last_grad

    per = Fraction(3, 2)
    assert root_last_grad(FSDP2, (40, 10, 10, 4, 40), 1, 2, per).root_last == 60
    assert root_last_grad(FSDP2, (40, 10), 1, 0, per).root_last == 60
    assert root_last_grad(FSDP2, (10, 10), 0, 0, per).root_last == 0
    single = DataParallel(per_unit=True, separate_units=True, reduce_copies=3)
    assert root_last_grad(single, (40, 10, 4, 40), 1, 2, per).root_last == 0


def test_accumulated_weight_gradient_in_flight_beside_the_accumulators() -> None:
    """A later micro-batch's backward (gradients already made: they accumulate in place): at
    the moment that makes a weight's gradient, that new gradient is alive beside the
    accumulated ones until AccumulateGrad adds it in (``accumulated_fresh``). A block with
    two moments: "w" made the gradient of a 6-element weight (100 B alive, 10 B in flight),
    "x" made none (100 + 40 = 140). At 2 B per element the new gradient is 12 B: "w" 100 +
    10 + 12 = 122, below "x"; at 8 B, 48 B: 158, the block's peak. A first micro-batch's
    gradients are the walk's own (50 B held by each moment): max(160, 190) = 190 either way.
    Mechanisms that count their own are left as they are: FSDP2's units, gradients copied
    away at their hooks."""
    from memplan.model.sharding import accumulated_fresh

    kind = LayerKind(terms=(), saved_bytes=100, forward_peak_bytes=120,
                     moments=(LayerMoment("w", 100, 10, (), fresh_params=6),
                              LayerMoment("x", 100, 40, ())))
    ddp = accumulated_fresh(DataParallel(), 2)
    assert ddp.fresh_grad == 2
    assert ddp.block_peak(kind.moments, (50, 50), False) == 140
    assert accumulated_fresh(DataParallel(), 8).block_peak(kind.moments, (50, 50), False) == 158
    # new gradients (the first micro-batch) are the walk's own, held: unchanged
    assert ddp.block_peak(kind.moments, (50, 50), True) == 190
    assert accumulated_fresh(FSDP2, 2) is FSDP2
    assert accumulated_fresh(DataParallel(fresh_only=True), 2).fresh_grad == 0


def test_a_stages_only_block_keeps_its_all_gather_output_in_forward() -> None:
    """FSDP2 (memplan's root unit) on 8 ranks, fsdp-bf16 (bf16 gathered weights), a stage of
    llama-3-8b's first layer alone (pp 32): the block 218,112,000 elements (as above),
    436,224,000 B gathered; its flat all-gather output, the same size, stays in
    comm_ctx.all_gather_state until the root's _post_forward, so its forward holds the root
    and twice the block, as a stage of several blocks does: the root's embedding 128,256 x
    4096 x 2 = 1,050,673,152 B, with 2 x 436,224,000: 1,923,121,152 B. In backward it is
    gathered alone beside the root: 1,486,897,152 B."""
    spec, par, wl = resolve("llama-3-8b", gpus=256, pp=32, zero=3, precision="fsdp-bf16")
    params = stage_params(spec, par, [0], first=True, last=False)
    shard = sharding_buffers(params, par, wl)
    assert shard.gathered_bytes == 1_050_673_152 + 2 * 436_224_000
    assert shard.backward_last_block_bytes == 1_050_673_152 + 436_224_000


def test_accumulated_embedding_gradient_in_flight_at_its_backward() -> None:
    """The stage above, replicated gradients (DDP), the embedding's dense gradient 12 B as
    made (``EmbeddingBlock.fresh``): in a later micro-batch (all 250 B of gradients from the
    start) it is made beside the accumulated one, so the embedding's instant holds the 250 B
    of gradients, nothing saved, and it: 262. In the first micro-batch it is the gradient
    itself (counted in the 250): 250. With FSDP2's units (no ``fresh_grad``): 250 + the
    mechanism's own, unchanged by it."""
    from memplan.model.sharding import accumulated_fresh

    def embedding_at(dp: DataParallel, prior: int) -> int:
        walk = _walk(dp)._replace(embedding=EMBEDDING._replace(fresh=12))
        return dict((name, at) for name, _, at in timeline(backward_segments(walk, prior, 250))
                    )["embedding.backward"]

    ddp = accumulated_fresh(DataParallel(), 2)
    assert embedding_at(ddp, 250) == 262
    assert embedding_at(ddp, 0) == 250
    assert embedding_at(DataParallel(), 250) == 250
    assert embedding_at(FSDP2, 250) == dict(
        (name, at) for name, _, at in timeline(backward_segments(_walk(FSDP2), 250, 250))
    )["embedding.backward"]
