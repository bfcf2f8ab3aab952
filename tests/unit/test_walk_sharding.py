"""The walks' data-parallel moments on hand-made layers: ZeRO-2's bucket and FSDP2's units.

These call ``memplan.model.walk`` directly (its ``Walk``/``GradSharding`` inputs), so they are
kept to this one file to be ported when the walk is restructured; the numbers they pin are
the moments' bytes, which a restructure keeps. Every docstring lists each moment the walk
visits with its bytes, derived by hand; the expected peak is the largest of them.

Common layer (``_kind``): saves ``S`` B in forward, peaks at ``F`` B inside its forward, and in
backward has one or two moments (saved bytes still alive ``A``, gradients in flight ``T``,
parameter-gradient bytes made so far ``g``); its parameters' gradients are ``L`` B as held
(sharded) by the rank. ``r`` = unsharded / held gradient bytes (the shard degree), ``u`` =
bytes of an unsharded gradient (the weights' dtype) per byte of its reduce dtype.
Neither head nor embedding (a middle pipeline stage), nothing else alive.
"""

from __future__ import annotations

from memplan.model.layer import BackwardMoment, LayerKind
from memplan.model.walk import (
    EmbeddingBackward,
    GradSharding,
    HeadBackward,
    Walk,
    backward_peak,
    forward_peak,
)

NO_HEAD = HeadBackward(0, 0, 0, 0, 0, 0, 0, 0)
NO_EMBEDDING = EmbeddingBackward(0, 0, 0, 0)


def _kind(saved: int, moments: tuple[tuple[int, int], ...], forward_peak_bytes: int = 0):
    return LayerKind(terms=(), saved_bytes=saved, forward_peak_bytes=forward_peak_bytes,
                     moments=tuple(BackwardMoment(f"m{i}", a, t, ())
                                   for i, (a, t) in enumerate(moments)))


def _walk(kind: LayerKind, layer_grads: int, moment_grads: tuple[int, ...], n: int,
          sharding: GradSharding, embedding: EmbeddingBackward = NO_EMBEDDING) -> Walk:
    return Walk(runs=[(kind, layer_grads, moment_grads, n)], other_bytes=0, rest_saved=0,
                head=NO_HEAD, embedding=embedding, sharding=sharding)


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
    sharding = GradSharding(buffer=500, unsharded_ratio=2.0)
    assert backward_peak(_walk(kind, 300, (0,), 3, sharding), 0, 900) == 1_950


def test_zero2_bucket_cap_at_the_end() -> None:
    """n=2 layers, S=100, A=100, T=10, L=50, the embedding's 300 B of gradients last; r=2,
    cap 500 B.
      layer 2 (first walked)  100 saved + 110                                    =   210
      layer 1                 0 + 110 + 50 made, waiting min(500, 100) -> 50 extra = 210
      end                     400 made, waiting min(500, 800) = 500 -> 250 extra:
                              400 + 250                                          =   650
    Peak 650 (uncapped: 400 + 400 = 800)."""
    kind = _kind(100, ((100, 10),))
    sharding = GradSharding(buffer=500, unsharded_ratio=2.0)
    embedding = EmbeddingBackward(grads=300, extra=0, tied_pending=0, freed_before=0)
    assert backward_peak(_walk(kind, 50, (0,), 2, sharding, embedding), 0, 400) == 650


def test_zero2_bucket_at_an_uneven_shard_degree() -> None:
    """As ``test_zero2_bucket_cap_inside_a_run`` with r=3 (dp=3) and a 1,000,000 B cap:
      layer 1 (last walked)  1,100 + 600 made, waiting 1,800 -> 1,800 - 600 = 1,200 extra
                             = 2,900
      end                    900 made, waiting 2,700 -> 1,800 extra: 2,700
    Peak 2,900."""
    kind = _kind(100, ((100, 1_000),))
    sharding = GradSharding(buffer=1_000_000, unsharded_ratio=3.0)
    assert backward_peak(_walk(kind, 300, (0,), 3, sharding), 0, 900) == 2_900


# --- FSDP2: units of one block, runs of four and more -----------------------------------------

