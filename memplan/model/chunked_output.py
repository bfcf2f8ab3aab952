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

Compiled (``Workload.compile_loss``: torchtune's ``training.compile_loss`` replaces
``compute_cross_entropy`` with its ``torch.compile``, Inductor), each chunk's upcast and
cross-entropy is one graph, which ``min_cut_rematerialization_partition``
(torch/_functorch/partitioners.py, torch 2.13) splits: the fp32 upcast, the shifted logits and
their exponentials are fusible pointwise ops (``get_default_op_list``), recomputed in backward
from what is saved; the row max (``amax``) and the log of the sum of exponentials are
reductions, each T/V the size of its input, which ``ban_if_reduction`` (in ``solve_min_cut``)
saves rather than recompute; the chunk's logits, a graph input, are saved as they are
(recomputing from them is the cheapest cut). So per chunk: its logits in the compute dtype and
two fp32 numbers per token (traced: tests/traced/test_torchtune_compiled_loss.py, torchtune
0.6.1's own loss). Inductor fuses each reduction with its pointwise producers: the forward
makes no logits-sized buffer; the backward makes the chunk's logits gradient in one kernel
(the compute dtype) and frees the saved logits with it.

Per micro-batch on one rank, T = b s tokens in chunks of c = b ceil(s / n) tokens (``_chunk``),
V the vocabulary rows, e the compute dtype's bytes, in bytes. Autocast is not modelled
(torchtune runs its models in one dtype): ``parallel.validate`` refuses it.
"""

from __future__ import annotations

from memplan.model.dims import FP32_BYTES, INDEX_BYTES, Dims, Term, total
from memplan.spec import ModelSpec
from memplan.units import ceil_div
from memplan.workload import LossImpl, Workload

# the division's saved divisor: ``(labels != ignore_index).sum()``, an int64 scalar
_COUNT_BYTES = 8


def torchtune_chunked(wl: Workload) -> bool:
    return wl.loss_impl is LossImpl.TORCHTUNE_CHUNKED


def compiled(wl: Workload) -> bool:
    """torchtune's chunked loss with its cross-entropy compiled (``Workload.compile_loss``)."""
    return torchtune_chunked(wl) and wl.compile_loss


def loss_terms(wl: Workload, dm: Dims) -> list[Term]:
    """What every chunk's cross-entropy saves: eagerly its fp32 log-softmax output;
    compiled, its logits in the compute dtype (the graph's input: in fp32 ``.float()`` is the
    tensor itself) and the row max and log-sum of exponentials (fp32, one each per token)."""
    if not compiled(wl):
        return [Term("loss.log_softmax", dm.tokens * dm.vocab_shard * FP32_BYTES)]
    return [Term("loss.logits", dm.tokens * dm.vocab_shard * dm.e),
            Term("loss.row_stats", 2 * dm.tokens * FP32_BYTES)]


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
    # compiled, the backward of a sum needs no total weight: the partitioner saves none
    weights = 0 if compiled(wl) else _chunk(wl, dm)[1]
    copies = [Term("loss.label_chunks", dm.tokens * INDEX_BYTES)] if _copied(wl, dm) else []
    return [Term("loss.targets", dm.tokens * INDEX_BYTES), *copies,
            Term("loss.scalars", (1 + weights) * FP32_BYTES + _COUNT_BYTES)]


def forward_extra_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """At the last chunk's log-softmax, beyond everything saved (all chunks' log-softmax
    outputs included): every chunk's logits in the compute dtype, held by the model's output,
    and the last chunk's fp32 upcast (none in fp32: ``.float()`` returns the tensor itself).
    Compiled, the logits are saved (``loss_terms``) and the chunk's kernels make only its fp32
    loss beside them, before it is added to the total; the forward's worst is then the last
    chunk's projection when the chunks' inputs are copies (``_copied``): the final norm's
    output, which the model holds until it returns, beside every chunk's logits and input
    copy, before the loss has made its per-row statistics, its labels' copies and scalars."""
    if compiled(wl):
        if not _copied(wl, dm):
            return FP32_BYTES
        not_yet = total(loss_terms(wl, dm)[1:] + batch_terms(wl, dm)[1:])
        return max(FP32_BYTES, dm.tokens * spec.hidden_size * dm.e - not_yet)
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
    freed as its gradient is made.

    Compiled, each chunk's backward is one kernel: it makes G from the saved logits and
    statistics, and the saved logits (G's size) are freed as it returns: G alone beside
    what is saved, and nothing freed net."""
    v, h, w = dm.vocab_shard, spec.hidden_size, vocab_grad_bytes
    grad_e = dm.e if dm.e < FP32_BYTES else FP32_BYTES  # G's bytes per element
    saved_e = dm.e if compiled(wl) else FP32_BYTES  # a chunk's saved bytes per element
    worst, freed = 0, 0  # freed: saved chunk tensors released less the G made so far
    for c in _chunk_tokens(wl, dm):
        # eagerly its two fp32 gradients, compiled its G, beside the earlier chunks' G
        made = c * v * (grad_e if compiled(wl) else 2 * FP32_BYTES)
        worst = max(worst, made - freed)
        freed += c * v * (saved_e - grad_e)
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


__all__ = ["batch_terms", "compiled", "forward_extra_bytes", "linear_backward_bytes",
           "loss_backward_bytes", "loss_terms", "torchtune_chunked"]
