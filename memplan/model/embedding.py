"""The embedding block (first pipeline stage): token (and learned position) embedding, and
its backward, where the stage's last gradients are made."""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import INDEX_BYTES, Dims, Term, residual_dropout_mask, total, whole_bytes
from memplan.model.moments import Event
from memplan.parallel import vocab_shard
from memplan.spec import ModelSpec, PositionKind, param_counts
from memplan.workload import Recompute, Workload


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


def made_vocab_grad(dm: Dims, vocab_grad: int, main_grads: bool) -> tuple[int, bool]:
    """(the embedding's dense gradient in the dtype it is made in, whether an fp32 main
    gradient is made from it), from ``vocab_grad``: its bytes in the compute dtype."""
    if dm.autocast:
        # the embedding is no autocast op: it reads the fp32 weight, its output and the
        # gradient it receives are fp32, and its dense gradient is made in fp32 directly (a
        # tied head's gradient too, once its cast's backward has upcast it)
        return vocab_grad // dm.e * dm.stream_e, False
    return vocab_grad, main_grads


class EmbeddingFixed(NamedTuple):
    """An embedding's bytes that its stage does not change (``EmbeddingBlock.fixed``)."""

    saved: int  # its saved terms (``saved``)
    kept: int  # of them, alive at its backward: the token ids (``backward_moments``)
    incoming: int  # the gradient of its output, alive while its dense gradient is made
    positions_dense: int  # learned positions' dense gradient in the stream dtype (0: none)


