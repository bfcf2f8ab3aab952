"""The walks' data-parallel moments on hand-made layers: ZeRO-2's bucket and FSDP2's units.

These build a stage through ``memplan.model.walk.Walk`` with the data-parallel mechanism as a
``memplan.model.sharding.DataParallel`` and fold it with ``backward_peak`` / ``forward_peak``.
Every docstring lists each moment of the stage with its bytes, derived by hand; the expected
peak is the largest of them (the fold may measure fewer instants than are listed, e.g. a run's
reduce-scatters only at its ends, but never a larger one).

Common layer (``_kind``): saves ``S`` B in forward, peaks at ``F`` B inside its forward, and in
backward has one or two moments (``LayerMoment``: saved bytes still alive ``A``, gradients in
flight ``T``; parameter-gradient bytes made so far ``g``); its parameters' gradients are ``L`` B
as held (sharded) by the rank. ``r`` = unsharded / held gradient bytes (the shard degree,
``unsharded_ratio``), ``u`` = bytes of an unsharded gradient (the weights' dtype) per byte of
its reduce dtype (``unsharded_dtype``). Neither head nor embedding (a middle pipeline stage:
``HeadBlock()`` and ``EmbeddingBlock()`` all 0), nothing else alive.

The mechanism's fields, by what they hold (bytes on one rank):
``grad_cap`` the most unsharded gradient bytes awaiting a reduce-scatter (ZeRO-2's bucket cap,
FSDP2's unit); ``per_unit`` FSDP2's units; gathered weights ``at_head`` (at the loss and the
head), ``in_block`` (while a block's backward runs), ``in_first_block`` (while the stage's first
block, the last in backward, runs), ``at_embedding`` (at the end of backward);
``boundary_grad`` the gradient of a unit's input beside its reduce-scatter; in forward
``in_block_forward`` (while a block computes), ``at_loss_forward``, ``block_start`` and
``first_block_start`` (at a block's gather before it computes, the residual stream it reads
included: set directly here, not through ``with_stream``).
"""

from __future__ import annotations

from fractions import Fraction

from memplan.model.embedding import EmbeddingBlock
from memplan.model.head import HeadBlock
from memplan.model.layer import LayerKind, LayerMoment
from memplan.model.moments import timeline
from memplan.model.sharding import DataParallel
from memplan.model.walk import Walk, backward_peak, backward_segments, forward_peak

NO_HEAD = HeadBlock()
NO_EMBEDDING = EmbeddingBlock()


def _kind(saved: int, moments: tuple[tuple[int, int], ...], forward_peak_bytes: int = 0):
    return LayerKind(terms=(), saved_bytes=saved, forward_peak_bytes=forward_peak_bytes,
                     moments=tuple(LayerMoment(f"m{i}", a, t, ())
                                   for i, (a, t) in enumerate(moments)))


def _walk(kind: LayerKind, layer_grads: int, moment_grads: tuple[int, ...], n: int,
          dp: DataParallel, embedding: EmbeddingBlock = NO_EMBEDDING) -> Walk:
    return Walk(runs=[(kind, layer_grads, moment_grads, n)], other_bytes=0, rest_saved=0,
                head=NO_HEAD, embedding=embedding, sharding=dp)


def _instants(walk: Walk, grads_total: int) -> list[tuple[str, int]]:
    """Every instant of a first micro-batch's backward, in order, with its bytes (alive +
    transient); their largest is ``backward_peak``."""
    instants = [(name, at) for name, _, at in
                timeline(backward_segments(walk, 0, grads_total))]
    assert max(at for _, at in instants) == backward_peak(walk, 0, grads_total)
    return instants


# --- ZeRO-2: one bucket of unsharded gradients, capped --------------------------------------

