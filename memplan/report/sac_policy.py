"""An op-level save set (``Recompute.OPS``) in each framework's own terms (``--emit-policy``).

- ``torch``: a Python module defining ``policy_fn(ctx, op, *args, **kwargs)`` for
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (torch/utils/checkpoint.py),
  ``policy_fns`` (one per layer, each with its own counters) and ``context_fn(layer)``. An
  item is recognised by its op family (``mm``/``addmm`` for a projection; SDPA's kernels;
  ``silu``/``gelu``/``relu``; ``mul``; ``cat``, MLA's query and key), its output's last dimension and its index among the layer's
  ops of that family and width (``memplan.model.sac_ops.Item``); the policy counts them per
  layer. An upcast RMSNorm's tensors are named by its casts (``_to_copy``), ``rsqrt`` and
  products (``mul``), an upcast-fp32 one's by its casts and ``rsqrt`` or its ``rsqrt`` and
  products (``memplan.model.sac_ops._upcast_fp32_ops``); other norm tensors come from ops
  that differ by implementation (``NORM`` items): an estimate refuses a save list keeping
  them (``sac_ops.kept_refusal``), and ``emit`` given them says they are not expressible.
- ``torchtitan``: its per-op SAC (0.3.0 ``distributed/activation_checkpoint.py``
  ``SelectiveAC``) saves its op list's outputs (SDPA, ``aten.mm``/``linear``) but every second
  matmul counted in execution order, and recomputes matmuls whose weight shape is in
  ``force_recompute_mm_shapes_by_fqns``, uncounted; it runs with ``early_stop=False``. The
  emitted config forces the shapes of the projections not kept; what it then keeps is worked
  out by the same rule and shown as a memplan save list.
- ``megatron``: ``--recompute-granularity selective --recompute-modules`` (Megatron-LM
  ``transformer_config.py`` ``recompute_modules``: core_attn, mlp, layernorm, moe, moe_act,
  shared_experts, mla_up_proj) recomputes whole submodules: the closest setting, and what it
  keeps instead.
"""

from __future__ import annotations

from memplan.errors import MemplanError
from memplan.model.sac_mla import CAT, mla_matmul_shapes
from memplan.model.sac_ops import (ATTENTION_KERNEL, BMM, CONV, MATMUL, NORM, Item,
                                   matmul_shapes)
from memplan.spec import ModelSpec

TARGETS = ("torch", "torchtitan", "megatron")
# an eager core's items (memplan.model.sac_ops._eager_core_ops): Megatron's core_attn
_EAGER_CORE = ("attn.scores", "attn.softmax", "attn.softmax_cast", "attn.dropout",
               "attn.context")
# torchtitan's Llama module names of each projection (models/common/attention.py,
# feed_forward.py)
_TITAN_FQNS = {"attn.qkv": "attention.wqkv", "attn.q": "attention.wq", "attn.k": "attention.wk", "attn.v": "attention.wv",
               "attn.o_proj": "attention.wo", "mlp.gate": "feed_forward.w1",
               "mlp.up": "feed_forward.w3", "mlp.down": "feed_forward.w2",
               # its DeepSeek-V3 attention (models/deepseek_v3/model.py Attention)
               "mla.q_a": "attention.wq_a", "mla.q_b": "attention.wq_b",
               "mla.q_proj": "attention.wq", "mla.kv_a": "attention.wkv_a",
               "mla.kv_b": "attention.wkv_b", "mla.o_proj": "attention.wo"}