class EmbeddingBlock(NamedTuple):
    """The first stage's embedding in backward, one micro-batch, one rank, bytes; elsewhere
    only ``freed_before``."""

    grads: int = 0  # the embedding's gradients as held
    extra: int = 0  # at its backward, beyond its gradient: a tied head's pending gradient and
    #                 the sum; the compute-dtype copy beside an fp32 main grad
    freed_before: int = 0  # of the stage's rest (rope tables, a checkpointed mask, dropout
    #                        mask): freed before the stage's last gradient
    fresh: int = 0  # its token rows' new dense gradient as made, beside the one it is
    #                 added into where gradients accumulate (``sharding.accumulated_fresh``):
    #                 untied and without an fp32 main gradient (0 otherwise: not modelled)

    # --- the ``Block`` interface (``memplan.model.block``): per micro-batch on one rank of the
    # first stage, in bytes (``t``: the ranks that split the vocabulary,
    # ``ParallelConfig.vocab_divisor``; ``ep`` has no meaning here) ---

    name = "embedding"  # the token (and learned position) embedding

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims,
              recompute: Recompute) -> list[Term]:
        """``embedding_terms``: the token ids, learned positions' ids, the dropout mask.
        ``recompute`` applies to layers only: the embedding is never checkpointed by it."""
        return embedding_terms(spec, dm)

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        """Its saved terms, nothing beyond: its output is the residual stream the first layer
        reads, counted there as the stage's input."""
        return [Moment("embedding", total(embedding_terms(spec, dm)), 0)]

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """None: the embedding is never inside a checkpointed layer."""
        return []

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        """The token embedding's backward: its ids still saved (the position ids and dropout
        mask freed before), beyond its gradients the incoming gradient of its output
        (``embedding_backward_extra`` untied, without fp32 main gradients: what a tied head's
        pending gradient and an fp32 main gradient add depends on the stage, which
        ``memplan.model.stage`` passes it), its token rows' gradient just made."""
        ids = embedding_terms(spec, dm)[0].size_bytes
        vocab_grad = dm.vocab_shard * spec.hidden_size * dm.stream_e
        extra = embedding_backward_extra(
            vocab_grad, vocab_grad, tied=False, main_grads=False,
            incoming=dm.tokens * spec.hidden_size * dm.stream_e, vocab_final=vocab_grad)
        return [BackwardMoment("embedding", ids, extra, tuple(self.grad_groups(spec, 1, 1)),
                               dm.vocab_shard * spec.hidden_size)]

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """None: nothing of the embedding is rebuilt by layer recompute."""
        return []

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        """The token embedding's rows on this rank (ceil(V / t), ``vocab_shard``), then the
        learned position table (whole on every rank); ``count_stage_params`` lists these."""
        positions = param_counts(spec).position_embedding
        return ([vocab_shard(spec.vocab_size, t) * spec.hidden_size]
                + ([positions] if positions else []))

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        """(rows, h) of the token embedding on this rank, then (positions, h)."""
        h = spec.hidden_size
        positions = param_counts(spec).position_embedding
        return ([(vocab_shard(spec.vocab_size, t), h)]
                + ([(positions // h, h)] if positions else []))

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        """Learned positions' gradient first (their backward runs first), then the token
        embedding's (which a tied head's gradient is summed into)."""
        positions = param_counts(spec).position_embedding
        tokens = vocab_shard(spec.vocab_size, t) * spec.hidden_size
        return ({"position_embedding": positions} if positions else {}) | {
            "embedding": positions + tokens}

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """0: a lookup, no multiply-add (the step-time model counts none)."""
        return 0.0

    def on_stage(self, spec: ModelSpec, wl: Workload, dm: Dims, *, num_params: int,
                 per_param: Fraction, vocab_grad: int, main_grads: bool, tied: bool,
                 rope_bytes: int, fixed: EmbeddingFixed | None = None) -> EmbeddingBlock:
        """This embedding's backward on a first stage, read from its ``Block`` interface
        (``saved``, ``backward_moments``: ``fixed``, the same on every stage of an estimate,
        ``EmbeddingBlock.fixed``) and the stage's: its ``num_params`` parameters' gradients at
        ``per_param`` held bytes each; its token rows' gradient as made (``made_vocab_grad``
        of ``vocab_grad``, the compute-dtype bytes, with fp32 main gradients or not); a
        ``tied`` head's pending gradient summed into it. Freed before its backward: the rope
        tables and a checkpointed mask (``rope_bytes``, with the first layer's saved tensors),
        and of its own saved terms all but the token ids (the dropout mask, the position ids:
        learned positions' backward runs first)."""
        fixed = fixed or self.fixed(spec, wl, dm)
        vocab, main = made_vocab_grad(dm, vocab_grad, main_grads)
        grads = whole_bytes(num_params, per_param)
        extra = embedding_backward_extra(
            vocab, grads, tied=tied, main_grads=main, incoming=fixed.incoming,
            vocab_final=whole_bytes(vocab // dm.stream_e, per_param),
            positions_dense=fixed.positions_dense)
        # where gradients accumulate, the dense gradient is made beside the accumulated one
        # and AccumulateGrad adds it in (traced: DDP, a later micro-batch, 262,144 B)
        return EmbeddingBlock(grads, extra,  # (positional: built in every walk)
                              rope_bytes + fixed.saved - fixed.kept,  # freed_before
                              0 if tied or main else vocab)  # fresh

    def fixed(self, spec: ModelSpec, wl: Workload, dm: Dims) -> EmbeddingFixed:
        """What ``on_stage`` reads of the ``Block`` interface, the same on every first stage
        of an estimate (``memplan.model.stage_terms.StageTerms.embedding``)."""
        (moment,) = self.backward_moments(spec, wl, dm, Recompute.NONE)
        return EmbeddingFixed(
            saved=total(self.saved(spec, wl, dm, Recompute.NONE)), kept=moment.own_bytes,
            incoming=dm.tokens * spec.hidden_size * dm.stream_e,
            positions_dense=param_counts(spec).position_embedding * dm.stream_e)

    def backward_events(self, held_grads: int, all_grads: int,
                        beside: int) -> tuple[Event, ...]:
        """From ``held_grads`` bytes of gradients (a tied head's pending one included) to all
        the stage's (``all_grads``), its saved bytes freed first; ``beside``: what the
        data-parallel mechanism holds at its backward."""
        return (Event("embedding.release", all_grads - held_grads - self.freed_before, None),
                Event("embedding.backward", 0, self.extra + beside))
