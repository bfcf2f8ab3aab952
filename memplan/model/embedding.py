"""The embedding block (first pipeline stage): token (and learned position) embedding, and
its backward, where the stage's last gradients are made."""

from __future__ import annotations

from typing import NamedTuple

from memplan.model.dims import INDEX_BYTES, Dims, Term, residual_dropout_mask
from memplan.model.moments import Event
from memplan.spec import ModelSpec, PositionKind


def embedding_terms(spec: ModelSpec, dm: Dims) -> list[Term]:
    """Token ids (saved by the embedding), position ids for learned positions (one row shared
    by the batch) and the dropout mask."""
    terms = [Term("embedding.ids", dm.tokens * INDEX_BYTES)]
    if spec.position is PositionKind.LEARNED:
        terms.append(Term("embedding.position_ids", dm.s * INDEX_BYTES))
    return terms + residual_dropout_mask("embedding", spec, dm)


def embedding_backward_extra(vocab_grad: int, embed_grads: int, *, tied: bool,
                             main_grads: bool, incoming: int, vocab_final: int,
                             positions_dense: int = 0) -> int:
    """Bytes beyond all gradients at the embedding's backward (first stage). Its dense
    gradient (compute dtype) is made from the gradient of its output (``incoming``, still
    alive); a tied head's gradient waits beside it and the two are summed (3 copies, then the
    sum becomes the gradient); with fp32 main gradients the compute-dtype gradient lives until
    it has been added into the fp32 one. ``vocab_final``: the token embedding's gradient as
    held (fp32 main gradient, shard); learned positions made theirs just before: with fp32
    main gradients their dense compute-dtype gradient (``positions_dense``) lives beside its
    fp32 copy then, the token embedding's gradient not made yet (traced; the peak only when
    the position table is larger than the vocabulary's)."""
    if tied and main_grads:  # 3 copies before the fp32 main gradient, or the sum beside it
        after = max(3 * vocab_grad - embed_grads, vocab_grad)
    elif tied:
        after = 2 * vocab_grad
    else:
        after = vocab_grad if main_grads else 0
    # while the dense gradient is made, the final gradient (or the sum) does not exist yet
    dense = (vocab_grad if tied else 0) + vocab_grad + incoming - vocab_final
    positions = (vocab_grad if tied else 0) + positions_dense + incoming - vocab_final
    return max(after, dense, positions if main_grads and positions_dense else 0)


class EmbeddingBlock(NamedTuple):
    """The first stage's embedding in backward, one micro-batch, one rank, bytes; elsewhere
    only ``freed_before``."""

    grads: int = 0  # the embedding's gradients as held
    extra: int = 0  # at its backward, beyond its gradient: a tied head's pending gradient and
    #                 the sum; the compute-dtype copy beside an fp32 main grad
    freed_before: int = 0  # of the stage's rest (rope tables, a checkpointed mask, dropout
    #                        mask): freed before the stage's last gradient

    def backward_events(self, held_grads: int, all_grads: int,
                        beside: int) -> tuple[Event, ...]:
        """From ``held_grads`` bytes of gradients (a tied head's pending one included) to all
        the stage's (``all_grads``), its saved bytes freed first; ``beside``: what the
        data-parallel mechanism holds at its backward."""
        return (Event("embedding.release", all_grads - held_grads - self.freed_before, None),
                Event("embedding.backward", 0, self.extra + beside))