def test_zero2_bucket_cap_inside_a_run() -> None:
    """n=3 layers, S=100, one moment A=100, T=1,000, L=300; r=2, bucket cap 500 B.

    The bucket's extra is (waiting - waiting / r) with waiting = min(cap, made * r).
      start of backward            3 * 100                                        =   300
      layer 3 (first walked)       200 saved + 1,100, nothing made yet            = 1,300
      layer 1 (last walked)        0 saved + 1,100 + 2 * 300 made, waiting
                                   min(500, 1,200) = 500 -> 500 - 250 = 250 extra = 1,950
      end                          900 made, waiting min(500, 1,800) = 500 -> 250 = 1,150
    Peak 1,950. Without the cap the last layer would hold 1,200 - 600 = 600 extra (2,300)."""
    kind = _kind(100, ((100, 1_000),))
    sharding = DataParallel(grad_cap=500, unsharded_ratio=2)
    assert backward_peak(_walk(kind, 300, (0,), 3, sharding), 0, 900) == 1_950


def test_zero2_bucket_cap_at_the_end() -> None:
    """n=2 layers, S=100, A=100, T=10, L=50, the embedding's 300 B of gradients last; r=2,
    cap 500 B.
      layer 2 (first walked)  100 saved + 110                                    =   210
      layer 1                 0 + 110 + 50 made, waiting min(500, 100) -> 50 extra = 210
      end                     400 made, waiting min(500, 800) = 500 -> 250 extra:
                              400 + 250                                          =   650
    Peak 650 (uncapped: 400 + 400 = 800). The embedding is ``EmbeddingBlock(grads=300)``, no
    extra at its backward and nothing freed before it (a tied head's pending gradient, 0 here,
    is the head's ``tied_grad``)."""
    kind = _kind(100, ((100, 10),))
    sharding = DataParallel(grad_cap=500, unsharded_ratio=2)
    embedding = EmbeddingBlock(grads=300)
    assert backward_peak(_walk(kind, 50, (0,), 2, sharding, embedding), 0, 400) == 650


def test_zero2_bucket_at_an_uneven_shard_degree() -> None:
    """As ``test_zero2_bucket_cap_inside_a_run`` with r=3 (dp=3) and a 1,000,000 B cap:
      layer 1 (last walked)  1,100 + 600 made, waiting 1,800 -> 1,800 - 600 = 1,200 extra
                             = 2,900
      end                    900 made, waiting 2,700 -> 1,800 extra: 2,700
    Peak 2,900."""
    kind = _kind(100, ((100, 1_000),))
    sharding = DataParallel(grad_cap=1_000_000, unsharded_ratio=3)
    assert backward_peak(_walk(kind, 300, (0,), 3, sharding), 0, 900) == 2_900


# --- FSDP2: units of one block, runs of four and more -----------------------------------------

def _fsdp2(**changed: float) -> DataParallel:
    """FSDP2 units of at most 1,000 B at r=2, u=0.5; gathered 500 B in a block's backward,
    400 B at the loss and the head, 200 B at the embedding, 300 B at the stage's first block."""
    return DataParallel(grad_cap=1_000, unsharded_ratio=2, per_unit=True,
                        unsharded_dtype=Fraction(1, 2),
                        in_block=500, at_head=400, at_embedding=200,
                        in_first_block=300)._replace(**changed)