def emit(target: str, spec: ModelSpec, items: tuple[Item, ...], kept: tuple[Item, ...],
         command: str, layers: list[tuple[Item, ...]] | None = None,
         unkept: tuple[tuple[str, int], ...] = (),
         other: dict[int, tuple[tuple[Item, ...], tuple[tuple[str, int], ...]]]
         | None = None) -> str:
    """``kept`` of ``items`` as ``target`` expresses it; ``command``: the memplan command line
    it came from (quoted in the output). ``layers``: what each layer keeps, where layers
    differ (a list per pipeline stage); ``kept`` is then what every layer keeps. torch
    expresses it, one policy per layer index; torchtitan and Megatron-LM set one policy for
    every layer: theirs keeps what every layer keeps, and says so."""
    if target not in TARGETS:
        raise MemplanError(f"emit-policy must be one of {', '.join(TARGETS)}, got {target!r}")
    if target == "torch":
        return torch_policy(spec, items, kept, command, layers, unkept, other)
    text = {"torchtitan": torchtitan_policy, "megatron": megatron_policy}[target](
        spec, items, kept, command)
    if other:
        return (f"# Not expressible: a save list per layer kind ({target} applies one policy "
                f"to every layer, and {spec.name}'s dense and MoE layers run different ops); "
                "this is the dense layers' list, the MoE layers' is not expressed.\n" + text)
    if layers is None:
        return text
    return (f"# Not expressible: a save list per layer ({target} applies one to every "
            "layer); this keeps what every layer keeps, so each stage fits, recomputing "
            "more.\n" + text)


def _unexpressible(kept: tuple[Item, ...]) -> list[str]:
    return [i.name for i in kept if i.op == NORM]


def _norms(kept: tuple[Item, ...]) -> list[str]:
    """The kept norm tensors, named by a torch policy or not: torchtitan's op list and
    Megatron's modules treat a norm whole."""
    return [i.name for i in kept if i.block in ("attn_norm", "mlp_norm")]


def _save_set(kept: tuple[Item, ...]) -> str:
    # (an MoE loop's expert op: each expert's run, ``Item.indices``)
    save = sorted((i.op, i.width, n) for i in kept if i.op != NORM for n in i.indices())
    return "{" + ", ".join(map(repr, save)) + "}" if save else "set()"


def _counts(items: tuple[Item, ...], unkept: tuple[tuple[str, int], ...]
            ) -> dict[tuple[str, int], int]:
    """How many ops of each (family, width) one layer runs that the policy counts."""
    out: dict[tuple[str, int], int] = {}
    for op, width in [(i.op, i.width) for i in items if i.op != NORM
                      for _ in range(i.repeat)] + list(unkept):
        out[(op, width)] = out.get((op, width), 0) + 1
    return out


