"""The per-micro-batch terms every stage of one estimate shares, as plain data.

``stage_terms`` assembles them from the formulas (rope tables, embedding, head, loss, final
norm, the training loop's batch and held logits, the layer kinds the stages hold);
``memplan.model.memo`` caches it per spec, workload and dims, beside it. All sizes are int
bytes for one rank and one micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from memplan.model import attention, embedding, head, norm
from memplan.model.dims import Dims, Term, total
from memplan.model.layer import (
    LayerKind,
    frozen_input_terms,
    grad_group_params,
    layer_kind,
    moment_params,
)
from memplan.model.stage_parts import LayerKey
from memplan.parallel import ExpertSplit
from memplan.spec import ModelSpec
from memplan.workload import Recompute, Workload


class StageTerms(NamedTuple):
    """What every stage of one estimate shares for one micro-batch."""

    dm: Dims
    rope: tuple[Term, ...]  # rope tables and a mask saved with recompute: per model chunk
    embed: tuple[Term, ...]  # the embedding's saved terms (first stage)
    head: tuple[Term, ...]  # the final norm's, head's and loss's saved terms (last stage)
    rope_bytes: int
    embed_bytes: int
    head_bytes: int
    batch_bytes: int  # the batch a training loop holds (ids and targets)
    targets_bytes: int
    loss_fwd: int  # the loss's forward beyond what is saved (``head.forward_extra_bytes``)
    step_held: int  # logits a loop holds into the next step (``head.step_held_bytes``)
    upcast: int  # ``head.upcast_bytes``
    mask: int  # the causal (and window) mask alive through the forward when not saved
    final_norm_extra: int  # the final norm's forward transient
    final_norm_bytes: int  # all the final norm saves
    final_norm_bwd_saved: int  # ... of it, what is saved when its backward runs
    final_norm_bwd: int  # gradients in flight inside the final norm's backward
    head_loss_bwd: int  # the loss's backward beyond what is saved (the rank's vocabulary)
    head_linear_bwd: int  # the head projection's backward
    kinds: dict[LayerKey, LayerKind]  # every layer kind the estimate's stages hold
    moment_params: dict[LayerKey, tuple[int, ...]]  # parameters whose gradients exist at
    #                                                 each backward moment of a kind


def stage_terms(spec: ModelSpec, wl: Workload, dm: Dims, ep: int | ExpertSplit, keys: Iterable[LayerKey],
                kind_of: Callable[..., LayerKind] = layer_kind,
                groups_of: Callable[..., dict[str, int]] = grad_group_params) -> StageTerms:
    """The terms of ``spec`` under ``wl`` at ``dm``, with the layer kinds of ``keys`` (``ep``:
    the expert-parallel degree their gradient groups are split by). ``kind_of`` and
    ``groups_of``: ``layer_kind`` and ``grad_group_params``, or cached versions of them."""
    saved_mask = attention.mask_terms(wl, dm)
    rope = tuple(attention.rope_terms(spec, wl, dm) + saved_mask)
    embed, head_terms = tuple(embedding.embedding_terms(spec, dm)), tuple(head.head_terms(
        spec, wl, dm))
    batch = head.batch_terms(wl, dm)
    vocab_grad = dm.vocab_shard * spec.hidden_size * dm.e  # the head's weight gradient
    final_norm, final_norm_bwd_saved = norm.final_saved_bytes(spec, wl, dm)
    kinds = {key: kind_of(spec, wl, dm, *key) for key in keys}
    first = next(iter(kinds.values()), None)
    if first is not None and dm.adapters is not None and wl.recompute is not Recompute.FULL:
        embed += tuple(frozen_input_terms(spec, dm, first.terms, embed))
    return StageTerms(
        dm=dm, rope=rope, embed=embed, head=head_terms, rope_bytes=total(rope),
        embed_bytes=total(embed), head_bytes=total(head_terms), batch_bytes=total(batch),
        targets_bytes=batch[0].size_bytes, loss_fwd=head.forward_extra_bytes(spec, wl, dm),
        step_held=head.step_held_bytes(wl, dm), upcast=head.upcast_bytes(spec, wl, dm),
        # the causal mask lives through the forward; with recompute it is saved (a term)
        mask=((0 if saved_mask else attention.eager_mask_bytes(wl, dm))
              + attention.window_mask_bytes(spec, wl, dm)),
        final_norm_extra=norm.final_forward_transient(spec, wl, dm),
        final_norm_bytes=final_norm, final_norm_bwd_saved=final_norm_bwd_saved,
        final_norm_bwd=norm.final_backward_bytes(spec, wl, dm),
        head_loss_bwd=head.loss_backward_bytes(spec, wl, dm, vocab_grad),
        head_linear_bwd=head.linear_backward_bytes(spec, wl, dm, vocab_grad),
        kinds=kinds,
        moment_params={key: moment_params(groups_of(spec, dm.tp, ep, key[0]), kind)
                       for key, kind in kinds.items()})
