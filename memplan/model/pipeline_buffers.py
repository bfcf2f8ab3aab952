"""What torch.distributed.pipelining's ``PipelineStage`` keeps beside a stage's activations.

``Workload.pipeline_buffers`` torch (torchtitan's pipeline parallelism). All from torch 2.13,
torch/distributed/pipelining/stage.py and schedules.py; ``b`` below is one micro-batch's
residual stream on this rank (``Dims.stream``: mbs x seq / (tp under SP) / cp x h x the
stream's itemsize): a stage's input and output, and their gradients, are that tensor.

- receive buffers: a stage with a previous stage (not stage 0) makes one buffer per
  micro-batch of the step for its input (``PipelineStage._setup_forward_recv_info``:
  ``_make_tensor_from_meta`` for each of ``num_microbatches``), a stage with a next stage one
  per micro-batch for its output's gradient (``_setup_backward_recv_info`` /
  ``_create_grad_recv_info``), both in ``_PipelineSchedule._initialize_pp_stages`` at step 1's
  start, before its first forward, kept in ``args_recv_info`` / ``grad_recv_info`` for every
  later step (``clear_runtime_states`` keeps them). A ``_DTensorMeta``'s shape is the local
  shard's (pipelining/_utils.py): under TP with SP a buffer is the sequence shard, and a
  DTensor input is ``DTensor.from_local`` of its buffer (``_retrieve_recv_activations``,
  no copy), its sends ``to_local_if_dtensor`` views.
  Each virtual stage is a ``PipelineStage`` of its own: with v chunks a rank holds v sets.
- the received input is the forward's input itself (``_retrieve_recv_activations``:
  ``info.buffer.requires_grad_``), so the first layer's saved input of a micro-batch in flight
  is its buffer: the walk counts it already (``f`` of the ``m`` buffers at the peak).
- ``fwd_cache`` keeps each micro-batch's output tuple from its forward until its backward
  (``forward_one_chunk``, ``backward_one_chunk`` pops it and holds it through
  ``stage_backward``): on a stage with a next stage, ``f`` outputs of ``b`` at a backward,
  ``f - 1`` beside a forward (Megatron-LM's schedules free them once sent; the walk counts
  none). With ``return_outputs=False`` (torchtitan) ``output_chunks`` stays empty
  (``save_forward_output``, schedules.py).
- the last stage's output (the logits, in the compute dtype: torchtitan's ``Decoder.forward``
  returns ``lm_head(h)``, its loss upcasts a copy, components/loss.py ``cross_entropy_loss``)
  is kept in ``fwd_cache`` too, though the loss saves none of it: at a micro-batch's backward
  ``backward_one_chunk`` pops it and holds it (``stage_output``) through ``stage_backward``;
  its ``detach_()`` after it frees nothing, and the schedule's ``output`` local
  (Schedule1F1B._step_microbatches, ``_PipelineScheduleRuntime._step_microbatches``) keeps it
  until the next ``forward_one_chunk`` returns its successor, before that one's loss. So with
  ``f`` in flight on the last chunk: ``f - 1`` outputs in ``fwd_cache`` at every moment of the
  step (``in_step``), and one more, ``StageBuffers.output``, through each backward and
  through the next forward (where ``m > 1``) up to its loss (``HeadBlock.pipe_output``,
  ``pipe_previous``), gone once ``step()`` returns. With virtual stages the ``output`` local
  may be another chunk's output, which ``fwd_cache`` already counts: counted as the last
  chunk's (at most one output more than held).
- the received gradient is the backward's incoming gradient (``_retrieve_recv_grads``), which
  the walk counts through each backward (``memplan.model.layer``'s ``incoming``): ``m - 1``
  buffers beyond it then, ``m`` elsewhere.
- ``stage_backward`` (pipelining/_backward.py) takes each input's gradient off its buffer
  (``val.grad = None`` after ``torch.autograd.backward``) into ``bwd_cache``, which
  ``get_bwd_send_ops`` empties into the send's ``P2POp``. ``Schedule1F1B._step_microbatches``
  keeps that list (``bwd_sends``) until the next backward has run: from the step's second
  backward on, one input gradient ``b`` is alive beside each forward and backward of the
  1F1B phase (with ``m > f``; where all ``m`` are in flight the peak is the first backward,
  before any). After ``step()`` returns none is left (traced:
  tests/traced/test_pipeline_stage_trace.py).

Step 1 and the steady state hold the same (the buffers exist before step 1's first forward).
Not counted: step 1's metadata inference (torchtitan passes no ``input_args``, so
``InferenceMode.DYNAMIC``: ``_forward_metadata_inference`` and
``_backward_metadata_inference`` run one micro-batch's forward and input-gradient backward
before the schedule, nothing else in flight: below the schedule's peak where ``f`` >= 1 of
the walk's micro-batches are alive with the same buffers), the losses' scalars, and the
output of the warm-up's last fired send, which Schedule1F1B's ``send_work`` keeps (with its
``Work``) until the cool-down: a gloo ``Work`` keeps the tensor it sent (one ``b`` more on
the traced first rank), where NCCL's releases it once waited (pytorch's ProcessGroupNCCL.cpp
``WorkNCCL::synchronizeStream`` unstashes its tensors; read in the source, not traced). Nor the
sends of ``_PipelineScheduleRuntime`` (Interleaved1F1B): ``send_ops`` keeps every send's
``Work`` of the step un-waited until its end, so what a backend keeps of an un-waited send
(gloo: the tensor) stays for the whole step; with virtual stages the in-step figures follow
Schedule1F1B's reasoning per chunk.
"""

