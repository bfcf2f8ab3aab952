"""A chunked loss that runs each chunk's backward inside the loss call (``head.in_loss``,
``ChunkBackward.IN_LOSS``): what torchtitan 0.3's ``ChunkedLossWrapper.__call__``
(components/loss.py) holds on one rank of the last stage, in bytes.

The model returns the final norm's output; the wrapper splits it and the targets along the
sequence, and for each chunk runs ``lm_head``, the loss and its backward at once: the chunk's
input gradient is added into one fp32 buffer, the head's weight gradient summed over the chunks
whole (the head's unit keeps its sync off until the last chunk), the last chunk's reduce-scatter
sharding it. The buffer, cast to the output's dtype, is saved for the model's backward
(``head.head_terms``: ``loss.input_grad``), which starts at the final norm.

Compiled (``Workload.compile_loss``: compile.components "loss", whose ``BaseLoss._maybe_compile``
wraps the wrapper's inner ``CrossEntropyLoss``, so each chunk's ``cross_entropy_loss`` runs as
one Inductor graph; ``lm_head`` is not compiled), a chunk's loss is the unchunked compiled
loss's (``memplan.model.head``) on the chunk: it saves the chunk's logits (held by the wrapper's
``logits`` anyway) and two fp32 numbers per token, makes no logits-sized buffer in forward, and
its backward makes one more fp32 number per token, then the logits' gradient in the compute
dtype in one kernel (traced: tests/traced/test_torchtitan_compiled_loss.py, the wrapper on
Inductor on CPU). On logits split over the vocabulary (TP's ``lm_head`` with loss parallel) a
chunk's is the compiled ``_LossParallelCrossEntropy`` (``memplan.model.head``), whose forward's
kernel is its most (traced there too, TP 2 on the fake process group).
"""

from __future__ import annotations

from memplan.model.dims import FP32_BYTES, INDEX_BYTES, MASK_BYTES, Dims
from memplan.model.head import head_weight, logit_bytes, loss_chunk_tokens
from memplan.spec import ModelSpec
from memplan.workload import LossImpl, Workload


def forward_extra_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """The loss call's most beyond what is saved, but for its last chunk (``last_chunk_bytes``):
    what it holds throughout and the larger of a later chunk's two moments."""
    return held_bytes(spec, wl, dm) + max(_chunk_moments(spec, wl, dm))


def held_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """What ``ChunkedLossWrapper.__call__`` holds through its chunks beyond what is saved: the
    chunks of the final norm's output and of the targets, ``contiguous()`` copies where the
    micro-batch has more than one sequence (a split along the sequence of one is a view), the
    input gradients' fp32 sum (``GradAccumulator``, ``dtype=torch.float32``), the loss's
    fp32 running total. (The final norm's output itself is the saved term it replaces.)"""
    copies = (dm.linear_rows * spec.hidden_size * dm.stream_e + dm.tokens * INDEX_BYTES
              if dm.b > 1 else 0)
    return copies + dm.linear_rows * spec.hidden_size * FP32_BYTES + FP32_BYTES


def accumulator_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """The head's weight gradient summed over the chunks, whole (the data-parallel sync is
    off until the last chunk: FSDP2 keeps it unsharded, ``FSDPParam.
    to_accumulated_grad_if_needed``), in the gradients' (reduce) dtype."""
    return head_weight(spec, dm) * wl.precision.policy.grad_bytes


def _chunk_moments(spec: ModelSpec, wl: Workload, dm: Dims) -> tuple[int, int]:
    """A chunk's two moments beside the summed weight gradient (a later chunk's): its loss's
    (``_loss_moment``); its projection's backward (the logits and their gradient, the new
    weight gradient in the compute dtype, the chunk's input gradient)."""
    chunk = loss_chunk_tokens(wl, dm)[0]
    logits = chunk * dm.vocab_shard
    acc = accumulator_bytes(spec, wl, dm)
    linear = (acc + 2 * logits * dm.e + head_weight(spec, dm) * dm.e
              + chunk * spec.hidden_size * dm.stream_e)
    return acc + _loss_moment(spec, wl, dm, chunk), linear


def _loss_moment(spec: ModelSpec, wl: Workload, dm: Dims, chunk: int) -> int:
    """A chunk's loss at its most, beside its compute-dtype logits (the wrapper's ``logits``):

    eager, its backward: the log-softmax output, its gradient and the one it makes,
    logits-sized in the loss's dtype; on logits split over the vocabulary,
    ``_LossParallelCrossEntropy.backward``'s four (the saved log-probabilities,
    ``zeros_like``, ``exp`` and their sum), as ``head.loss_backward_bytes`` counts them beside
    the saved ones (traced: tests/traced/test_torchtitan_compiled_loss.py, TP 2);

    compiled (module docstring), on whole logits its backward: their gradient and three fp32
    numbers per token (the row max and log-sum-exp saved, the backward's own); on split
    logits its forward's kernel (``memplan.model.head``): the fp32 log-probabilities and the
    saved softmax less the one-hot targets, three fp32 numbers and a mask byte per token."""
    logits = chunk * dm.vocab_shard
    split = wl.loss_impl is LossImpl.TORCHTITAN and dm.vocab_shard < spec.vocab_size
    if wl.compile_loss and split:
        return logits * (dm.e + 2 * FP32_BYTES) + chunk * (3 * FP32_BYTES + MASK_BYTES)
    if wl.compile_loss:
        return 2 * logits * dm.e + 3 * chunk * FP32_BYTES
    return logits * dm.e + (4 if split else 3) * logits * logit_bytes(wl, dm)


def last_chunk_bytes(spec: ModelSpec, wl: Workload, dm: Dims, reduce_bytes: int) -> int:
    """The last chunk's moment where the sync is on again (``set_requires_gradient_sync(True,
    recurse=False)``): beyond what is saved, the loss call's holdings (``held_bytes``), the
    summed weight gradient copied into ``reduce_bytes`` (the data-parallel mechanism's
    reduce-scatter input and output shard), the chunk's logits and its input gradient."""
    chunk = loss_chunk_tokens(wl, dm)[0]
    return (held_bytes(spec, wl, dm) + accumulator_bytes(spec, wl, dm) + reduce_bytes
            + chunk * (dm.vocab_shard * dm.e + spec.hidden_size * dm.stream_e))
