"""The stage walks on hand-made layer kinds: the bytes at each moment, derived by hand."""

from __future__ import annotations

import pytest

import memplan
from memplan.model.embedding import EmbeddingBlock
from memplan.model.head import HeadBlock
from memplan.model.layer import LayerKind, LayerMoment
from memplan.model.moments import Segment, fold, peak_of, timeline, unfold
from memplan.model.sharding import DataParallel
from memplan.model.walk import (
    Walk,
    backward_peak,
    first_positions,
    forward_peak,
    runs_of,
)

# A layer that saves 100 B, peaks at 120 B in its forward and, in its backward, holds all it
# saved and 10 B of gradients in flight; its parameters' gradients are 50 B.
KIND = LayerKind(terms=(), saved_bytes=100, forward_peak_bytes=120,
                 moments=(LayerMoment("m", 100, 10, ()),))


def _walk(**parts: object) -> Walk:
    fields = dict(runs=[(KIND, 50, (0,), 2)], other_bytes=0, rest_saved=0, head=HeadBlock(),
                  embedding=EmbeddingBlock(), sharding=DataParallel())
    fields.update(parts)
    return Walk(**fields)  # type: ignore[arg-type]


def test_forward_peaks_at_the_last_layer_of_a_run() -> None:
    """5 B before the stage; the second layer's peak: 5 + 100 (the first layer's saved) +
    120 = 225."""
    assert forward_peak(_walk().runs, 5, HeadBlock(), DataParallel()) == 225


def test_forward_with_the_head() -> None:
    """After two layers (205 B alive) the final norm holds 30 B, then the loss saves 40 B
    and holds 60 B of logits: max(205 + 30, 205 + 40 + 60) = 305."""
    head = HeadBlock(forward_saved=40, final_norm_forward=30, loss_forward=60)
    assert forward_peak(_walk().runs, 5, head, DataParallel()) == 305


def test_backward_peaks_at_the_first_layer_walked() -> None:
    """The last layer's moment: its own 100 B and 10 B in flight beside the other layer's
    100 B saved (210); at the first layer the other one's 100 B of saved bytes became 50 B of
    gradients (160); at the end only the 100 B of gradients remain."""
    assert backward_peak(_walk(), 0, 100) == 210


def test_backward_with_earlier_microbatches_gradients() -> None:
    """With all 100 B of gradients existing from an earlier micro-batch, every moment carries
    them: 210 + 100 = 310."""
    assert backward_peak(_walk(), 100, 100) == 310


def test_backward_starts_at_the_loss() -> None:
    """A head that saved 40 B and whose loss backward holds 500 B: 2 * 100 + 40 + 500 = 740
    at the loss's backward, larger than any layer's moment."""
    head = HeadBlock(saved_bytes=40, loss=500)
    assert backward_peak(_walk(head=head), 0, 100) == 740


def test_logits_held_by_the_loop() -> None:
    """A loop that keeps 25 B of logits from the loss to the next step's loss (the head's
    ``held_logits``). Step 1's forward: the two layers at 5 + 120 = 125 and 105 + 120 = 225,
    the final norm at 205 + 30 = 235, the loss at 205 + 40 + 10 = 255. From step 2 the
    previous step's logits are alive from the start until the loss frees them: 150, 250,
    the final norm at 260, the loss still at 255. In backward they are alive throughout:
    the loss's moment 2 * 100 + 40 + 500 + 25 = 765."""
    head = HeadBlock(forward_saved=40, final_norm_forward=30, loss_forward=10, held_logits=25)
    assert forward_peak(_walk().runs, 5, head, DataParallel()) == 255
    assert forward_peak(_walk().runs, 5, head, DataParallel(), steady=True) == 260
    head = HeadBlock(saved_bytes=40, loss=500, held_logits=25)
    assert backward_peak(_walk(head=head), 0, 100) == 765


def test_embeds_held_by_the_model_forward() -> None:
    """The model's forward keeps the embedding's output, 15 B, from its first layer on
    (``HeadBlock.embeds_held``); the first layer already counts it as its input (the 5 B
    before the stage here), so nothing more there: 5 + 120 = 125. The second layer peaks at
    5 + 100 + 15 + 120 = 240 (225 without), the final norm at 5 + 200 + 15 + 30 = 250 (235),
    then the model returns: the loss at 205 + 40 + 10 = 255 either way. With three layers
    in the run the third peaks at 5 + 200 + 15 + 120 = 340 (325 without)."""
    head = HeadBlock(forward_saved=40, final_norm_forward=30, loss_forward=10)
    held = head._replace(embeds_held=15)
    runs = _walk().runs
    assert forward_peak(runs, 5, held, DataParallel()) == 255
    norm_only = HeadBlock(forward_saved=1, final_norm_forward=30)
    assert forward_peak(runs, 5, norm_only, DataParallel()) == 235
    assert forward_peak(runs, 5, norm_only._replace(embeds_held=15), DataParallel()) == 250
    assert forward_peak([(KIND, 50, (0,), 1)], 5, HeadBlock(embeds_held=15),
                        DataParallel()) == 125
    three = [(KIND, 50, (0,), 3)]
    assert forward_peak(three, 5, HeadBlock(), DataParallel()) == 325
    assert forward_peak(three, 5, HeadBlock(embeds_held=15), DataParallel()) == 340


