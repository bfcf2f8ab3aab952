"""torch.distributed.pipelining's PipelineStage buffers (``memplan.model.pipeline_buffers``),
derived by hand from torch 2.13's stage.py and schedules.py (the module docstring).

Throughout: ``b`` is one micro-batch's residual stream on the rank, mbs x seq / (tp under
SP) x h x itemsize; ``m`` micro-batches per step; ``f`` in flight on the chunk at its peak.
"""

from __future__ import annotations

import memplan
from memplan.model.pipeline_buffers import NO_BUFFERS, stage_buffers
from memplan.parallel import ParallelConfig
from memplan.presets import apply
from memplan.spec import load_model
from memplan.workload import Framework, PipelineBuffers, Workload

TORCH = Workload(pipeline_buffers=PipelineBuffers.TORCH)
B = 2 * 128 * 64 * 2  # mbs 2 x seq 128 x h 64 x bf16: 32,768 B


def test_two_stages_one_f_one_b() -> None:
    """pp 2, m 4 (Schedule1F1B: stage 0 warms up min(m, 2) = 2, stage 1 one).

    Stage 0 (no previous stage, a next one): 4 gradient receive buffers (4b); at a peak
    with f = 2 in flight, m - 1 = 3 buffers beside the walk's incoming gradient at a backward
    and f = 2 kept outputs (at a forward 4 buffers and f - 1 = 1 output): 5b; at the
    optimizer step the 4 buffers, every output freed: 4b.
    Stage 1 (a previous stage, no next): 4 input buffers (4b), f = 1 of them the walk's saved
    input, and the previous backward's input gradient (m > f) kept by ``bwd_sends``:
    3b + b = 4b; at the optimizer step the 4 buffers: 4b.
    """
    par = ParallelConfig(pp=2)
    first = stage_buffers(TORCH, par, 4, 0, (2,), B)
    assert first.tensors == (B,) * 4 and first.persistent_bytes == 131_072
    assert (first.in_step, first.at_step) == (5 * B, 4 * B) == (163_840, 131_072)
    last = stage_buffers(TORCH, par, 4, 1, (1,), B)
    assert last.tensors == (B,) * 4
    assert (last.in_step, last.at_step) == (4 * B, 4 * B) == (131_072, 131_072)


def test_middle_stage_holds_both() -> None:
    """pp 3, m 6, the middle stage with f = 2: 6 input and 6 gradient buffers (12b); in the
    step m - f + 1 = 5b of the input side and m + f - 1 = 7b of the output side: 12b; at the
    optimizer step m + m = 12b."""
    got = stage_buffers(TORCH, ParallelConfig(pp=3), 6, 1, (2,), B)
    assert got.tensors == (B,) * 12
    assert (got.in_step, got.at_step) == (12 * B, 12 * B)


def test_all_in_flight_holds_no_input_gradient() -> None:
    """m = f = 2 (pp 3, the middle stage): every forward before the first backward, whose
    peak has no earlier input gradient: the input side 0b in the step (2b at the optimizer
    step), the output side m + f - 1 = 3b (2b)."""
    got = stage_buffers(TORCH, ParallelConfig(pp=3), 2, 1, (2,), B)
    assert (got.in_step, got.at_step) == (3 * B, 4 * B)


def test_virtual_stages_each_their_own() -> None:
    """pp 2, vpp 2, m 4: rank 0 holds virtual stages 0 and 2 (of 4), flight (3, 2) given.
    Stage 0: gradient side only, (4 + 3 - 1)b = 6b, 4b at the step. Stage 2: input side
    (4 - 2 + 1)b = 3b (4b at the step) and gradient side (4 + 2 - 1)b = 5b (4b at the step).
    Buffers: 4 + 4 + 4 = 12; in the step 14b; at the optimizer step 12b."""
    got = stage_buffers(TORCH, ParallelConfig(pp=2, vpp=2), 4, 0, (3, 2), B)
    assert got.tensors == (B,) * 12
    assert (got.in_step, got.at_step) == (14 * B, 12 * B)


def test_last_stage_output() -> None:
    """The last stage's output ``o`` (here 3 x 32,768 B): with f = 1 (Schedule1F1B's last
    stage) none kept in the step beyond the one held at a backward and at the next forward
    (m > 1); with m = 1 no next forward; with f = 3 (a last chunk of an interleaved
    schedule) 2o more in the step. A stage before the last holds none."""
    o = 3 * B
    par = ParallelConfig(pp=2)
    last = stage_buffers(TORCH, par, 4, 1, (1,), B, o)
    assert (last.in_step, last.output, last.previous) == (4 * B, o, o)
    alone = stage_buffers(TORCH, par, 1, 1, (1,), B, o)
    assert (alone.in_step, alone.output, alone.previous) == (0, o, 0)
    chunked = stage_buffers(TORCH, ParallelConfig(pp=2, vpp=2), 4, 1, (3, 3), B, o)
    assert (chunked.output, chunked.previous) == (o, o)
    # chunk 0 (stage 1): input side (4 - 3 + 1)b, output side (4 + 3 - 1)b; chunk 1 (stage 3,
    # the last): input side 2b and 2o kept
    assert chunked.in_step == 2 * B + 6 * B + 2 * B + 2 * o
    first = stage_buffers(TORCH, par, 4, 0, (2,), B, o)
    assert (first.in_step, first.output, first.previous) == (5 * B, 0, 0)


def test_none_and_no_pipeline() -> None:
    """Megatron-LM's schedules (none) and a single stage hold nothing of this."""
    assert stage_buffers(Workload(), ParallelConfig(pp=2), 4, 1, (1,), B) is NO_BUFFERS
    assert stage_buffers(TORCH, ParallelConfig(), 4, 0, (1,), B) is NO_BUFFERS


def test_torchtitan_preset_selects_torch() -> None:
    given = apply(Framework.TORCHTITAN, load_model("tiny"), {})
    assert given["pipeline_buffers"] == "torch"
    assert Workload().pipeline_buffers is PipelineBuffers.NONE


def _stages(buffers: str) -> list:
    return memplan.estimate("tiny", framework="torchtitan", gpus=2, pp=2, zero=3,
                            micro_batch_size=2, global_batch_size=8, seq_len=128,
                            precision="fsdp-bf16", pipeline_buffers=buffers).stages


def test_estimate_moves_by_the_buffers() -> None:
    """The tiny spec (h 64, 2 layers: one per stage), torchtitan's preset, pp 2, mbs 2 x seq
    128 in bf16 (b = 32,768 B), gbs 8: m = 4. Each phase of both steps moves by the hand
    figures of ``test_two_stages_one_f_one_b``: stage 0 by 5b in forward and backward and 4b
    at the optimizer step, stage 1 by 4b and 4b, and in backward by its output too, the
    logits 256 tokens x vocabulary 128 x 2 B = 65,536 B, which the loss does not save
    (``StageBuffers.output``; in forward the previous micro-batch's is freed before the loss,
    where this stage's forward peaks); the record shows 4b of receive buffers."""
    with_buffers, without = _stages("torch"), _stages("none")
    moved = {0: (163_840, 163_840, 131_072), 1: (131_072, 131_072 + 65_536, 131_072)}
    for a, z in zip(with_buffers, without):
        assert a.pipeline_buffers_bytes == 131_072 and z.pipeline_buffers_bytes == 0
        for phases in ("steady", "first_step"):
            pa, pz = getattr(a, phases), getattr(z, phases)
            assert (pa.forward - pz.forward, pa.backward - pz.backward,
                    pa.optimizer - pz.optimizer) == moved[a.stage]