def torch_policy(spec: ModelSpec, items: tuple[Item, ...], kept: tuple[Item, ...],
                 command: str, layers: list[tuple[Item, ...]] | None = None,
                 unkept: tuple[tuple[str, int], ...] = (),
                 other: dict[int, tuple[tuple[Item, ...], tuple[tuple[str, int], ...]]]
                 | None = None) -> str:
    """The module (see the module docstring); with ``layers`` (what each layer keeps) the
    layers whose set differs from ``SAVE`` get their own in ``LAYER_SAVE``, by index.
    ``unkept``: the layer's ops no item keeps that the policy counts (``memplan.model.layer.
    ops_unkept``: a dense layer's down projection, each named norm's fp32 product x * rstd,
    RoPE's products where they share a norm op's width, an MoE block's own). ``other``:
    the layers of another kind (a model of dense and MoE layers), by index, with their items
    and unkept ops: their op counts are their own (``LAYER_COUNTS``)."""
    per_layer = _counts(items, unkept)
    layer_counts = {i: _counts(*pair) for i, pair in (other or {}).items()}
    every = [kept] if layers is None else layers
    missing = list(dict.fromkeys(n for k in every for n in _unexpressible(k)))
    differ = {} if layers is None else {i: _save_set(k) for i, k in enumerate(layers)
                                        if _save_set(k) != _save_set(kept)}
    note = ("# Not expressible, recomputed instead: " + ", ".join(missing) + " (a norm's saved "
            "tensors come from elementwise ops that differ by implementation).\n"
            if missing else "")
    if any(i.repeat > 1 for i in items):
        note += ("# The MoE experts run one after another (memplan/profile/reference.py "
                 "MoE.forward): the\n# counts assume every expert receives at least one row "
                 "of each micro-batch (an\n# expert with none skips its ops and the indices "
                 "after it shift).\n")
    names = ", ".join(i.name for i in kept if i.op != NORM) or "nothing but the layer input"
    if differ:
        names += f" (layers {', '.join(map(str, differ))} their own: LAYER_SAVE)"
    layer_save = ("{" + ", ".join(f"{i}: {v}" for i, v in differ.items()) + "}"
                  if differ else "{}")
    return f'''"""Selective activation checkpointing for {spec.name}: each decoder layer keeps {names}.

Made by: {command}
Wrap each decoder layer with
    torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False,
                                      context_fn=context_fn(layer_index))
Ops are recognised by family, output width and their index in the layer (per TP rank);
everything else is recomputed in backward.
"""
{note}import functools
from collections import Counter

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

NUM_LAYERS = {spec.num_layers}
# (family, output width, index among the layer's ops of that family and width)
SAVE = {_save_set(kept)}
# the layers (by index) that keep another set
LAYER_SAVE = {layer_save}
# how many ops of each (family, width) one layer runs
PER_LAYER = {per_layer}
# the layers (by index) of another kind, with their own counts
LAYER_COUNTS = {layer_counts}
_aten = torch.ops.aten
_SDPA = tuple(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name))


def _key(op, args):
    """(family, width) of an op call, or None."""
    if op in (_aten.mm.default, _aten.addmm.default):
        return "{MATMUL}", args[-1].shape[-1]
    if op in _SDPA:
        return "{ATTENTION_KERNEL}", args[0].shape[1] * args[0].shape[-1]
    if op in (_aten.silu.default, _aten.gelu.default, _aten.sigmoid.default,
              _aten.relu.default):
        return "act", args[0].shape[-1]
    if op in (_aten._to_copy.default, _aten.rsqrt.default):
        return ("copy" if op is _aten._to_copy.default else "rsqrt"), args[0].shape[-1]
    if op is _aten.cat.default:  # MLA's query and key: torch.cat((nope, rope), dim=-1)
        parts, dim = args[0], args[1] if len(args) > 1 else 0
        last = dim in (-1, parts[0].dim() - 1)
        return "{CAT}", sum(t.shape[-1] for t in parts) if last else parts[0].shape[-1]
    if op is _aten._softmax.default:
        return "softmax", args[0].shape[-1]
    if op is _aten.index.Tensor:
        return "index", args[0].shape[-1]
    if op is _aten.bmm.default:
        return "bmm", args[1].shape[-1]
    if op is _aten.native_dropout.default:
        return "dropout", args[0].shape[-1]
    if "grouped_mm" in str(op):  # aten._grouped_mm, or transformers' fallback op
        return "grouped_mm", args[1].shape[-1]
    if op is _aten.mul.Tensor and all(isinstance(a, torch.Tensor) for a in args[:2]):
        return "mul", max(args[0].shape[-1], args[1].shape[-1])
    if op is _aten.convolution.default:  # a depthwise conv1d, by its output channels
        return "{CONV}", args[1].shape[0]
    if op is _aten.tanh.default:
        return "tanh", args[0].shape[-1]
    if op is _aten.clamp.default:  # GPT-OSS's clamped gate and up
        return "clamp", args[0].shape[-1]
    if op in (_aten.mul.Tensor, _aten.add.Tensor) and not isinstance(args[1], torch.Tensor):
        return ("scale" if op is _aten.mul.Tensor else "shift"), args[0].shape[-1]
    return None


def make_policy_fn(save=SAVE, per_layer=PER_LAYER):
    """A policy with its own counters (one per checkpointed layer), keeping ``save`` of a
    layer running ``per_layer`` ops."""
    seen = Counter()

    def policy_fn(ctx, op, *args, **kwargs):
        key = _key(op, args)
        if key is None or key not in per_layer:
            return CheckpointPolicy.PREFER_RECOMPUTE
        slot = (getattr(ctx, "is_recompute", False), key)
        nth = seen[slot] % per_layer[key]
        seen[slot] += 1
        if (*key, nth) in save:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


def layer_policy_fn(layer_index):
    """A fresh policy for layer ``layer_index``: its own set and op counts."""
    return make_policy_fn(LAYER_SAVE.get(layer_index, SAVE),
                          LAYER_COUNTS.get(layer_index, PER_LAYER))


policy_fn = make_policy_fn()
# one policy per layer, so that their counters stay apart
policy_fns = [layer_policy_fn(i) for i in range(NUM_LAYERS)]


def context_fn(layer_index):
    return functools.partial(create_selective_checkpoint_contexts, policy_fns[layer_index])
'''