@pytest.mark.parametrize("kw,held", [
    ({}, 2 * 32 * 64 * 2),  # bf16, no recompute: b x s x h x 2
    ({"recompute": "full"}, 0),  # the checkpoint keeps the first layer's input
    ({"precision": "fp32"}, 0),  # the norm saves the fp32 tensor itself
    ({"precision": "amp-bf16"}, 0),  # autocast's fp32 stream: the norm saves it too
    ({"framework": "generic"}, 0),  # a loop that rebinds the embedding's output
    ({"pp": 2, "gpus": 2}, 0)])  # the embedding and the head on different stages
def test_embeds_held_bytes(kw: dict, held: int) -> None:
    """transformers' ``XModel.forward`` keeps ``inputs_embeds`` (the hf preset's
    ``embeds_held``): tiny (h 64) at 2 x 32 tokens in bf16 holds 8,192 B beside its layers
    where no layer saves the embedding's output (``memplan.model.stage.embeds_held_bytes``)."""
    from memplan.model import memo
    from memplan.model.dims import Dims
    from memplan.model.stage import embeds_held_bytes

    args = dict(framework="hf", precision="bf16-pure", micro_batch_size=2, seq_len=32) | kw
    est = memplan.estimate("tiny", **args)
    spec, par, wl = est.spec, est.parallel, est.workload
    fx, kinds = memo.stage_parts(spec, par, wl)[0]
    assert embeds_held_bytes(spec, wl, Dims.of(spec, par, wl), fx, kinds) == held


def test_zero2_buffer_holds_unsharded_gradients() -> None:
    """ZeRO-2 with a shard degree of 2 (unsharded / held = 2) and a 1,000 B bucket. At the
    first layer walked the other layer's 50 B made wait unsharded (100 B, 50 beyond their
    shard): 160 + 50 = 210; at the end the 100 B made wait (200 B): 100 + 100 = 200. With
    300 B of the embedding's gradients too, the end holds 400 B of gradients and 400 B beyond
    their shard: 800."""
    sharding = DataParallel(grad_cap=1_000, unsharded_ratio=2)
    assert backward_peak(_walk(sharding=sharding), 0, 100) == 210
    embedding = EmbeddingBlock(grads=300)
    assert backward_peak(_walk(sharding=sharding, embedding=embedding), 0, 400) == 800


def test_runs_and_first_positions() -> None:
    keys = ["a", "a", "b", "a"]
    assert runs_of(keys) == [("a", 2), ("b", 1), ("a", 1)]
    assert first_positions(keys) == {"a": 0, "b": 2}


@pytest.mark.parametrize("kw", [
    dict(gpus=8, zero=1),
    dict(gpus=8, zero=2, micro_batch_size=2, global_batch_size=64),
    dict(gpus=8, zero=3, precision="fsdp-bf16", recompute="full"),
    dict(gpus=6, zero=3, precision="fsdp-bf16", framework="torchtitan"),
    dict(gpus=8, pp=2, zero=3, precision="fsdp-bf16", framework="torchtitan"),
    dict(gpus=8, pp=2, vpp=2, zero=1, recompute="selective", global_batch_size=64),
])
def test_real_stages_fold_as_they_unfold(monkeypatch: pytest.MonkeyPatch, kw: dict) -> None:
    """On real stages (DDP, ZeRO-1/2, FSDP2 with either unit layout, kept gathered under PP,
    interleaved pipelines), every forward and backward fold equals the largest instant of the
    same sequence walked event by event."""
    from memplan.model import walk

    def checked(segments: list[Segment], alive: int = 0) -> int:
        peak = peak_of(segments, alive)
        assert peak == max(at for _, _, at in timeline(segments, alive))
        return peak

    def checked_fold(segments: list[Segment], alive: int = 0) -> tuple[int | None, int]:
        peak, after = fold(segments, alive)
        assert peak == max((at for _, _, at in timeline(segments, alive)), default=None)
        assert after == alive + sum(e.delta for e in unfold(segments))
        return peak, after

    folds = []
    # the stage's forward and backward are folded in the walk (``forward_peaks``, its layers
    # once and the head from where they end, ``backward_peak``)
    monkeypatch.setattr(walk, "peak_of", lambda s, a=0: folds.append(1) or checked(s, a))
    monkeypatch.setattr(walk, "fold", lambda s, a=0: folds.append(1) or checked_fold(s, a))
    memplan.estimate("gpt2", seq_len=256, **kw)
    assert len(folds) >= 2  # a forward's layers and a backward, at least
