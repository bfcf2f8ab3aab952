"""Layer kinds of a pipeline stage and the walks through one micro-batch's forward and backward.

A stage's layers come in few kinds (dense or MoE, and their recompute policy); each kind's saved
terms and local peaks are built once. The walks then visit the layers in execution order, in runs
of identical layers, adding what is alive before each layer to its local peaks: the forward as
saved bytes accumulate, the backward as they are freed and gradients appear.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby

from memplan import activations as act
from memplan import moments as mom
from memplan.spec import ModelSpec
from memplan.workload import Recompute, Workload


def layer_recompute(wl: Workload, position: int) -> Recompute:
    """Full recompute of k of a stage's layers applies to its first k (Megatron-LM's 'block')."""
    if wl.recompute is Recompute.FULL and wl.recompute_layers is not None:
        return Recompute.FULL if position < wl.recompute_layers else Recompute.NONE
    return wl.recompute


def layer_keys(spec: ModelSpec, wl: Workload, layers: list[int]) -> list[tuple[bool, Recompute]]:
    """(MoE layer?, recompute policy) of each layer of a stage, in order."""
    if spec.moe is None and wl.recompute_layers is None:
        return [(False, wl.recompute)] * len(layers)
    return [(spec.is_moe_layer(i), layer_recompute(wl, pos)) for pos, i in enumerate(layers)]


@dataclass(frozen=True)
class LayerKind:
    """What one layer of a kind (MoE or dense, recompute policy) holds for one micro-batch."""

    terms: tuple[act.Term, ...]
    saved_bytes: int
    moments: tuple[mom.BackwardMoment, ...]
    forward_peak_bytes: int  # largest alive + transient inside its forward


@lru_cache(maxsize=4096)
def layer_kind(spec: ModelSpec, wl: Workload, dm: act.Dims, moe: bool,
                policy: Recompute) -> LayerKind:
    """Built once per distinct (spec, workload, per-rank dims, layer kind): a planner's many
    layouts share them."""
    terms = tuple(act.layer_terms(spec, wl, dm, moe_layer=moe, recompute=policy))
    moments = mom.layer_backward_moments(spec, wl, dm, moe_layer=moe, recompute=policy)
    forward = mom.layer_forward_moments(spec, wl, dm, moe_layer=moe, recompute=policy)
    return LayerKind(terms, act.total(terms), tuple(moments),
                      max(m.alive_bytes + m.transient_bytes for m in forward))


def merge_terms(groups: tuple[tuple[int, tuple[act.Term, ...]], ...]) -> tuple[act.Term, ...]:
    """Sum ``count`` copies of each term list by name."""
    sums: dict[str, int] = {}
    for count, terms in groups:
        for term in terms:
            sums[term.name] = sums.get(term.name, 0) + count * term.size_bytes
    return tuple(act.Term(name, size) for name, size in sums.items())


@dataclass(frozen=True)
class Walk:
    """Inputs of the backward walk of one stage (one micro-batch, bytes)."""

    runs: list[tuple[LayerKind, int, int, int]]  # (kind, grads, grads before its peak, count)
    other_bytes: int  # activations of the other micro-batches in flight, kept throughout
    head_saved: int  # final norm and loss terms (last stage)
    rest_saved: int  # rope tables, embedding ids: alive until the step's backward ends
    loss_bwd: int
    head_linear_bwd: int  # logits grad in the compute dtype + the head's weight grad
    head_main_bwd: int  # fp32 main gradients: at the head's fp32 copy, beyond what is saved
    #                         below the final norm (its saved tensors but the output, the input
    #                         gradient, the compute-dtype and fp32 weight gradients)
    head_grads: int
    embed_grads: int
    tied_extra: int  # at the embedding's backward, beyond its gradient: a tied head's pending
    #                  gradient and the sum; the compute-dtype copy beside an fp32 main grad
    tied_pending: int  # a tied head's weight gradient, held until the embedding's backward
    grad_buffer: int  # ZeRO-2/3 unsharded gradients awaiting reduce-scatter, at most
    unsharded_ratio: float  # unsharded / held gradient bytes (the ZeRO-2 shard degree)
    final_norm_saved: int  # last stage: the final norm's saved bytes
    final_norm_bwd: int  # last stage: gradients in flight inside the final norm's backward
    final_norm_all: int = 0  # last stage: all the final norm saves (alive at the head's backward)
    held_reduce_input: int = 0  # FSDP2: a unit's reduce-scatter input, held (beside its shard)
    #                             until the next unit's reduce-scatter
    unsharded_dtype: float = 1.0  # FSDP2: bytes of an unsharded gradient (the weights' dtype)
    #                               per byte of its reduce dtype
    gathered_in_block: int = 0  # ZeRO-3 gathered weights while a block's backward runs
    gathered_at_loss: int = 0  # ... at the loss, the head and the embedding
    freed_before_embedding: int = 0  # of ``rest_saved``: freed before the stage's last
    #                                   gradient (rope tables, a checkpointed mask, dropout mask)


def forward_peak(runs: list[tuple[LayerKind, int, tuple[int, ...], int]], before: int,
                  head_saved: int, final_norm: int, loss_extra: int,
                  gathered: tuple[int, int] = (0, 0)) -> int:
    """Largest activation bytes alive during one micro-batch's forward on a stage.

    ``before``: bytes alive before its first layer (other micro-batches in flight, rope tables,
    embedding ids). Inside a run of identical layers the bytes only grow, so its last layer
    holds the run's peak. Then the final norm and the loss (last stage).
    """
    in_block, at_loss = gathered  # ZeRO-3 weights gathered at those moments
    acts, peak = before, before
    for kind, _, _, n in runs:
        peak = max(peak, acts + (n - 1) * kind.saved_bytes + kind.forward_peak_bytes + in_block)
        acts += n * kind.saved_bytes
    if head_saved:
        peak = max(peak, acts + final_norm + at_loss, acts + head_saved + loss_extra + at_loss)
    return peak


def backward_peak(w: Walk, grads_prior: int, grads_total: int) -> int:
    """Largest bytes alive (activations + gradients + transients) during one backward.

    ``grads_prior`` is what exists when it starts: 0 for a step's only micro-batch, all
    gradients when earlier micro-batches produced them (they then accumulate in place).
    Layers are walked last to first in runs of identical layers; within a run the bytes
    alive change by the same amount per layer, so the run's largest moment is at one end.
    """
    growing = grads_prior == 0
    acts = (w.other_bytes + w.rest_saved + w.head_saved
            + sum(k.saved_bytes * n for k, _, _, n in w.runs))
    grads = grads_prior
    peak = w.gathered_at_loss + max(acts + grads + w.loss_bwd,
                                    acts - w.head_saved + w.final_norm_all + grads
                                    + w.head_linear_bwd,
                                    acts - w.head_saved + grads + w.head_main_bwd)
    acts -= w.head_saved
    grads += w.head_grads if growing else 0
    produced = w.head_grads  # this backward's gradients so far (the ZeRO buffer holds them)

    def buffer(made: int) -> int:
        # Gradients not yet reduce-scattered are held unsharded instead of as this rank's
        # shard: the extra is the unsharded size minus the shard they will become.
        waiting = min(w.grad_buffer, int(made * w.unsharded_ratio))
        return waiting - int(waiting / w.unsharded_ratio) if w.unsharded_ratio > 1 else waiting

    held, done = w.held_reduce_input, 0  # blocks whose reduce-scatter input may still be held

    def root(made: int) -> int:
        # FSDP2's root (embedding, final norm, head) reduce-scatters at the end of backward:
        # until then its gradients are unsharded, in the weights' dtype
        return int(made * w.unsharded_ratio * w.unsharded_dtype) - made

    if w.final_norm_bwd:  # the head's weight gradient exists; the norm's own comes after
        peak = max(peak, acts + w.final_norm_saved + grads + w.tied_pending + w.final_norm_bwd
                   + (root(produced) if held else buffer(produced)) + w.gathered_at_loss)
    pending = w.tied_pending  # a tied head's weight grad waits for the embedding's
    root_held = root(w.head_grads) if held else 0
    for kind, layer_grads, moment_grads, n in reversed(w.runs):
        step_grads = layer_grads if growing else 0
        # Before the layer's backward its own saved bytes are part of ``acts``; each moment
        # counts what of them (or of their recomputation) is still alive.
        below = acts - kind.saved_bytes + grads + pending + w.gathered_in_block
        if held:
            # FSDP2: at each moment this unit's gradients so far exist unsharded (its shard
            # comes with its reduce-scatter), beside the previous unit's whole reduce input
            local = max(m.alive_bytes + m.transient_bytes
                        + int(min(w.grad_buffer, g * w.unsharded_ratio) * w.unsharded_dtype)
                        for m, g in zip(kind.moments, moment_grads))
            first_buffer = root_held + (held if done else 0)
            last_buffer = root_held + (held if done or n > 1 else 0)
        else:  # one buffer of the gradients made so far
            local = max(m.alive_bytes + m.transient_bytes + (g if growing else 0)
                        for m, g in zip(kind.moments, moment_grads))
            early = max(moment_grads)
            first_buffer = buffer(produced + early)
            last_buffer = buffer(produced + (n - 1) * layer_grads + early)
        first_moment = below + local + first_buffer
        last_moment = below + local + (n - 1) * (step_grads - kind.saved_bytes) + last_buffer
        peak = max(peak, first_moment, last_moment)
        acts -= n * kind.saved_bytes
        grads += n * step_grads
        produced += n * layer_grads
        done += n
    end_grads = grads_total if growing or grads_prior else grads
    end_buffer = (root(w.head_grads + w.embed_grads) + (held if done else 0) if held
                  else buffer(produced + w.embed_grads))
    return max(peak, acts - w.freed_before_embedding + end_grads + w.tied_extra + end_buffer
               + w.gathered_at_loss)


def runs_of(keys: list) -> list[tuple[object, int]]:
    """Run-length encoding of a list."""
    return [(key, len(list(group))) for key, group in groupby(keys)]


def first_positions(keys: list) -> dict:
    """Each distinct key with the position of its first occurrence."""
    if len(keys) and keys[0] == keys[-1] and keys.count(keys[0]) == len(keys):
        return {keys[0]: 0}
    out: dict = {}
    for pos, key in enumerate(keys):
        out.setdefault(key, pos)
    return out


@lru_cache(maxsize=1024)
def grad_group_params(spec: ModelSpec, t: int, ep: int, moe: bool) -> dict[str, int]:
    """Parameters on one rank of the groups whose gradients appear during a layer's backward."""
    h = spec.hidden_size
    norm = h * (2 if spec.norm_bias else 1)
    mult = 3 if spec.mlp.gated else 2
    if moe and spec.moe is not None:
        m = spec.moe
        ffn = (m.num_experts // ep * m.expert_ffn_hidden_size
               + m.num_shared_experts * m.shared_expert_ffn_hidden_size)
        mlp_out = h * ffn // t
        mlp = mlp_out * mult + h * m.num_experts
    else:
        bias = h if spec.mlp_bias else 0
        mlp_out = h * spec.ffn_hidden_size // t + bias
        mlp = mult * h * spec.ffn_hidden_size // t + (mult - 1) * (
            spec.ffn_hidden_size // t if spec.mlp_bias else 0) + bias
    attn_out = spec.q_size * h // t + (h if spec.attn_out_bias else 0)
    qkv = h * (spec.q_size + 2 * spec.kv_size) // t + (
        (spec.q_size + 2 * spec.kv_size) // t if spec.qkv_bias else 0)
    return {"mlp_out": mlp_out, "mlp": mlp, "mlp_norm": norm, "attn_out": attn_out,
            "attn": attn_out + qkv}


def moment_params(spec: ModelSpec, t: int, ep: int, key: tuple[bool, Recompute],
                  kind: LayerKind) -> tuple[int, ...]:
    """Parameters whose gradients exist at each backward moment of a layer of ``kind``."""
    groups = grad_group_params(spec, t, ep, key[0])
    return tuple(sum(groups[g] for g in m.grads_before) for m in kind.moments)