def _titan_kept(items: tuple[Item, ...], forced: set[tuple[int, int]],
                shapes: dict[str, tuple[int, int]]) -> list[str]:
    """What torchtitan's rule keeps: SDPA's outputs, and of the matmuls not forced (in
    execution order, the down projection included) the 1st, 3rd, ... (``meta[mm_count_key]
    % 2 == 0`` recomputes the even ones)."""
    out, count = [], 0
    for i in items:
        if i.op == ATTENTION_KERNEL:
            out.append(i.name)
        if i.op != MATMUL:
            continue
        if shapes[i.name] in forced:
            continue
        count += 1
        if count % 2 == 1:
            out.append(i.name)
    return out


def _no_linear_mixers(target: str, spec: ModelSpec, what: str) -> None:
    """Refuses a model whose layers without attention have no policy in ``target``: LFM2's
    short convolutions (``target`` has ``what``), and Mamba2 layers (Granite 4.0-H's and
    Falcon-H1's: ``memplan.model.sac_mamba`` and ``sac_falcon`` model transformers'
    torch_forward, no other framework's mixer)."""
    if spec.short_conv is not None:
        raise MemplanError(f"emit-policy {target}: {what}, so {spec.name}'s short-convolution "
                           "layers have no policy there; use --emit-policy torch")
    if spec.mamba is not None:
        mixer = ("FalconH1Mixer.torch_forward, beside each layer's attention"
                 if spec.mamba.parallel_attention else "GraniteMoeHybridMambaLayer.torch_forward")
        raise MemplanError(f"emit-policy {target}: {spec.name}'s Mamba2 layers are modelled "
                           f"as transformers runs them ({mixer}), not this framework's; use "
                           "--emit-policy torch")


# what torchtitan's op list cannot keep of an MLA block
_MLA_TITAN = ("(MLA: its op list has no aten.cat, so the query's and key's concatenations "
              "(mla.q, mla.k) rerun, and no norm op, so the latent norms' tensors do; its "
              "kernel, FlexAttention by default or SDPA, it keeps.)")


def torchtitan_policy(spec: ModelSpec, items: tuple[Item, ...], kept: tuple[Item, ...],
                      command: str) -> str:
    _no_linear_mixers("torchtitan", spec, "torchtitan 0.3.0 has no LFM2 model")
    names = {i.name for i in kept}
    if any(i.op == BMM for i in items):
        raise MemplanError(f"emit-policy torchtitan: {spec.name}'s eager attention core has no "
                           "counterpart in torchtitan (its attention runs SDPA or flex "
                           "attention); use --emit-policy torch")
    matmuls = [i for i in items if i.op == MATMUL]
    unnamed = [i.name for i in matmuls if i.name not in _TITAN_FQNS]
    if unnamed:
        why = ("its feed_forward is gated: w1, w3, w2" if "mlp.fc1" in unnamed
               else "its feed_forward runs w1 and w3 apart")
        raise MemplanError(f"emit-policy torchtitan: {spec.name}'s {', '.join(unnamed)} has no "
                           f"module in torchtitan's Llama ({why}); use --emit-policy torch")
    # the down projection's output: never read by backward, reruns under torchtitan's
    # early_stop=False unless kept; memplan's items leave it out (early stop)
    down = Item("mlp.down", (), 0, 2.0 * spec.ffn_hidden_size * spec.hidden_size, MATMUL,
                spec.hidden_size, 0, "mlp", False)
    # weight shapes (in, out) as torchtitan matches them (whole weights: one TP rank's
    # shard has the same shape on every rank of its group)
    fused = any(i.name == "attn.qkv" for i in items)
    shapes = {name: (d_in, d_out) for name, d_in, d_out, _ in matmul_shapes(spec, 1, fused)}
    if spec.mla is not None:
        shapes.update((name, (d_in, d_out)) for name, d_in, d_out, _ in mla_matmul_shapes(spec))
    forced = {shapes[i.name] for i in matmuls if i.name not in names}
    fqns = [_TITAN_FQNS[i.name] for i in matmuls if i.name not in names]
    result = _titan_kept(items + (down,), forced, shapes)
    lost = sorted(names - set(result) - set(_norms(kept)))
    plain = [f"# {line}" for line in (
        f"Wanted: {', '.join(sorted(names)) or 'the layer input only'}.",
        f"torchtitan keeps: {', '.join(result) or 'the layer input only'} "
        "(its rule: every second remaining matmul recomputed; a forced shape forces every "
        "matmul of that weight shape).",
        *([f"Not expressible: {', '.join(lost)} (recomputed instead)."] if lost else []),
        *([_MLA_TITAN] if any(n in ("mla.q", "mla.k") or n.startswith(("mla.q_norm.",
                                                                        "mla.kv_norm."))
                              for n in lost) else []),
        *([f"Not expressible: {', '.join(_norms(kept))} (not in its op list)."]
          if _norms(kept) else []),
        "Its checkpoint runs with early_stop=False: the rerun goes through the down projection"
        + (" (whose output it keeps here: one more residual-sized tensor per layer, beyond "
           "the save list below)." if "mlp.down" in result else "."),
        "memplan's estimate of what it keeps: --recompute ops --recompute-save "
        + (",".join(r for r in result if r != "mlp.down") or '""'),
    )]
    return "\n".join([f"# torchtitan 0.3.0 per-op SAC for {spec.name}. Made by: {command}",
                      *plain,
                      "from torchtitan.distributed.activation_checkpoint import SelectiveAC",
                      "",
                      "activation_checkpoint = SelectiveAC.Config(",
                      f"    force_recompute_mm_shapes_by_fqns={fqns!r},",
                      ")", ""])


