"""The per-micro-batch terms every stage of one estimate shares, as plain data.

``stage_terms`` assembles them from the formulas and the blocks (rope tables, the embedding's
and the head's saved terms, the head block with its loss, final norm and the training loop's
held logits, the loop's batch, the layer kinds the stages hold);
``memplan.model.memo`` caches it per spec, workload and dims, beside it. All sizes are int
bytes for one rank and one micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from memplan.model import attention, embedding, head, loss_in_call
from memplan.model.dims import Dims, Term, total
from memplan.model.embedding import EmbeddingFixed
from memplan.model.head import HeadBlock
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
    mask: int  # the causal (and window) mask alive through the forward when not saved
    embedding: EmbeddingFixed  # the embedding's bytes on a first stage, its gradients not
    #                            yet set (``EmbeddingBlock.fixed``)
    head_block: HeadBlock  # the head's bytes on a last stage, its gradients not yet set
    #                        (``HeadBlock.of``: its final norm, projection, loss, held logits)
    loss_reduce: int  # a loss that runs the head's backward itself (``head.in_loss``): its
    #                   last chunk's moment but the reduce's own bytes; 0 for any other loss
    kinds: dict[LayerKey, LayerKind]  # every layer kind the estimate's stages hold
    moment_params: dict[LayerKey, tuple[int, ...]]  # parameters whose gradients exist at
    #                                                 each backward moment of a kind


def stage_terms(spec: ModelSpec, wl: Workload, dm: Dims, ep: int | ExpertSplit,
                keys: Iterable[LayerKey],
                kind_of: Callable[..., LayerKind] = layer_kind,
                groups_of: Callable[..., dict[str, int]] = grad_group_params) -> StageTerms:
    """The terms of ``spec`` under ``wl`` at ``dm``, with the layer kinds of ``keys`` (``ep``:
    the expert-parallel degree their gradient groups are split by). ``kind_of`` and
    ``groups_of``: ``layer_kind`` and ``grad_group_params``, or cached versions of them."""
    saved_mask = attention.mask_terms(spec, wl, dm)
    window_saved = attention.window_mask_terms(spec, wl, dm)
    rope = tuple(attention.rope_terms(spec, wl, dm) + saved_mask + window_saved
                 + attention.positions_terms(wl, dm))
    embed, head_terms = tuple(embedding.embedding_terms(spec, dm)), tuple(head.head_terms(
        spec, wl, dm))
    batch = head.batch_terms(wl, dm)
    kinds = {key: kind_of(spec, wl, dm, *key) for key in keys}
    first = next(iter(kinds.values()), None)
    if first is not None and dm.adapters is not None and wl.recompute is not Recompute.FULL:
        embed += tuple(frozen_input_terms(spec, dm, first.terms, embed))
    return StageTerms(
        dm=dm, rope=rope, embed=embed, head=head_terms, rope_bytes=total(rope),
        embed_bytes=total(embed), head_bytes=total(head_terms), batch_bytes=total(batch),
        targets_bytes=batch[0].size_bytes,
        # the masks live through the forward (the model's forward's, to its return:
        # HeadBlock.mask_released); with recompute the layers' are saved (a term)
        mask=((0 if saved_mask else attention.causal_mask_bytes(spec, wl, dm))
              + (0 if window_saved else attention.window_mask_bytes(spec, wl, dm))
              # a window mask no layer reads: never saved
              + attention.unused_window_mask_bytes(spec, wl, dm)
              # interleaved RoPE's tables where no layer saves them: a local too
              + attention.rope_local_bytes(spec, wl, dm)),
        embedding=embedding.EmbeddingBlock().fixed(spec, wl, dm),
        head_block=_head_of(spec, wl, dm, list(head_terms)),
        loss_reduce=loss_in_call.last_chunk_bytes(spec, wl, dm, 0) if head.in_loss(wl) else 0,
        kinds=kinds,
        moment_params={key: moment_params(groups_of(spec, dm.tp, ep, key[0], *key[2:]), kind)
                       for key, kind in kinds.items()})


def _head_of(spec: ModelSpec, wl: Workload, dm: Dims, terms: list[Term]) -> HeadBlock:
    """The head of every last stage (``HeadBlock.of``); a loss that runs each chunk's head
    backward inside its call (``head.in_loss``) holds what ``loss_in_call`` counts in its
    forward instead of a rerun chunk's."""
    extra = loss_in_call.forward_extra_bytes(spec, wl, dm) if head.in_loss(wl) else None
    return HeadBlock.of(spec, wl, dm, terms, extra)