def test_fsdp2_between_the_ends_of_a_run_of_five() -> None:
    """n=5 blocks, S=100, moments (A=100, T=10, g=0) and (A=80, T=10, g=40), L=120; r=2,
    u=0.5; gathered: 500 B while a block's backward runs (the root and two blocks), 300 B at
    the stage's first block (it prefetches none), 400 B at the loss, 200 B at the end.

    A block's local peak: max(100 + 10, 80 + 10 + 40 * 2 * 0.5 unsharded) = 130. A block's
    reduce-scatter input (unsharded, reduce dtype) 120 * 2 = 240; its unsharded gradients in
    the weights' dtype 120 * 2 * 0.5 = 120. With k blocks done (k blocks' saved freed,
    k * 120 held gradients):
      loss                                400 + 5 * 100                          =   900
      block k=0 (first walked)            400 saved + 500 + 130, no input held   = 1,030
      block k (1 <= k <= 3)               1,030 + k * (120 - 100) + 240 input: k=1 1,290,
                                          k=3                                    = 1,330
      block k=4 (the stage's first)       1,030 + 80 + 240 - 500 + 300           = 1,150
      copy-out before block k+1           500 - 100k + 120k + input (0 for k=0, else 240)
                                          + 300 + 120: k=0 920, k=1 1,180, k=4     1,240
      reduce-scatter after block k+1      400 - 100k + 120k + 120 + 240 + 300 (200 after
                                          the stage's first): k=0 1,060, k=4       1,040
      end                                 600 + 240 held input + 200             = 1,040
    Peak 1,330: the second-to-last block in backward, holding the previous block's input and
    prefetching the stage's first block (traced in tests/traced/test_ground_truth.py,
    test_fsdp_backward_between_the_ends_of_a_run).

    In order, as the walk measures them: a run's reduce-scatters at its ends only; the copy-out
    before block k=2, 500 - 200 + 240 + 240 + 300 + 120 = 1,200, and block k=2 itself, 1,030 +
    40 + 240 = 1,310, from the formulas above; the root's reduce-scatter after the end holds
    no root gradients (no head, no embedding): its input, then its output, at the 600 alive."""
    kind = _kind(100, ((100, 10), (80, 10)))
    walk = _walk(kind, 120, (0, 40), 5, _fsdp2())
    assert backward_peak(walk, 0, 600) == 1_330
    assert _instants(walk, 600) == [
        ("loss.backward", 900),
        ("unit.copy_out", 920), ("layer.backward", 1_030), ("unit.reduce_scatter", 1_060),
        ("unit.copy_out", 1_180), ("layer.backward", 1_290),
        ("unit.copy_out", 1_200), ("layer.backward", 1_310),
        ("unit.copy_out", 1_220), ("layer.backward", 1_330),
        ("unit.copy_out", 1_240), ("layer.backward", 1_150), ("unit.reduce_scatter", 1_040),
        ("embedding.backward", 1_040),
        ("root.reduce_scatter_input", 600), ("root.reduce_scatter_output", 600)]


def test_fsdp2_copy_out_before_the_stage_first_block_of_four() -> None:
    """n=4 blocks, S=100, one moment (A=100, T=10, g=0), L=150; r=2, u=1 (the weights' and
    the reduce dtype alike); gathered 400 B in a block, 350 B at the stage's first block, 0
    at the loss, 100 B at the end. Input 150 * 2 = 300; unsharded gradients 300.
      loss                               4 * 100                                 =   400
      block k=0                          300 + 400 + 110                         =   810
      block k=1, k=2                     810 + 50k + 300: 1,160, 1,210
      block k=3 (the stage's first)      810 + 150 + 300 - 400 + 350             = 1,210
      copy-out before block k+1          400 - 100k + 150k + input + 350 + 300:
                                         k=0 1,050, k=1 1,400, k=3               = 1,500
      reduce-scatter after block k+1     400 - 100(k+1) + 150k + 300 + 300 + 350 (100
                                         after the stage's first): k=0 1,250, k=3  1,150
      end                                600 + 300 + 100                         = 1,000
    Peak 1,500: the stage's first block at its copy-out (FSDPParamGroup.wait_for_unshard in
    pre_backward: its all-gather output beside its unsharded weights, its saved tensors all
    alive, the previous block's reduce-scatter input still held).

    In order, as the walk measures them (the copy-out before block k=2 from the formula above,
    400 - 200 + 300 + 300 + 350 + 300 = 1,450; the root's reduce-scatter at the 600 alive, as
    in ``test_fsdp2_between_the_ends_of_a_run_of_five``)."""
    kind = _kind(100, ((100, 10),))
    sharding = _fsdp2(unsharded_dtype=1, in_block=400, at_head=0, at_embedding=100,
                      in_first_block=350)
    walk = _walk(kind, 150, (0,), 4, sharding)
    assert backward_peak(walk, 0, 600) == 1_500
    assert _instants(walk, 600) == [
        ("loss.backward", 400),
        ("unit.copy_out", 1_050), ("layer.backward", 810), ("unit.reduce_scatter", 1_250),
        ("unit.copy_out", 1_400), ("layer.backward", 1_160),
        ("unit.copy_out", 1_450), ("layer.backward", 1_210),
        ("unit.copy_out", 1_500), ("layer.backward", 1_210), ("unit.reduce_scatter", 1_150),
        ("embedding.backward", 1_000),
        ("root.reduce_scatter_input", 600), ("root.reduce_scatter_output", 600)]