def megatron_policy(spec: ModelSpec, items: tuple[Item, ...], kept: tuple[Item, ...],
                    command: str) -> str:
    _no_linear_mixers("megatron", spec, "Megatron-LM has no short-convolution mixer (no "
                   "--recompute-modules names one)")
    names = {i.name for i in kept}
    modules: list[str] = []
    unlike: list[str] = []
    core = {i.name for i in items if i.name in _EAGER_CORE} or {"attn.out"}
    if spec.mla is not None:
        _megatron_mla(items, names, modules, unlike)
    elif not core <= names:
        modules.append("core_attn")
        if core & names:
            unlike.append("an eager core partly kept: Megatron's core_attn keeps or recomputes "
                          "the core whole (recomputed)")
    if not names & {"mlp.gate", "mlp.up", "mlp.gate_up", "mlp.act", "mlp.prod", "mlp.fc1"}:
        modules.append("mlp")
    norms = {i.name for i in items if i.block in ("attn_norm", "mlp_norm")}
    if not norms <= set(_norms(kept)):
        modules.append("layernorm")
        if _norms(kept):
            unlike.append("a norm partly kept: Megatron keeps or recomputes a norm whole "
                          "(recomputed)")
    if modules and "mlp" not in modules and not {i.name for i in items
                                                  if i.block == "mlp"} <= names:
        unlike.append("an MLP partly kept: Megatron keeps or recomputes the MLP whole (kept)")
    proj = {"attn.q", "attn.k", "attn.v", "attn.o_proj"}
    if spec.mla is None and names & proj != proj:
        unlike.append("the q/k/v and output projections are never recomputed by "
                      "--recompute-modules (kept)")
    setting = ("--recompute-granularity selective --recompute-modules " + " ".join(modules)
               if modules else "no recompute (every item kept)")
    return "\n".join([f"# Megatron-LM for {spec.name}. Made by: {command}", setting,
                      *(f"# Not expressible: {u}." for u in unlike), ""])


# what Megatron-LM's mla_up_proj recomputes (megatron/core/transformer/
# multi_latent_attention.py ``qkv_up_proj_and_rope_apply`` under ``CheckpointWithoutOutput``:
# linear_q_up_proj or linear_q_proj, linear_kv_up_proj, RoPE and the query's and key's
# concatenations, their outputs discarded once the core attention has run)
_MLA_UP = ("mla.q_b", "mla.q_proj", "mla.kv_b", "mla.q", "mla.k")


