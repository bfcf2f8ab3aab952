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

Per micro-batch on one rank, T = b s tokens in chunks of c = b ceil(s / n) tokens (``_chunk``),
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
    """(tokens in the largest chunk, chunks), as ``h.chunk(n, dim=1)`` splits each sequence
    of s tokens: chunks of ceil(s / n) of every sequence, the last smaller (fewer than n
    chunks when n does not divide s evenly enough)."""
    size = ceil_div(dm.s, wl.loss_chunks)
    return dm.b * size, ceil_div(dm.s, size)


def _chunk_tokens(wl: Workload, dm: Dims) -> list[int]:
    """Tokens of each chunk, in the order autograd runs their backward: the last first."""
    size, chunks = _chunk(wl, dm)
    return [dm.tokens - (chunks - 1) * size] + [size] * (chunks - 1)


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
    last = _chunk_tokens(wl, dm)[0]
    upcast = last * dm.vocab_shard * FP32_BYTES if dm.e < FP32_BYTES else 0
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
    v, h, w = dm.vocab_shard, spec.hidden_size, vocab_grad_bytes
    grad_e = dm.e if dm.e < FP32_BYTES else FP32_BYTES  # G's bytes per element
    worst, freed = 0, 0  # freed: log-softmax outputs released less the G made so far
    for c in _chunk_tokens(wl, dm):
        # its two fp32 gradients beside the earlier chunks' G, their outputs freed
        worst = max(worst, 2 * c * v * FP32_BYTES - freed)
        freed += c * v * (FP32_BYTES - grad_e)
    grads, summed = 0, 0  # input gradients made (less copies freed); weight grads summed
    for k, c in enumerate(_chunk_tokens(wl, dm)):
        grad_in = c * h * dm.e
        worst = max(worst, grads + summed + grad_in + w - freed)  # its projection
        freed += c * v * grad_e  # its G freed
        grads += 0 if _copied(wl, dm) else grad_in
        worst = max(worst, grads + (3 * w if k else w) - freed)  # its weight gradient summed
        summed = w
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