def test_fsdp2_reduce_scatter_with_the_input_gradient() -> None:
    """As ``test_fsdp2_copy_out_before_the_stage_first_block_of_four`` with the gradient of
    a block's input (500 B, the residual stream) alive at its reduce-scatter: after the first
    block walked 1,250 + 500 = 1,750, after the stage's first 1,150 + 500 = 1,650; every other
    moment as there (at most 1,500). Peak 1,750."""
    kind = _kind(100, ((100, 10),))
    sharding = _fsdp2(unsharded_dtype=1, in_block=400, at_head=0, at_embedding=100,
                      in_first_block=350, boundary_grad=500)
    assert backward_peak(_walk(kind, 150, (0,), 4, sharding), 0, 600) == 1_750


def test_fsdp2_reduce_scatter_after_the_stage_first_block() -> None:
    """As ``test_fsdp2_reduce_scatter_with_the_input_gradient`` with 300 B gathered at the end
    (the embedding's backward): after the stage's first block its reduce-scatter holds
    0 saved + 3 * 150 + 300 + 300 + 500 + 300 = 1,850 (only the root is gathered there, not
    the 350 B of a block's backward); after the first block walked 1,750; the end
    600 + 300 + 300 = 1,200; the others at most 1,500. Peak 1,850."""
    kind = _kind(100, ((100, 10),))
    sharding = _fsdp2(unsharded_dtype=1, in_block=400, at_head=0, at_embedding=300,
                      in_first_block=350, boundary_grad=500)
    assert backward_peak(_walk(kind, 150, (0,), 4, sharding), 0, 600) == 1_850


def test_fsdp2_forward_gathers_at_a_block_start() -> None:
    """Forward of n=4 blocks (S=100, F=120) with 5 B alive before: 300 B gathered while a
    block runs, 450 B at a block's start (its all-gather output and parameters beside the
    previous unit's output), 200 B at the stage's first block's start.
      block k (k blocks before it saved)   5 + 100k + 120 + 300: at k=3        =   725
      start of block k (k >= 1)            5 + 100k + 450: at k=3              =   755
      start of the stage's first block     5 + 200                             =   205
    Peak 755 (725 without the start moment).

    The gathered bytes map onto the mechanism's forward fields: 300 ``in_block_forward``, 450
    ``block_start``, 200 ``first_block_start``, nothing at the loss (no head). "Without the start
    moment" is ``block_start`` 0, under which no gather at a block's start is modelled, the
    stage's first block's included (``sharding.forward_positions``): its 205 is then not a
    moment, which leaves the peak at 725 either way."""
    kind = _kind(100, ((100, 10),), forward_peak_bytes=120)
    runs = [(kind, 0, (0,), 4)]
    gathers = DataParallel(in_block_forward=300, block_start=450, first_block_start=200)
    assert forward_peak(runs, 5, NO_HEAD, gathers) == 755
    assert forward_peak(runs, 5, NO_HEAD, gathers._replace(block_start=0)) == 725


def test_fsdp2_forward_first_start_of_a_one_block_stage() -> None:
    """One block (S=100, F=120), 5 B before, 300 B gathered in it: its compute 5 + 120 + 300
    = 425; its start, the stage's first, 5 + 1,000 = 1,005; the 2,000 B of a later block's
    start never occur (there is none). Peak 1,005 (``in_block_forward`` 300, ``block_start``
    2,000, ``first_block_start`` 1,000)."""
    kind = _kind(100, ((100, 10),), forward_peak_bytes=120)
    gathers = DataParallel(in_block_forward=300, block_start=2_000, first_block_start=1_000)
    assert forward_peak([(kind, 0, (0,), 1)], 5, NO_HEAD, gathers) == 1_005