def _megatron_mla(items: tuple[Item, ...], names: set[str], modules: list[str],
                  unlike: list[str]) -> None:
    """An MLA block's modules: ``core_attn`` where the kernel's output is not kept,
    ``mla_up_proj`` where none of what it recomputes is (``_MLA_UP``); the down
    projections, the latent norms (q_layernorm, kv_layernorm: ``layernorm`` is the layer's
    two) and the output projection are never recomputed."""
    if "mla.out" not in names:
        modules.append("core_attn")
    up = {i.name for i in items if i.name in _MLA_UP}
    if not names & up:
        modules.append("mla_up_proj")
    elif not up <= names:
        unlike.append("the up projections partly kept: mla_up_proj recomputes q_b (or q), "
                      "kv_b, RoPE and the query's and key's concatenations whole (kept)")
    rest = {i.name for i in items if i.block == "attn" and i.name.startswith("mla.")
            and i.name not in _MLA_UP and i.name != "mla.out"}
    if not rest <= names:
        unlike.append("the q/kv down projections, the latent norms and the output "
                      "projection are never recomputed by --recompute-modules (kept)")


def emit_for(target: str, est: object) -> str:
    """``emit`` for an estimate made with ``Recompute.OPS`` (``--recompute ops`` or
    ``auto``)."""
    from memplan.model.dims import Dims
    from memplan.model.layer import ops_items
    from memplan.model.sac_ops import resolve
    from memplan.model.estimate import Estimate
    from memplan.workload import Recompute

    assert isinstance(est, Estimate)
    spec, wl = est.spec, est.workload
    if target not in TARGETS:
        raise MemplanError(f"emit-policy must be one of {', '.join(TARGETS)}, got {target!r}")
    from memplan.api import AUTO_NONE_NOTE

    if wl.recompute is Recompute.NONE and AUTO_NONE_NOTE in est.notes:
        return no_recompute(target, spec, est.parallel, wl)
    if wl.recompute is not Recompute.OPS:
        raise MemplanError(f"emit-policy needs recompute ops or auto, got recompute "
                           f"{wl.recompute.value}")
    from memplan.model.layer import has_nope_layers, ops_kinds, ops_unkept
    from memplan.model.sac_ops import per_stage
    from memplan.model.stage_parts import stage_layer_indices

    par = est.parallel
    dm = Dims.of(spec, par, wl)
    kinds = ops_kinds(spec)
    if len(kinds) > 1 or has_nope_layers(spec) and target == "torch":
        return _emit_mixed(target, spec, par, wl, dm)
    items = ops_items(spec, wl, dm)
    unkept = ops_unkept(spec, wl, dm)
    stages = per_stage(wl.recompute_save, par.pp)
    layers = None
    if stages is None:
        kept = resolve(items, wl.recompute_save, spec)
        save = ",".join(i.name for i in kept) or '""'
    else:
        by_stage = {s: resolve(items, names, spec) for s, names in stages.items()}
        common = set.intersection(*(set(k) for k in by_stage.values()))
        kept = tuple(i for i in items if i in common)
        layers = [()] * spec.num_layers
        for s, k in by_stage.items():
            for i in stage_layer_indices(spec, par.pp, par.vpp, s, par.stage_layers):
                layers[i] = k
        save = ",".join(wl.recompute_save)
    return emit(target, spec, items, kept, _command(spec, par, wl, save, layers is not None),
                layers, unkept)


def no_recompute(target: str, spec: ModelSpec, par, wl) -> str:
    """``recompute auto`` where no recompute fits (``memplan.api._auto_none``), in
    ``target``'s terms: torch, layers left unwrapped, and for a loop that wraps them anyway a
    policy that saves every op (it reruns nothing, but the cache then holds every op's
    output to the backward, the forward's transients too: more than unwrapped layers hold,
    which memplan does not estimate); torchtitan 0.3.0,
    no activation checkpointing (``Trainer.Config.activation_checkpoint`` None, its "none"
    subcommand); Megatron-LM, no ``--recompute-granularity``."""
    command = (f"memplan estimate -m {spec.name} -n {par.world_size} "
               f"--mbs {wl.micro_batch_size} --seq {wl.seq_len} "
               f"--precision {wl.precision.value} --recompute none")
    why = "no recompute fits: every layer keeps all it saves"
    if target == "torchtitan":
        return (f"# torchtitan 0.3.0 for {spec.name} ({why}). Made by: {command}\n"
                "activation_checkpoint = None  # Trainer.Config: no activation checkpointing\n")
    if target == "megatron":
        return (f"# Megatron-LM for {spec.name} ({why}). Made by: {command}\n"
                "no recompute (no --recompute-granularity)\n")
    return f'''"""Activation checkpointing for {spec.name}: none ({why}).

Made by: {command}
Leave the decoder layers unwrapped: that is what the estimate counts. A loop that wraps
them anyway with
    torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False,
                                      context_fn=context_fn(layer_index))
recomputes nothing with this policy, but it saves every op's output, the forward's
temporaries too, beside each layer's input: more than unwrapped layers hold, and not
estimated.
"""
import functools

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

NUM_LAYERS = {spec.num_layers}


def policy_fn(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


policy_fns = [policy_fn] * NUM_LAYERS


def context_fn(layer_index):
    return functools.partial(create_selective_checkpoint_contexts, policy_fns[layer_index])
'''