def _fsdp2(**gathered: int) -> GradSharding:
    fields = dict(buffer=1_000, unsharded_ratio=2.0, fsdp2=True, unsharded_dtype=0.5,
                  gathered_in_block=500, gathered_at_loss=400, gathered_at_end=200,
                  gathered_last_block=300)
    fields.update(gathered)
    return GradSharding(**fields)  # type: ignore[arg-type]


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
    test_fsdp_backward_between_the_ends_of_a_run)."""
    kind = _kind(100, ((100, 10), (80, 10)))
    walk = _walk(kind, 120, (0, 40), 5, _fsdp2())
    assert backward_peak(walk, 0, 600) == 1_330


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
    alive, the previous block's reduce-scatter input still held)."""
    kind = _kind(100, ((100, 10),))
    sharding = _fsdp2(unsharded_dtype=1.0, gathered_in_block=400, gathered_at_loss=0,
                      gathered_at_end=100, gathered_last_block=350)
    assert backward_peak(_walk(kind, 150, (0,), 4, sharding), 0, 600) == 1_500


def test_fsdp2_reduce_scatter_with_the_input_gradient() -> None:
    """As ``test_fsdp2_copy_out_before_the_stage_first_block_of_four`` with the gradient of
    a block's input (500 B, the residual stream) alive at its reduce-scatter: after the first
    block walked 1,250 + 500 = 1,750, after the stage's first 1,150 + 500 = 1,650; every other
    moment as there (at most 1,500). Peak 1,750."""
    kind = _kind(100, ((100, 10),))
    sharding = _fsdp2(unsharded_dtype=1.0, gathered_in_block=400, gathered_at_loss=0,
                      gathered_at_end=100, gathered_last_block=350, boundary_grad=500)
    assert backward_peak(_walk(kind, 150, (0,), 4, sharding), 0, 600) == 1_750


def test_fsdp2_reduce_scatter_after_the_stage_first_block() -> None:
    """As ``test_fsdp2_reduce_scatter_with_the_input_gradient`` with 300 B gathered at the end
    (the embedding's backward): after the stage's first block its reduce-scatter holds
    0 saved + 3 * 150 + 300 + 300 + 500 + 300 = 1,850 (only the root is gathered there, not
    the 350 B of a block's backward); after the first block walked 1,750; the end
    600 + 300 + 300 = 1,200; the others at most 1,500. Peak 1,850."""
    kind = _kind(100, ((100, 10),))
    sharding = _fsdp2(unsharded_dtype=1.0, gathered_in_block=400, gathered_at_loss=0,
                      gathered_at_end=300, gathered_last_block=350, boundary_grad=500)
    assert backward_peak(_walk(kind, 150, (0,), 4, sharding), 0, 600) == 1_850


def test_fsdp2_forward_gathers_at_a_block_start() -> None:
    """Forward of n=4 blocks (S=100, F=120) with 5 B alive before: 300 B gathered while a
    block runs, 450 B at a block's start (its all-gather output and parameters beside the
    previous unit's output), 200 B at the stage's first block's start.
      block k (k blocks before it saved)   5 + 100k + 120 + 300: at k=3        =   725
      start of block k (k >= 1)            5 + 100k + 450: at k=3              =   755
      start of the stage's first block     5 + 200                             =   205
    Peak 755 (725 without the start moment)."""
    kind = _kind(100, ((100, 10),), forward_peak_bytes=120)
    runs = [(kind, 0, (0,), 4)]
    assert forward_peak(runs, 5, 0, 0, 0, (300, 0, 450, 200)) == 755
    assert forward_peak(runs, 5, 0, 0, 0, (300, 0, 0, 200)) == 725


def test_fsdp2_forward_first_start_of_a_one_block_stage() -> None:
    """One block (S=100, F=120), 5 B before, 300 B gathered in it: its compute 5 + 120 + 300
    = 425; its start, the stage's first, 5 + 1,000 = 1,005; the 2,000 B of a later block's
    start never occur (there is none). Peak 1,005."""
    kind = _kind(100, ((100, 10),), forward_peak_bytes=120)
    assert forward_peak([(kind, 0, (0,), 1)], 5, 0, 0, 0, (300, 0, 2_000, 1_000)) == 1_005