from __future__ import annotations

from typing import NamedTuple

from memplan.parallel import ParallelConfig
from memplan.workload import PipelineBuffers, Workload


class StageBuffers(NamedTuple):
    """One pipeline rank's runtime buffers, int bytes: ``tensors`` the persistent receive
    buffers (each one tensor of ``b``, for the allocator's sequence), ``in_step`` beyond the
    walk at a forward or backward peak, ``at_step`` beside the optimizer step."""

    tensors: tuple[int, ...] = ()
    in_step: int = 0
    at_step: int = 0
    output: int = 0  # the last stage's output of the micro-batch at its backward (its head's)
    previous: int = 0  # ... and of the previous micro-batch at a forward, up to its loss

    @property
    def persistent_bytes(self) -> int:
        return sum(self.tensors)


NO_BUFFERS = StageBuffers()


def stage_buffers(wl: Workload, par: ParallelConfig, m: int, stage: int,
                  flight: tuple[int, ...], stream_bytes: int,
                  output_bytes: int = 0) -> StageBuffers:
    """Pipeline rank ``stage``'s buffers with ``m`` micro-batches per step, ``flight[c]`` of
    them in flight on its chunk ``c`` at its peak (``chunks_in_flight``), ``stream_bytes`` one
    micro-batch's stage input (= output, = their gradients) on this rank. Per chunk ``c`` (the
    virtual stage ``s = c * pp + stage`` of ``S = pp * vpp``), from the module docstring:

    - with a previous stage (s > 0): ``m`` input buffers, ``f`` of them the walk's saved
      inputs, and the previous backward's input gradient where ``m > f``:
      ``(m - f + 1) b`` in the step (``0 b`` more where ``m <= f``), ``m b`` at the
      optimizer step;
    - with a next stage (s < S - 1): ``m`` gradient buffers and the kept outputs:
      ``(m + f - 1) b`` in the step (``m`` and ``f - 1`` at a forward, ``m - 1`` and ``f``
      at a backward), ``m b`` at the optimizer step;
    - the last stage (s = S - 1), ``output_bytes`` its output of one micro-batch (``o``):
      ``(f - 1) o`` kept in the step, ``o`` more at a backward (``output``) and at a forward
      but the step's first, up to its loss (``previous``, where ``m > 1``).
    """
    if wl.pipeline_buffers is PipelineBuffers.NONE or par.pp * par.vpp == 1:
        return NO_BUFFERS
    last = par.pp * par.vpp - 1
    count = in_step = at_step = output = 0
    for c, f in enumerate(flight):
        s = c * par.pp + stage
        if s == last:
            in_step += max(f - 1, 0) * output_bytes
            output = output_bytes
        if s > 0:
            count += m
            in_step += (m - f + 1 if m > f else 0) * stream_bytes
            at_step += m * stream_bytes
        if s < last:
            count += m
            in_step += max(m + f - 1, 0) * stream_bytes
            at_step += m * stream_bytes
    return StageBuffers((stream_bytes,) * count, in_step, at_step, output,
                        output if m > 1 else 0)
