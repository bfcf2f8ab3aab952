"""torch.distributed.pipelining's PipelineStage buffers, traced on two real gloo processes (CPU),
against ``memplan.model.pipeline_buffers``.

Each rank holds one stage of a small linear stack (hidden 32, two ``Linear`` layers a stage),
run by ``Schedule1F1B`` with 4 micro-batches of 2 x 16 rows in fp32, as torchtitan runs its
stages (``PipelineStage`` without input_args, ``step(..., return_outputs=False)``).
``memplan.profile.tracker.MemoryTracker`` counts every live storage; a rank's bytes beyond
its weights, their gradients, the batch and the loss scalars are read at two moments of each
step, steps 1 and 2 alike (``b`` = 2 x 16 x 32 x 4 = 4,096 B, one micro-batch's stage input):

- after ``step()`` returns (before any optimizer step): what ``stage_buffers`` holds at the
  optimizer step (``at_step``): each rank's 4 receive buffers, 4b;
- as the 1F1B phase's backward of micro-batch 1 starts (f micro-batches in flight: 2 on rank
  0, 1 on rank 1): the walk's bytes for this stack by hand plus ``in_step``. Per micro-batch
  in flight the stack saves the first linear's input (rank 0: a view of the batch; rank 1:
  its receive buffer, counted once) and the ReLU's output (b), and ``fwd_cache`` keeps the
  output (b). Rank 0 (f = 2): the walk's 2 ReLU outputs and its incoming gradient (b), with
  ``in_step`` (m + f - 1) b = 5b (3 gradient buffers beyond it, 2 outputs): 8b. Rank 1
  (f = 1): the walk's input and ReLU output (2b), with ``in_step`` (m - f + 1) b = 4b (3
  input buffers beyond the saved one, micro-batch 0's input gradient in ``bwd_sends``), and
  the last stage's output beside its loss (b, the head's, not ``stage_buffers``'): 7b.
  Rank 0 holds one b more, micro-batch 0's output after its backward: the warm-up's last
  fired send (``send_work = _batch_p2p(fwd_sends)`` in Schedule1F1B._step_microbatches, not
  rebound until the cool-down) keeps its gloo ``Work``, which keeps the tensor it sent. Not
  modelled: whether NCCL's work object keeps it after ``wait()`` was not traced here (no GPU).

With a loss that saves none of the last stage's output (cross-entropy: log-softmax keeps its
own output), the output is held by the pipeline alone: through its micro-batch's backward and
the next micro-batch's forward up to its loss (``StageBuffers.output``, ``previous``).

And ``ScheduleInterleaved1F1B`` with two virtual stages a rank: after each step each rank holds
one set of buffers per virtual stage (``at_step``, 12b).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

from memplan.model.pipeline import chunks_in_flight  # noqa: E402
from memplan.model.pipeline_buffers import stage_buffers  # noqa: E402
from memplan.parallel import ParallelConfig  # noqa: E402
from memplan.workload import PipelineBuffers, Workload  # noqa: E402

H, MBS, SEQ, M = 32, 2, 16, 4
B = MBS * SEQ * H * 4  # one micro-batch's stage input, fp32


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _stack() -> Any:
    return torch.nn.Sequential(torch.nn.Linear(H, H, bias=False), torch.nn.ReLU(),
                               torch.nn.Linear(H, H, bias=False))


def _mse(y: Any, t: Any) -> Any:
    return torch.nn.functional.mse_loss(y, t)


def _ce(y: Any, t: Any) -> Any:
    """A language model's loss on the stack's output as logits over 32 classes: log-softmax
    saves its output, not its input, so the output is held by the pipeline alone."""
    return torch.nn.functional.cross_entropy(y.flatten(0, 1), t.flatten(0, 1))


def _one_f_one_b(rank: int, loss_fn: Any, classes: bool) -> dict[str, int]:
    """Schedule1F1B over the stack with ``loss_fn`` (``classes``: integer targets over the H
    outputs, else targets like the output): the rank's bytes beyond weights, gradients and
    loss scalars as the last layer's forward of micro-batch 1 starts, as micro-batch 1's
    backward starts, and after each step."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from memplan.profile.tracker import MemoryTracker

    out: dict[str, int] = {}
    torch.manual_seed(0)
    tracker = MemoryTracker()
    with tracker:
        stage_mod = _stack()
        stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=loss_fn)
        x = torch.randn(M * MBS, SEQ, H)
        target = (torch.randint(0, H, (M * MBS, SEQ)) if classes
                  else torch.randn(M * MBS, SEQ, H))
        params = list(stage_mod.parameters())
        before = tracker.total_bytes
        at = {"mb": -1, "step": 0}

        def beyond() -> int:
            return (tracker.total_bytes - before - _storage_bytes(p.grad for p in params)
                    - _storage_bytes(schedule._internal_losses))

        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def at_forward(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            at["mb"] = fwd_chunk_id
            return forward(fwd_chunk_id, *args, **kwargs)

        def at_backward(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if bwd_chunk_id == 1:
                out[f"backward1_step{at['step']}"] = beyond()
            return backward(bwd_chunk_id, *args, **kwargs)

        def at_last_layer(module: Any, args: Any) -> None:
            if at["mb"] == 1:
                out[f"forward1_step{at['step']}"] = beyond()

        stage.forward_one_chunk, stage.backward_one_chunk = at_forward, at_backward
        stage_mod[2].register_forward_pre_hook(at_last_layer)
        out.update(_two_steps(rank, schedule, (x, target), (tracker, before, params),
                              lambda step: at.update(step=step, mb=-1)))
    return out


def _interleaved(rank: int) -> dict[str, int]:
    """ScheduleInterleaved1F1B, two virtual stages a rank (rank r: stages r and r + 2 of 4,
    torchtitan's loop placement): each rank's bytes after each step beyond its weights,
    gradients, batch and losses."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from memplan.profile.tracker import MemoryTracker

    out: dict[str, int] = {}
    tracker = MemoryTracker()
    with tracker:
        mods = [_stack(), _stack()]
        stages = [PipelineStage(mod, rank + 2 * c, 4, torch.device("cpu"))
                  for c, mod in enumerate(mods)]
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=_mse)
        x, target = torch.randn(M * MBS, SEQ, H), torch.randn(M * MBS, SEQ, H)
        params = [p for mod in mods for p in mod.parameters()]
        out.update(_two_steps(rank, schedule, (x, target),
                              (tracker, tracker.total_bytes, params)))
    return out


def _two_steps(rank: int, schedule: Any, batch: tuple[Any, Any], seen: tuple[Any, int, list],
               before_step: Any = None) -> dict[str, int]:
    """Steps 1 and 2 as torchtitan runs them (``return_outputs=False``): after each, the
    rank's bytes beyond what ``seen``'s tracker held at its count (its weights, the batch),
    the gradients and the losses."""
    (x, target), (tracker, before, params) = batch, seen
    out = {}
    for step in (1, 2):
        if before_step is not None:
            before_step(step)
        losses: list | None = [] if rank == 1 else None
        schedule.step(x if rank == 0 else None, target=target if rank == 1 else None,
                      losses=losses, return_outputs=False)
        out[f"step{step}"] = (tracker.total_bytes - before
                              - _storage_bytes(p.grad for p in params)
                              - _storage_bytes(losses or []))
        del losses
    return out


def _rank(rank: int, folder: str) -> None:
    from memplan.profile.distributed import leave_rank

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=2)
    out: dict[str, Any] = {}
    try:
        out["interleaved"] = _interleaved(rank)
        out["last_output"] = _one_f_one_b(rank, _ce, True)
        out.update(_one_f_one_b(rank, _mse, False))
    finally:
        dist.destroy_process_group()
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    leave_rank()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, int]]:
    folder = tmp_path_factory.mktemp("pipestage")
    mp.start_processes(_rank, args=(str(folder),), nprocs=2, start_method="spawn")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def test_buffers_after_each_step_are_memplans(ranks: list[dict[str, int]]) -> None:
    """Rank 0: 4 gradient buffers, 4b = 16,384 B; rank 1: 4 input buffers and 4 gradients on
    them, 8b = 32,768 B (``stage_buffers(...).at_step``), in step 1 and step 2 alike."""
    par = ParallelConfig(pp=2)
    wl = Workload(pipeline_buffers=PipelineBuffers.TORCH)
    expected = [stage_buffers(wl, par, M, r, tuple(chunks_in_flight(par, M, r)), B).at_step
                for r in range(2)]
    assert expected == [4 * B, 4 * B] == [16_384, 16_384]
    for rank, got in enumerate(ranks):
        assert (got["step1"], got["step2"]) == (expected[rank], expected[rank]), rank


def test_buffers_at_a_one_f_one_b_backward(ranks: list[dict[str, int]]) -> None:
    """The walk's bytes by hand (module docstring) plus ``stage_buffers(...).in_step``:
    rank 0 3b + 5b = 8b = 32,768 B, rank 1 2b + 4b + b = 7b = 28,672 B."""
    par = ParallelConfig(pp=2)
    wl = Workload(pipeline_buffers=PipelineBuffers.TORCH)
    in_step = [stage_buffers(wl, par, M, r, tuple(chunks_in_flight(par, M, r)), B).in_step
               for r in range(2)]
    assert in_step == [5 * B, 4 * B]
    walk = [2 * B + B, 2 * B + B]  # rank 0: 2 ReLU outputs, the incoming gradient; rank 1:
    #                                its input and ReLU output, and its output at the loss
    gloo_send = [B, 0]  # rank 0's output 0, kept by the send's gloo Work (docstring)
    for rank, got in enumerate(ranks):
        expected = walk[rank] + in_step[rank]
        assert expected == [32_768, 28_672][rank]
        traced = expected + gloo_send[rank]
        assert (got["backward1_step1"], got["backward1_step2"]) == (traced, traced), rank


def test_virtual_stages_each_hold_their_own(ranks: list[dict[str, Any]]) -> None:
    """Interleaved 1F1B, pp 2 x vpp 2, m 4: after each step rank 0 (stages 0 and 2) holds
    stage 0's 4 gradient buffers and stage 2's 4 input and 4 gradient buffers, rank 1
    (stages 1 and 3) stage 1's 4 + 4 and stage 3's 4 input buffers: 12b = 49,152 B each
    (``stage_buffers(...).at_step``, one set per virtual stage)."""
    par = ParallelConfig(pp=2, vpp=2)
    wl = Workload(pipeline_buffers=PipelineBuffers.TORCH)
    for rank, got in enumerate(ranks):
        expected = stage_buffers(wl, par, M, rank, tuple(chunks_in_flight(par, M, rank)),
                                 B).at_step
        assert expected == 12 * B == 49_152
        assert (got["interleaved"]["step1"], got["interleaved"]["step2"]) == (expected,
                                                                                expected), rank


def test_last_stage_output_is_held(ranks: list[dict[str, Any]]) -> None:
    """Schedule1F1B with a cross-entropy loss (``_ce``), the last rank (f = 1, m = 4): as the
    last layer's forward of micro-batch 1 starts, the walk's input and ReLU output (2b) and
    ``in_step`` 4b (3 input buffers beyond the saved one, micro-batch 0's input gradient),
    and micro-batch 0's output ``o`` = b, still the schedule's ``output``
    (``StageBuffers.previous``): 7b = 28,672 B. As micro-batch 1's backward starts: the walk's
    input, ReLU output and log-softmax output (3b), ``in_step`` 4b and micro-batch 1's output
    (``StageBuffers.output``): 8b, and nll_loss's saved total weight (a 4 B scalar). After
    each step only the 4 input buffers (``at_step``): the output is gone."""
    par = ParallelConfig(pp=2)
    wl = Workload(pipeline_buffers=PipelineBuffers.TORCH)
    pipe = stage_buffers(wl, par, M, 1, tuple(chunks_in_flight(par, M, 1)), B, B)
    assert (pipe.in_step, pipe.output, pipe.previous, pipe.at_step) == (4 * B, B, B, 4 * B)
    got = ranks[1]["last_output"]
    forward = 2 * B + pipe.in_step + pipe.previous
    backward = 3 * B + pipe.in_step + pipe.output
    assert (forward, backward) == (28_672, 32_768)
    for step in (1, 2):
        assert got[f"forward1_step{step}"] == forward, step
        assert got[f"backward1_step{step}"] == backward + 4, step
        assert got[f"step{step}"] == pipe.at_step, step
