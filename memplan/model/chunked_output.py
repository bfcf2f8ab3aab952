"""torchtune's chunked output and cross-entropy (``LossImpl.TORCHTUNE_CHUNKED``): the head
of ``memplan.model.head`` when the model returns its logits in ``loss_chunks`` chunks.

torchtune 0.6.1's ``TransformerDecoder.chunked_output`` (torchtune/modules/transformer.py)
applies the output projection to each of ``h.chunk(n, dim=1)`` and returns the list of
compute-dtype logits chunks; the recipe holds that list while ``CEWithChunkedOutputLoss``
(torchtune/modules/loss/ce_chunked_output_loss.py) upcasts one chunk at a time
(``logits.float()``) and runs ``F.cross_entropy(..., reduction="sum")`` on it, then drops it
(``del logits``) before the backward. Nothing is checkpointed, so autograd keeps, per chunk:
the fp32 log-softmax output (``log_softmax`` saves its result; the upcast saves nothing),
nll_loss's fp32 total weight, and the projection's input (a view of the final norm's output;
with a micro-batch of more than one sequence the chunk along the sequence is not contiguous,
so the matmul saves a copy of it, and the labels' chunks are copies too, which nll_loss
saves). In all, the log-softmax output of every token in fp32: what an unchunked fp32 loss
saves; the chunks change only what is alive beside it.

Per micro-batch on one rank, T tokens in chunks of c = ceil(T / n) (``head.loss_chunk_tokens``),
V the vocabulary rows, e the compute dtype's bytes, in bytes. Autocast is not modelled
(torchtune runs its models in one dtype): ``parallel.validate`` refuses it.
"""

from __future__ import annotations

from memplan.model.dims import FP32_BYTES, INDEX_BYTES, Dims, Term
from memplan.spec import ModelSpec
from memplan.units import ceil_div
from memplan.workload import LossImpl, Workload

# the division's saved divisor: ``(labels != ignore_index).sum()``, an int64 scalar
_COUNT_BYTES = 8


def torchtune_chunked(wl: Workload) -> bool:
    return wl.loss_impl is LossImpl.TORCHTUNE_CHUNKED


def _chunk(wl: Workload, dm: Dims) -> tuple[int, int]:
    """(tokens per chunk, chunks), as ``torch.chunk`` splits the tokens."""
    size = ceil_div(dm.tokens, wl.loss_chunks)
    return size, ceil_div(dm.tokens, size)


def _copied(wl: Workload, dm: Dims) -> bool:
    """Whether each chunk along the sequence is a strided view that ``reshape`` copies:
    more than one sequence in the micro-batch and more than one chunk."""
    return dm.b > 1 and _chunk(wl, dm)[1] > 1


def batch_terms(wl: Workload, dm: Dims) -> list[Term]:
    """The targets, their chunks' copies (saved by each nll_loss when ``_copied``), and the
    scalars: the loss, nll_loss's fp32 total weight per chunk and the int64 count of labels
    the sum is divided by (saved by the division)."""
    chunks = _chunk(wl, dm)[1]
    copies = [Term("loss.label_chunks", dm.tokens * INDEX_BYTES)] if _copied(wl, dm) else []
    return [Term("loss.targets", dm.tokens * INDEX_BYTES), *copies,
            Term("loss.scalars", (1 + chunks) * FP32_BYTES + _COUNT_BYTES)]


def forward_extra_bytes(wl: Workload, dm: Dims) -> int:
    """At the last chunk's log-softmax, beyond everything saved (all chunks' log-softmax
    outputs included): every chunk's logits in the compute dtype, held by the model's output,
    and the last chunk's fp32 upcast (none in fp32: ``.float()`` returns the tensor itself)."""
    chunk = _chunk(wl, dm)[0]
    upcast = chunk * dm.vocab_shard * FP32_BYTES if dm.e < FP32_BYTES else 0
    return dm.tokens * dm.vocab_shard * dm.e + upcast


def loss_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims, vocab_grad_bytes: int) -> int:
    """The worst moment of the head's backward beyond everything saved (``head_terms``).

    Autograd runs the nodes made last first: every chunk's loss (made after all the
    projections) before any projection. Per chunk, nll_loss's backward makes the fp32
    gradient of its log-softmax output (L = c V 4 bytes), log_softmax's backward the fp32
    gradient of its input (L) and frees the saved output, the upcast's backward casts it to
    the compute dtype (G = c V e; in fp32 the gradient itself, G = L), which waits in the
    projection's input buffer. Then each projection's backward makes its chunk's input
    gradient (I = c h e) and weight gradient (W, ``vocab_grad_bytes``) and frees its G.
    Autograd sums the weight gradients in the weight's input buffer: from the second chunk on
    the buffer, the chunk's gradient and their sum (3 W) exist at once; the input gradients
    wait for the split's backward. With one sequence per micro-batch the chunks' inputs are
    views of the final norm's output, kept until the last is released; with copies each is
    freed as its gradient is made."""
    chunk, chunks = _chunk(wl, dm)
    low = chunk * dm.vocab_shard * FP32_BYTES
    grad = chunk * dm.vocab_shard * dm.e if dm.e < FP32_BYTES else low
    grad_in, w = chunk * spec.hidden_size * dm.e, vocab_grad_bytes

    def inputs(j: int) -> int:  # input gradients of j chunks, less the copies they free
        return 0 if _copied(wl, dm) else j * grad_in

    # the loss of the j-th chunk run (0-based): its two fp32 gradients beside the earlier
    # chunks' G, their log-softmax outputs freed
    worst = max(j * (grad - low) + 2 * low for j in range(chunks))
    every = dm.tokens * dm.vocab_shard  # all the log-softmax outputs freed, all G waiting
    before = every * ((dm.e if dm.e < FP32_BYTES else FP32_BYTES) - FP32_BYTES)
    for k in range(1, chunks + 1):
        summed = w if k > 1 else 0  # the earlier chunks' sum, in the buffer
        worst = max(worst,
                    before - (k - 1) * grad + inputs(k - 1) + summed + grad_in + w,
                    before - k * grad + inputs(k) + (3 * w if k > 1 else w))
    return worst


def linear_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims, vocab_grad_bytes: int) -> int:
    """After the last chunk's projection, every log-softmax output freed, beyond the final
    norm's saved terms (its output included): the last sum of the weight gradients (3 W
    with more than one chunk); the chunks' input gradients replace the final norm's output
    (or its copies), both freed by then."""
    chunks = _chunk(wl, dm)[1]
    return (3 if chunks > 1 else 1) * vocab_grad_bytes


__all__ = ["batch_terms", "forward_extra_bytes", "linear_backward_bytes",
           "loss_backward_bytes", "torchtune_chunked"]
