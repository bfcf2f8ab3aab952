"""Op-level activation checkpointing (``Recompute.OPS``): each layer keeps its input and the
outputs of the ops its save list names, and recomputes the rest in backward.

This is PyTorch's selective activation checkpointing (``torch.utils.checkpoint.
create_selective_checkpoint_contexts``, torch/utils/checkpoint.py): inside a checkpointed
layer ``_CachingTorchDispatchMode`` stores the output of every op the policy marks
``MUST_SAVE`` (a detached reference, so the tensor stays alive until backward), and nothing
else but the region's inputs; in backward the layer's forward reruns and
``_CachedTorchDispatchMode`` serves the stored outputs instead of computing them. The rerun
stops once the last tensor backward needs is rebuilt (non-reentrant checkpoint's early stop),
so the MLP's down projection never reruns. The save list is a set of *items*: an op whose
output a layer can keep, named after the saved term it makes (``attn.q`` is the q
projection's output; ``attn.out`` the attention kernel's, with its logsumexp ``attn.lse``;
``attn.o_proj`` the output projection's, which no backward reads but whose rerun it skips).

So a layer under OPS holds its checkpointed input and the kept outputs (``kept_terms``); its
backward is the fully recomputed layer's (the rerun rebuilds what a layer without recompute
saves, the kept outputs among it; ``memplan.model.layer.backward_moments``), as torchtitan's
fixed per-op list is modelled (``memplan.model.sac``). In its forward a kept output is alive
from the op that makes it on, beside the checkpointed layer's working set (``Block.
working_set``); where that working set already holds the tensor (v, the attention output, the
MLP's activation, up projection and product) it is not added again (``Item.own_extra``).

Modelled for dense pre-norm layers (attention with SDPA's fused kernel and an MLP), without
autocast, LoRA or torch.compile: ``ops_refusal`` names the rest. One fused q/k/v projection
(torchtitan's ``wqkv``) is one item, ``attn.qkv``, which ``attn.q``, ``attn.k`` and ``attn.v``
each name.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from memplan.errors import LayoutError, MemplanError
from memplan.model.attention import Attention as AttentionBlock
from memplan.model.dims import Dims, Term
from memplan.spec import MlpKind, ModelSpec, PositionKind
from memplan.workload import Attention as Kernel
from memplan.workload import Workload

# the groups a save list may name, and the blocks whose items each stands for
GROUPS = {"attention": ("attn",), "mlp": ("mlp",), "norms": ("attn_norm", "mlp_norm")}
# the ops an item's output comes from, as a policy finds them (``memplan.report.sac_policy``)
MATMUL, ATTENTION_KERNEL, ACTIVATION, PRODUCT, NORM = "matmul", "sdpa", "act", "mul", "norm"


class Item(NamedTuple):
    """An op output a checkpointed layer can keep, on one rank, for one micro-batch.

    ``terms``: the saved terms (``Block.saved`` under no recompute) it is; ``size_bytes``: its
    bytes; ``flops_per_token``: the forward FLOPs of one token through the op on this rank,
    what its rerun costs when it is not kept (2 per weight of a projection, the attention
    core's matmuls, one per element of an elementwise op); ``op``, ``width`` and ``nth``: the
    kind of op, its output's last dimension and which of the layer's ops of that kind and
    width it is, in execution order (how a policy recognises it); ``block``: the block that
    runs it; ``own_extra``: kept, it adds to its own block's working set."""

    name: str
    terms: tuple[str, ...]
    size_bytes: int
    flops_per_token: float
    op: str
    width: int
    nth: int
    block: str
    own_extra: bool


def ops_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    """Why op-level checkpointing is not modelled for ``spec`` and ``wl``, or None."""
    checks = (
        (spec.moe is not None, "MoE layers"), (spec.mla is not None, "MLA attention"),
        (spec.linear_attention is not None, "linear-attention layers"),
        (spec.sliding_window is not None, "sliding-window layers"),
        (not spec.norm_placement.pre_norm or spec.norm_placement.post_norm,
         f"{spec.norm_placement.value} norms"),
        (spec.parallel_block, "parallel attention and MLP blocks"),
        (spec.fused_gate_up, "one fused gate/up projection"),
        (spec.qk_norm.value != "none", "q/k norms"),
        (spec.attn_output_gate, "an attention output gate"),
        (spec.dropout > 0, "dropout"),
        (wl.attention is not Kernel.FLASH, f"attention {wl.attention.value}"),
        (wl.precision.policy.autocast is not None, f"precision {wl.precision.value}"),
        (wl.lora_rank > 0, "LoRA adapters"), (wl.compile, "torch.compile"),
        (wl.float8.value != "none", "float8 linears"),
        (wl.attention_impl.value != "generic", f"attention_impl {wl.attention_impl.value}"),
        (spec.mlp is MlpKind.RELU or spec.activation_impl.value in ("gelu_new", "xielu"),
         f"the {spec.mlp.value} MLP's saved tensors"),
    )
    return next((why for cond, why in checks if cond), None)


def check_supported(spec: ModelSpec, wl: Workload) -> None:
    why = ops_refusal(spec, wl)
    if why is not None:
        raise LayoutError("recompute ops is not modelled with this layer",
                          f"recompute ops with {why}: op-level checkpointing is modelled for "
                          "dense pre-norm layers with SDPA attention, without autocast, "
                          "LoRA or compile")


def matmul_shapes(spec: ModelSpec, t: int, fused_qkv: bool = False
                  ) -> list[tuple[str, int, int, int]]:
    """A dense layer's projections in execution order as (item name, d_in, d_out on this
    rank, output width on this rank); the MLP's down projection last (never rerun). With
    ``fused_qkv`` one q/k/v projection (torchtitan's ``wqkv``), ``attn.qkv``."""
    h, q, kv, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_hidden_size
    qkv = (q + 2 * kv) // t
    attn = ([("attn.qkv", h, qkv, qkv)] if fused_qkv else
            [("attn.q", h, q // t, q // t), ("attn.k", h, kv // t, kv // t),
             ("attn.v", h, kv // t, kv // t)]) + [("attn.o_proj", q // t, h, h)]
    first = [("mlp.gate", h, f // t, f // t), ("mlp.up", h, f // t, f // t)] if spec.mlp.gated \
        else [("mlp.fc1", h, f // t, f // t)]
    return attn + first + [("mlp.down", f // t, h, h)]


@lru_cache(maxsize=512)
def layer_items(spec: ModelSpec, wl: Workload, dm: Dims,
                saved: tuple[Term, ...]) -> tuple[Item, ...]:
    """The items of one dense layer on this rank, in execution order (``Item``); ``saved``:
    what the layer saves without recompute (``memplan.model.layer.ops_items`` gives it)."""
    check_supported(spec, wl)
    terms = {t.name: t.size_bytes for t in saved}
    tokens, e, t = dm.tokens, dm.e, dm.tp
    seen: dict[int, int] = {}
    out: list[Item] = []

    def matmul(name: str, d_in: int, d_out: int, width: int) -> Item:
        nth = seen.get(width, 0)
        seen[width] = nth + 1
        rope = name in ("attn.q", "attn.k", "attn.qkv") and spec.position is PositionKind.ROPE
        covers = ("attn.q", "attn.k", "attn.v") if name == "attn.qkv" else (name,)
        # (a row-parallel output is the full partial sum on each rank)
        return Item(name, tuple(c for c in covers if c in terms), tokens * width * e,
                    2.0 * d_in * d_out + (2.0 * d_out if _has_bias(spec, name) else 0.0),
                    MATMUL, width, nth, name.split(".")[0], rope or name == "mlp.gate")

    for norm in ("attn_norm",):
        out += _norm_items(norm, terms, spec)
    fused = spec.fused_qkv or wl.fused_qkv
    mm = {m[0]: m for m in matmul_shapes(spec, t, fused)}
    out += [matmul(*mm[n]) for n in (("attn.qkv",) if fused else ("attn.q", "attn.k", "attn.v"))]
    core = AttentionBlock().core_flops_per_token(spec, dm.s_kv) / t
    out.append(Item("attn.out", ("attn.out", "attn.lse"), terms["attn.out"] + terms["attn.lse"],
                    core, ATTENTION_KERNEL, spec.q_size // t, 0, "attn", False))
    out.append(matmul(*mm["attn.o_proj"]))
    out += _norm_items("mlp_norm", terms, spec)
    f = spec.ffn_hidden_size // t
    if spec.mlp.gated:
        out.append(matmul(*mm["mlp.gate"]))
        out.append(Item("mlp.act", ("mlp.act",), terms["mlp.act"], float(f), ACTIVATION, f, 0,
                        "mlp", False))
        out.append(matmul(*mm["mlp.up"]))
        out.append(Item("mlp.prod", ("mlp.prod",), terms["mlp.prod"], float(f), PRODUCT, f, 0,
                        "mlp", False))
    else:
        out.append(matmul(*mm["mlp.fc1"]))
        out.append(Item("mlp.act", ("mlp.act",), terms["mlp.act"], float(f), ACTIVATION, f, 0,
                        "mlp", False))
    return tuple(out)


def _has_bias(spec: ModelSpec, name: str) -> bool:
    if name.startswith("mlp."):
        return spec.mlp_bias
    return spec.attn_out_bias if name == "attn.o_proj" else spec.qkv_bias


def _norm_items(norm: str, terms: dict[str, int], spec: ModelSpec) -> list[Item]:
    """A norm's saved terms, each an item of its own: elementwise, one FLOP per element of the
    hidden width (its ops differ by implementation: no policy names them, ``NORM``)."""
    return [Item(name, (name,), size, float(spec.hidden_size), NORM, spec.hidden_size, 0,
                 norm, False)
            for name, size in terms.items() if name.startswith(norm + ".")]


def valid_names(items: tuple[Item, ...]) -> list[str]:
    """What a save list may name: items, the terms they cover, and the groups."""
    names = [i.name for i in items]
    names += [t for i in items for t in i.terms if t not in names]
    return names + list(GROUPS)


def resolve(items: tuple[Item, ...], save: tuple[str, ...], spec: ModelSpec) -> tuple[Item, ...]:
    """The items a save list keeps, in execution order; an unknown name is refused with the
    names it could be."""
    chosen: set[str] = set()
    for name in save:
        if name in GROUPS:
            chosen |= {i.name for i in items if i.block in GROUPS[name]}
            continue
        hits = {i.name for i in items if name == i.name or name in i.terms}
        if not hits:
            raise MemplanError(f"recompute_save: unknown name {name!r} for {spec.name}'s "
                               f"layers; valid: {', '.join(valid_names(items))}")
        chosen |= hits
    return tuple(i for i in items if i.name in chosen)


def kept_terms(kept: tuple[Item, ...]) -> tuple[Term, ...]:
    """What a layer keeps beyond its input: each kept item's output."""
    return tuple(Term(f"ops.{i.name}", i.size_bytes) for i in kept)


def rerun_flops_per_token(items: tuple[Item, ...], kept: tuple[Item, ...]) -> float:
    """Forward FLOPs of one token that the backward's rerun spends on this rank: every item
    not kept (the down projection never reruns: early stop)."""
    names = {i.name for i in kept}
    return sum(i.flops_per_token for i in items if i.name not in names)


def forward_peak(moment_blocks: list[tuple[str, int]], items: tuple[Item, ...],
                 kept: tuple[Item, ...], mlp_end: int = 0) -> int:
    """The largest of a checkpointed layer's forward moments (``(block name, alive +
    transient bytes)``, ``memplan.model.layer.forward_moments`` under full recompute) with the
    kept outputs made by then: those of the blocks before its block, and its own block's
    ``own_extra`` ones. ``mlp_end``: what the layer holds at the MLP's down projection
    beyond the MLP's own tensors (its input, the residual, the checkpointed input), where
    every kept MLP output is alive with the down projection's input and output (traced:
    torchtitan's block with the MLP kept, one residual-sized tensor above its working set)."""
    order = list(dict.fromkeys(i.block for i in items))
    best = 0
    if mlp_end:
        mlp_kept = sum(i.size_bytes for i in kept if i.block == "mlp")
        last = next(i for i in reversed(items) if i.block == "mlp")  # the down projection's input
        down_in = 0 if last in kept else last.size_bytes
        before = sum(i.size_bytes for i in kept if i.block != "mlp")
        best = mlp_end + before + mlp_kept + down_in
    for block, value in moment_blocks:
        at = order.index(block) if block in order else len(order)
        before = sum(i.size_bytes for i in kept if order.index(i.block) < at)
        own = sum(i.size_bytes for i in kept if i.block == block and i.own_extra)
        best = max(best, value + before + own)
    return best


def assumption(spec: ModelSpec, wl: Workload, items: tuple[Item, ...]) -> str:
    """The assumptions' line for ``Recompute.OPS``: what each layer keeps and what its rerun
    costs."""
    kept = resolve(items, wl.recompute_save, spec)
    rerun = rerun_flops_per_token(items, kept)
    every = sum(i.flops_per_token for i in items)
    names = ", ".join(i.name for i in kept) or "nothing"
    return (f"recompute ops (PyTorch selective activation checkpointing per layer): each "
            f"layer keeps its input and {names}; its backward reruns the rest, "
            f"{rerun / every:.0%} of the keepable ops' FLOPs (the down projection never "
            "reruns: early stop)")