def _command(spec: ModelSpec, par, wl, save: str, staged: bool) -> str:
    # the precision decides the ops a policy counts (under autocast the norms run in fp32:
    # their casts are no ops; memplan.model.sac_ops)
    return (f"memplan estimate -m {spec.name} -n {par.world_size} "
            f"--mbs {wl.micro_batch_size} --seq {wl.seq_len} "
            f"--precision {wl.precision.value} --recompute ops "
            f"--recompute-save {save}" + (f" --pp {par.pp}" if staged else ""))


def _emit_mixed(target: str, spec: ModelSpec, par, wl, dm) -> str:
    """``emit_for`` a model of layers of two kinds (``memplan.model.layer.ops_kinds``: dense
    and MoE layers, or LFM2's attention and short-convolution layers), or of RoPE and NoPE
    layers (``memplan.model.layer.has_nope_layers``, whose NoPE layers run no RoPE, nor
    Llama 4's q/k norms; torch only): each layer keeps its kind's list (and its stage's), a
    NoPE layer the names its ops have: ``SAVE`` and ``PER_LAYER`` are the last kind's (the
    MoE layers', the convolution layers', the RoPE layers'), the other layers' sets and op
    counts their own by index (``LAYER_SAVE``, ``LAYER_COUNTS``)."""
    from memplan.model.layer import (has_nope_layers, ops_items, ops_kept, ops_kinds,
                                     ops_unkept)
    from memplan.model.sac_ops import for_stage, kind_variant, layer_kind_of
    from memplan.model.stage_parts import stage_layer_indices

    stage_of = {i: s for s in range(par.pp)
                for i in stage_layer_indices(spec, par.pp, par.vpp, s, par.stage_layers)}
    kinds = ops_kinds(spec)
    moe_of = {k: moe for k, moe, _ in kinds}
    of = [layer_kind_of(spec, i) for i in range(spec.num_layers)]
    keys = [(k, "nope" if has_nope_layers(spec) and spec.is_nope_layer(i)
             and not kind_variant(k) else kind_variant(k)) for i, k in enumerate(of)]
    kind_items = {kv: ops_items(spec, wl, dm, moe_of[kv[0]], kv[1]) for kv in set(keys)}
    unkept = {kv: ops_unkept(spec, wl, dm, moe_of[kv[0]], kv[1]) for kv in set(keys)}
    layers = [ops_kept(spec, wl, dm, moe_of[k], v, k, for_stage(wl.recompute_save,
                                                                 stage_of[i]))[1]
              for i, (k, v) in enumerate(keys)]
    # the last kind's most common variant (a kind may be NoPE layers alone)
    last = [kv for kv in keys if kv[0] == kinds[-1][0]]
    first, main = keys[of.index(kinds[0][0])], max(set(last), key=last.count)
    other = {i: (kind_items[kv], unkept[kv]) for i, kv in enumerate(keys) if kv != main}
    command = _command(spec, par, wl, ",".join(wl.recompute_save) or '""', par.pp > 1)
    if target != "torch":
        return emit(target, spec, kind_items[first], layers[keys.index(first)], command, None,
                    (), other)
    return emit(target, spec, kind_items[main], layers[keys.index(main)], command, layers,
                unkept[main], other)
