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
``attn.o_proj`` the output projection's, which no backward reads but whose rerun it skips;
a norm's saved tensors, which a policy names by op only for an upcast or upcast-fp32
RMSNorm below fp32: ``_norm_ops``, ``_upcast_fp32_ops``; the q/k norms' (Qwen3's, per head)
among the attention's). A norm tensor no policy names is refused when kept
(``kept_refusal``): the emitted policy would recompute it.

So a layer under OPS holds its checkpointed input and the kept outputs (``kept_terms``); its
backward is the fully recomputed layer's (the rerun rebuilds what a layer without recompute
saves, the kept outputs among it; ``memplan.model.layer.backward_moments``), as torchtitan's
fixed per-op list is modelled (``memplan.model.sac``). In its forward a kept output is alive
from the op that makes it on, beside the checkpointed layer's working set (``Block.
working_set``); where that working set already holds the tensor (v, the attention output, the
MLP's activation, up projection and product) it is not added again (``Item.own_extra``).

Under autocast (``amp-*``: fp32 weights, torch.autocast around the forward) the policy sees
the casts autocast makes as ops of their own (``aten._to_copy``, below the autocast dispatch
key): each linear's cast of its fp32 weight (cached by autocast, one per weight and forward)
and of an fp32 input (the norm's output, once per linear reading it), SDPA's casts of RoPE's
fp32 q and k. An emitted policy keeps none of them (no item is a cast): they rerun in backward
like the rest, and in the forward autocast's cache holds the weight casts to the forward's
end, as under full recompute (``memplan.model.layer.cast_cache_bytes``; at a dense MLP's
down projection its weight's cast with them: ``memplan.model.layer._ops_forward``). The kept
items are the same ops' outputs as without autocast, in the compute dtype (the projections'
``mm``, the SDPA kernel's output and fp32 logsumexp, the activation and product). The norms run in fp32
on the fp32 stream: their casts are no ops, their ``rsqrt`` and two products are counted
(``_norm_ops``' ``fp32_ops``). Traced (tests/traced/test_sac_policy.py): the reference model
and transformers' Llama, saved bytes and phase peaks exact on the reference model. A norm's
tensors cannot be kept under autocast (``kept_refusal``). torch 2.13 calls the policy in the
forward only; the rerun looks each op's output up by its index among the calls of that op.

Modelled for pre-norm layers (attention with SDPA's fused kernel or an eager core and an MLP, or
an MoE block as transformers' grouped experts or memplan's reference loop run it:
``memplan.model.sac_moe``), without LoRA or
torch.compile: ``ops_refusal`` names the rest. Dense layers with sandwich norms (Gemma 2 / 3:
models/gemma2/modeling_gemma2.py Gemma2DecoderLayer.forward, a norm on each mixer's output
before the residual add) or post norms alone (OLMo 2: models/olmo2/modeling_olmo2.py
Olmo2DecoderLayer.forward, the mixers reading the residual stream) count each post norm's ops
after its mixer's; so GLM-4's (models/glm4/modeling_glm4.py Glm4DecoderLayer.forward:
post_self_attn_layernorm and post_mlp_layernorm, Llama's upcast Glm4RMSNorm, named by their
ops below fp32 as the pre norms are: ``_post_norms_modelled``); there the post norm saves
(an fp32 copy of) the down projection's output, so the rerun reaches the down projection:
an item, ``mlp.down``, whose kept output skips it.
A kept output projection's or down projection's output is its post norm's input, which that
norm's moments hold anyway (``input_held``). OLMo 2's q/k norms over the whole projection
(Olmo2Attention.forward: ``q_norm(q_proj(x))``, then k's) are counted like Qwen3's.
Sliding-window layers given their mask (``memplan.model.attention.windowed``: integrations/
sdpa_attention.py ``sdpa_attention_forward`` repeats K and V, SDPA converts the mask; neither
an op a policy counts) keep the generic layer's items; their working set and the saved mask are
``WindowAttention``'s and ``window_mask_terms``'. One fused q/k/v projection
(torchtitan's ``wqkv``, Phi3Attention's ``qkv_proj``) is one item, ``attn.qkv``, which
``attn.q``, ``attn.k`` and ``attn.v`` each name; one fused gate/up projection (Phi3MLP.forward:
``gate_up_proj(x).chunk(2, dim=-1)``, then ``up_states * act_fn(gate)``) one item,
``mlp.gate_up``, alive to the MLP's end kept or not (``TO_MLP_END``). A parallel layer
(models/cohere2/modeling_cohere2.py Cohere2DecoderLayer.forward: one norm, both mixers reading
its output, one sum) has no MLP norm; its MLP's moments hold the norm's and the attention's
outputs anyway (``input_held``). Dropout on each mixer's output is no item: the rerun rebuilds
its mask from the forward's restored RNG state, the MLP's through its down projection (an
item, ``mlp.down``, as with post norms). A multi-head latent attention block's ops (DeepSeek-V3's:
its down and up projections, latent norms, the query's and key's concatenations, the kernel)
are ``memplan.model.sac_mla``'s; a hybrid model's other layers' (``linear_kind``) those of
``memplan.model.sac_conv`` (LFM2) and ``memplan.model.sac_mamba`` (Granite 4.0-H's Mamba2
layers); Falcon-H1's layers, a Mamba2 mixer beside each attention, ``memplan.model.
sac_falcon``'s (the mixer's items, its muP multipliers' products). An eager attention core (transformers'
``eager_attention_forward``) is named op by op in place of SDPA's kernel (``_eager_core_ops``:
its bmms, softmax, cast and dropout; Gemma 2's logit soft-capping, ``_softcap_ops``; a
sliding window only its mask), its moments with what each kept output adds
(``core_peak``); GPT-OSS's with its sinks (the sink column's cat, a softmax s_kv + 1 wide;
its MoE layers' eager core the only one modelled: ``eager_refusal``); an ungated ReLU MLP
keeps its up projection (``mlp.fc1``) and relu's output
(``mlp.act``). Llama 4's RoPE layers rotate q and k by a complex table and L2-norm them after
the three projections (``_complex_rope_ops``, ``_l2_norm_ops``: each norm's fp32 input and
rsqrt are items); its NoPE layers run neither, and scale q by the positions' temperature
(counted, no item): a NoPE layer (of any model, ``ModelSpec.nope_layer_interval``) has its own
op counts and keeps what it has of the list (``memplan.model.layer.ops_kept``). Chunked layers
are windowed layers (transformers' chunked mask goes to SDPA as a window's does). A name
scoped ``SCOPE:name`` applies to the layers of a kind or one pipeline stage (``resolve``,
``for_stage``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from memplan.errors import LayoutError, MemplanError
from memplan.model.attention import Attention as AttentionBlock
from memplan.model.dims import Dims, Term
from memplan.model.mla import Mla as MlaBlock
from memplan.model.sac_mla import CAT
from memplan.spec import MlpKind, ModelSpec, NormKind, PositionKind, QkNorm
from memplan.units import FP32_BYTES, DType
from memplan.workload import Attention as Kernel
from memplan.workload import MoeImpl, NormImpl
from memplan.workload import Workload

# the groups a save list may name, and the blocks whose items each stands for
GROUPS = {"attention": ("attn",), "mlp": ("mlp",),
          "norms": ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm"),
          # Falcon-H1's Mamba2 mixer beside its attention (``memplan.model.sac_falcon``)
          "mamba": ("mamba",)}
# the ops an item's output comes from, as a policy finds them (``memplan.report.sac_policy``)
MATMUL, ATTENTION_KERNEL, ACTIVATION, PRODUCT, NORM = "matmul", "sdpa", "act", "mul", "norm"
# an upcast RMSNorm's ops a policy can name: its dtype casts (``aten._to_copy``) and ``rsqrt``
COPY, RSQRT = "copy", "rsqrt"
# which of the norms' ops a policy names (``_norms_nameable``, ``_norm_ops``): an upcast
# RMSNorm's casts, rsqrt and output product; an upcast-fp32 one's casts and rsqrt (the
# reference model's and litgpt's), or its rsqrt and products (a model's own under
# ``norm_scale_fp32``: Gemma 2's, OLMo 2's, GPT-OSS's)
UPCAST_OPS, CAST_OPS, SCALE_OPS = "upcast", "casts", "products"
# an MoE layer's router softmax, its rows' gathers (``aten.index``) and its experts'
# grouped matmuls (``aten._grouped_mm``)
SOFTMAX, INDEX, GROUPED_MM = "softmax", "index", "grouped_mm"
# ``aten.clamp``: GPT-OSS's clamped gate and up (``memplan.model.sac_moe._clamped_ops``)
CLAMP = "clamp"
# a short-convolution layer's depthwise conv1d (``aten.convolution``, named by its channels)
CONV = "conv"
# ``aten.tanh``, and ``aten.mul``/``aten.add`` of a tensor and a Python number: transformers'
# NewGELUActivation's (``_gelu_new_ops``: the scaling, ``1.0 + tanh``) and an eager core's
# logit soft-capping (``_softcap_ops``)
TANH, SCALE, SHIFT = "tanh", "scale", "shift"


class Item(NamedTuple):
    """An op output a checkpointed layer can keep, on one rank, for one micro-batch.

    ``terms``: the saved terms (``Block.saved`` under no recompute) it is; ``size_bytes``: its
    bytes; ``flops_per_token``: the forward FLOPs of one token through the op on this rank,
    what its rerun costs when it is not kept (2 per weight of a projection, the attention
    core's matmuls, one per element of an elementwise op); ``op``, ``width`` and ``nth``: the
    kind of op, its output's last dimension and which of the layer's ops of that kind and
    width it is, in execution order (how a policy recognises it); ``block``: the block that
    runs it; ``own_extra``: kept, it adds to its own block's working set; ``repeat``: how
    many times the layer runs the op (an MoE loop's expert op, once per expert:
    ``memplan.model.sac_moe._loop_ops``), the sizes and FLOPs those runs' together, the
    k-th run's index ``nth + k * stride``."""

    name: str
    terms: tuple[str, ...]
    size_bytes: int
    flops_per_token: float
    op: str
    width: int
    nth: int
    block: str
    own_extra: bool
    repeat: int = 1
    stride: int = 0

    def indices(self) -> tuple[int, ...]:
        """The op's index among the layer's ops of its family and width, each run's."""
        return tuple(self.nth + k * self.stride for k in range(self.repeat))


def ops_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    """Why op-level checkpointing is not modelled for ``spec`` and ``wl``, or None."""
    moe_why = moe_refusal(spec, wl) if spec.moe is not None else None
    mamba_why = mamba_refusal(spec, wl) if spec.mamba is not None else None
    checks = (
        (moe_why is not None, moe_why or ""),
        (spec.mla is not None and wl.precision.policy.autocast is not None,
         "MLA attention under autocast"),
        (spec.linear_attention is not None, "linear-attention layers"),
        (spec.short_conv is not None and (spec.short_conv.conv_bias or spec.moe is not None
                                          or not spec.norm_placement.pre_norm),
         "short-convolution layers with biases, MoE blocks or post norms (modelled as LFM2's "
         "Lfm2ShortConv.slow_forward runs them: memplan.model.sac_conv)"),
        (mamba_why is not None, mamba_why or ""),
        (spec.norm_placement.post_norm and spec.moe is not None,
         f"{spec.norm_placement.value} norms around MoE blocks"),
        (spec.norm_placement.post_norm and not _post_norms_modelled(spec, wl),
         (f"{spec.norm_placement.value} norms of norm_impl {wl.norm_impl.value} (modelled "
          "as transformers runs Gemma's and OLMo 2's RMSNorms, norm_impl upcast-fp32, the "
          "weight scaling the fp32 tensor, and GLM-4's, norm_impl upcast, the weight scaling "
          "the tensor cast back)")),
        (spec.qk_norm is QkNorm.L2 and wl.norm_impl is not NormImpl.UPCAST,
         (f"l2 q/k norms of norm_impl {wl.norm_impl.value} (modelled as Llama 4's "
          "Llama4TextL2Norm runs them, upcast)")),
        (spec.qk_norm is QkNorm.L2 and not spec.rope_complex,
         "l2 q/k norms without Llama 4's complex RoPE (modelled as Llama4TextAttention runs "
         "them: after apply_rotary_emb)"),
        (spec.qk_norm is QkNorm.FULL and wl.norm_impl is not NormImpl.UPCAST_FP32,
         (f"full-width q/k norms of norm_impl {wl.norm_impl.value} (modelled as OLMo 2's "
          "Olmo2RMSNorm runs them, upcast-fp32)")),
        (spec.qk_norm is QkNorm.HEAD and (spec.fused_qkv or wl.fused_qkv),
         "q/k norms on one fused q/k/v projection"),
        (spec.attn_output_gate, "an attention output gate"),
        (wl.attention is not Kernel.FLASH and eager_refusal(spec, wl) is not None,
         eager_refusal(spec, wl) or ""),
        (spec.attn_sinks and wl.attention is Kernel.FLASH,
         ("attention sinks with attention flash (transformers runs GPT-OSS's flash path "
          "through a hub kernel taking the sinks, kernels-community/vllm-flash-attn3, no "
          "aten SDPA op a policy names; modelled with --attention eager, "
          "eager_attention_forward)")),
        (wl.lora_rank > 0, "LoRA adapters"), (wl.compile, "torch.compile"),
        (wl.float8.value != "none", "float8 linears"),
        (wl.attention_impl.value != "generic", f"attention_impl {wl.attention_impl.value}"),
        (spec.activation_impl.value == "xielu",
         f"the {spec.activation_impl.value} activation's saved tensors"),
    )
    return next((why for cond, why in checks if cond), None)


def mamba_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    """Why a model's Mamba2 layers' ops are not modelled (``memplan.model.sac_mamba``: Granite
    4.0-H's layers on transformers 5.3's torch_forward or 5.23's einsum scan (``mamba_kernel``
    torch, torch-einsum), dense or with MoE blocks, which
    ``moe_refusal`` checks as in any MoE layer), or None."""
    m = spec.mamba
    assert m is not None
    # (a kind's layers are MoE layers or not all alike: ``layer.ops_kinds``)
    checks = ((spec.moe is not None and not searched_moe(spec),
               "Mamba layers with MoE blocks on some layers only"),
              (not m.parallel_attention and not m.gated_norm,
               "Mamba layers without the gated norm"),
              (not m.parallel_attention and m.gated_norm and m.norm_before_gate,
               "norm_before_gate outside Falcon-H1's parallel layers (Granite 4.0-H's "
               "GraniteMoeHybridRMSNormGated gates first)"),
              (not spec.norm_placement.pre_norm, "Mamba layers with post norms"))
    why = next((why for cond, why in checks if cond), None)
    return None if why is None else (
        f"{why} (modelled: Granite 4.0-H's Mamba2 layers, dense or with MoE blocks, as "
        "transformers 5.3's GraniteMoeHybridMambaLayer.torch_forward runs them (mamba_kernel "
        "torch) and 5.23's forward (torch-einsum), and Falcon-H1's "
        "parallel layers as FalconH1Mixer does on either: memplan.model.sac_mamba, "
        "memplan.model.sac_falcon)")


def _post_norms_modelled(spec: ModelSpec, wl: Workload) -> bool:
    """Whether a layer's post norms (``NormPlacement.post_norm``) run as ``_norm_ops`` counts
    them: RMSNorms upcast to fp32 whose weight scales the fp32 tensor (``norm_scale_fp32``
    under ``NormImpl.UPCAST_FP32``: Gemma2RMSNorm.forward, Olmo2RMSNorm.forward), or the
    tensor cast back to the input's dtype (``NormImpl.UPCAST`` without ``norm_scale_fp32``:
    models/glm4/modeling_glm4.py Glm4RMSNorm.forward, ``self.weight * hidden_states.to(
    input_dtype)``, Llama's norm; Glm4DecoderLayer.forward runs input_layernorm, the
    attention, post_self_attn_layernorm, the residual add, post_attention_layernorm (the
    MLP's pre norm), the MLP, post_mlp_layernorm: memplan's attn_norm, attn_post_norm,
    mlp_norm and mlp_post_norm; transformers 5.3)."""
    if spec.norm is not NormKind.RMSNORM:
        return False
    if wl.norm_impl is NormImpl.UPCAST_FP32:
        return spec.norm_scale_fp32
    return wl.norm_impl is NormImpl.UPCAST and not spec.norm_scale_fp32


def kept_refusal(kept: tuple[Item, ...], dm: Dims) -> str | None:
    """Why keeping ``kept`` is not modelled, or None: a norm's saved tensors that no op a
    policy counts makes (``NORM`` items) cannot be kept, for the emitted policy would
    recompute them (``memplan.report.sac_policy``: "Not expressible, recomputed instead")
    while the estimate counted them kept. So a fused kernel's, a LayerNorm's, an RMSNorm's
    in fp32 (its casts no ops), under sequence parallelism (the next linear saves the
    gathered output, no op of the norm's), and of an upcast-fp32 norm those whose op's index
    differs by implementation (``_upcast_fp32_ops``: the reference model's and litgpt's
    fp32 product ``normed``; Gemma 2's, OLMo 2's and GPT-OSS's casts). ``plan --recompute
    auto`` never chooses them (``memplan.planning.save_sets.searchable``). Under autocast
    the layer's norms run in fp32 on the fp32 residual stream, their input casts no ops
    (``input_fp32`` is the stream itself), and what the layer saves of their output is each
    next linear's own low-precision cast of it (``aten._to_copy``, one per linear, beside
    the casts of the weights); a q/k norm reads the projection's bf16 output, its casts
    real ops of SDPA's casts' family and width (traced: tests/traced/test_sac_policy.py)."""
    names = [i.name for i in kept if i.op == NORM]
    if not names:
        return None
    if dm.autocast:
        return f"a norm's tensors kept under autocast ({', '.join(names)})"
    return f"a norm's tensors no policy names kept ({', '.join(names)})"


def check_kept(kept: tuple[Item, ...], dm: Dims, items: tuple[Item, ...] = ()) -> None:
    why = kept_refusal(kept, dm)
    if why is None:
        return
    # (what of the norms a policy does name, ``items`` being the layer's)
    named = [i.name for i in items if i.block in GROUPS["norms"] and i.op != NORM]
    instead = (f"the norms' tensors a policy names ({', '.join(named)})" if named
               else "the projections, attn.out and the MLP's ops")
    if dm.autocast:
        raise LayoutError("recompute ops does not model this save list",
                          f"recompute ops with {why}: not modelled (under autocast a norm's "
                          "saved tensors are no op outputs a policy names); name the "
                          "projections, attn.out and the MLP's ops instead")
    raise LayoutError("recompute ops does not model this save list",
                      f"recompute ops with {why}: their ops differ by implementation (a fused "
                      "kernel, LayerNorm, fp32's no-op casts, sequence parallelism's gathered "
                      "output, an upcast-fp32 norm's products or casts), so an emitted policy "
                      f"would recompute them; name {instead} instead")


def moe_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    """Why an MoE layer's ops cannot be kept or named one by one, or None: modelled for
    transformers' grouped experts (``MoeImpl.GROUPED``, integrations/moe.py
    ``grouped_mm_experts_forward``: a fixed count of ops per layer whatever the routing) of
    gated, stacked, bias-free experts behind a softmax router (Mixtral's), DeepSeek-V3's
    sigmoid router or a top-k softmax router (Granite's: ``memplan.model.sac_moe.
    _topk_softmax_ops``; GPT-OSS's, with its bias), and GPT-OSS's biased experts with their
    clamped SwiGLU (``memplan.model.sac_moe._clamped_ops``); and for memplan's reference
    loop (``MoeImpl.LOOP``: ``memplan.model.sac_moe._loop_ops``, fixed counts once every
    expert receives a row) of gated or GPT-OSS's clamped experts behind the reference's
    router variants (``loop_refusal``: Mixtral's softmax router, its linear in fp32 where
    ``router_fp32`` says), with shared experts after the loop, behind a sigmoid gate or not.
    Experts as wide as the hidden size or a head only where every product of that width is
    counted (``_norm_products_counted``); in the loop the shared experts together alike
    (``loop_refusal``)."""
    moe = spec.moe
    assert moe is not None
    checks = (
        (wl.moe_impl is MoeImpl.EVERY,
         "moe_impl every (Llama 4's Llama4TextMoe.forward: the input repeated per expert, "
         "two batched matmuls over every token, not named op by op; modelled for "
         "transformers' grouped experts, moe_impl grouped, and the loop)"),
        (wl.moe_impl is MoeImpl.PARALLEL,
         "moe_impl parallel (its op counts follow the routing: one F.linear per expert "
         "over its split; modelled for transformers' grouped experts, moe_impl grouped, "
         "and the loop)"),
        (wl.moe_impl is MoeImpl.TITAN,
         "moe_impl titan (torchtitan's MoE block, models/common/moe.py: its ops are not "
         "named one by one yet; modelled under recompute none, full and torchtitan's per-op "
         "SAC)"),
        (wl.moe_impl is MoeImpl.LOOP and loop_refusal(spec, wl) is not None,
         loop_refusal(spec, wl) or ""),
        (moe.router_fp32 and not moe.shared_experts_last and wl.moe_impl is not MoeImpl.LOOP,
         "an fp32 softmax router (Hunyuan's; DeepSeek-V3's sigmoid router is modelled)"),
        (moe.clamped_swiglu and not spec.mlp_bias,
         "GPT-OSS's clamped SwiGLU without its expert biases"),
        (spec.mlp_bias and not moe.clamped_swiglu,
         "expert biases without GPT-OSS's clamped SwiGLU (modelled as GptOssExperts runs "
         "them: memplan.model.sac_moe._clamped_ops)"),
        (not spec.mlp.gated, "ungated experts"),
        (moe.expert_ffn_hidden_size in (spec.hidden_size, spec.head_dim)
         and not _norm_products_counted(spec, wl),
         "experts as wide as the hidden size or a head (their products share its width)"),
    )
    return next((f"MoE layers with {why}" for cond, why in checks if cond), None)


def loop_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    """Why memplan's reference loop (``MoeImpl.LOOP``: memplan/profile/reference.py
    ``MoE.forward``) is not named op by op for ``spec``, or None. Its experts are gated MLPs
    or GPT-OSS's clamped ones (``clamped_swiglu``: ``memplan.model.sac_moe.
    _loop_clamped_ops``). Its router's ops are modelled for a softmax in fp32 of one linear,
    the top-k renormalised and cast to the block's dtype (Mixtral's;
    ``router_weights_cast``'s cast is the one the reference makes anyway), its linear on
    fp32 copies where the spec says so (``router_fp32``), or a softmax of the top-k logits
    (``router_topk_softmax``, on fp32 logits with ``router_logits_fp32``), ERNIE 4.5's
    clamped renormalisation and held logits (``router_norm_clamped``,
    ``router_logits_held``) but not its fp32 weight (``router_weight_fp32``); the other
    router variants the reference runs (``MoE._route``) are refused; its shared experts are
    one MLP of the experts' kind, the shared experts' widths together, run after the loop
    whatever the spec's order (``memplan.model.sac_moe._loop_shared_ops``), behind
    Qwen2-MoE's sigmoid gate where the spec has one. Its counts hold where every expert
    receives at least one routed row of each micro-batch (an expert with none skips its ops,
    ``if rows.numel() == 0: continue``, and the indices after it shift): refused where the
    micro-batch routes fewer rows than there are experts, so that one is certainly empty;
    assumed otherwise (any realistic batch: thousands of rows over tens of experts)."""
    moe = spec.moe
    assert moe is not None
    # (``router_weights_cast``: the cast the reference makes whatever the spec says;
    # ``router_fp32``: an fp32 linear, ``sac_moe._loop_fp32_casts``, on a weight of the
    # model's dtype, which the reference builds whatever ``router_weight_fp32`` says; a top-k
    # softmax, GPT-OSS's, or Granite's on fp32 logits; ERNIE's clamped renormalisation and
    # held logits)
    variants = (moe.router_weight_fp32
                or (moe.router_logits_fp32 and not moe.router_topk_softmax)
                or (moe.router_topk_softmax and (moe.router_fp32 or moe.router_norm_clamped
                                                 or moe.router_logits_held)))
    rows = wl.micro_batch_size * wl.seq_len * moe.top_k
    checks = ((moe.num_shared_experts * moe.shared_expert_ffn_hidden_size
               in (spec.hidden_size, spec.head_dim) and not _norm_products_counted(spec, wl),
               "shared experts as wide as the hidden size or a head (their product shares "
               "the norms' width; not traced)"),
              (rows < moe.num_experts,
               f"{rows} routed rows a micro-batch for {moe.num_experts} experts (one "
               "receives none and skips its ops)"),
              (variants, "a router other than a softmax over one linear (Mixtral's, its "
                         "linear in fp32 or not) or of its top-k logits (GPT-OSS's, Granite's)"),
              # Granite 4.0-H's hybrid layers: transformers runs their experts grouped
              (spec.mamba is not None, "Mamba layers (the reference model runs no Mamba "
               "mixer; transformers' Granite 4.0-H runs its experts grouped: moe_impl "
               "grouped)"))
    why = next((why for cond, why in checks if cond), None)
    return None if why is None else (
        f"moe_impl loop and {why} (the loop is modelled as memplan/profile/reference.py "
        "MoE.forward runs Mixtral-like blocks: memplan.model.sac_moe._loop_ops)")


def _norm_products_counted(spec: ModelSpec, wl: Workload) -> bool:
    """Whether every product as wide as the hidden size or a head that a layer runs is an
    op ``layer_ops`` counts, so that experts of that width keep their products' indices: the
    norms' two fp32 products each (``_norm_ops``' ``fp32_ops``: GPT-OSS's GptOssRMSNorm,
    ``norm_scale_fp32`` under upcast-fp32, in any dtype), RoPE's (``_rope_ops``) and the
    block's weighting (``sac_moe._moe_ops``)."""
    return (spec.norm is NormKind.RMSNORM and wl.norm_impl is NormImpl.UPCAST_FP32
            and spec.norm_scale_fp32 and spec.qk_norm is QkNorm.NONE)


def check_supported(spec: ModelSpec, wl: Workload) -> None:
    why = ops_refusal(spec, wl)
    if why is not None:
        raise LayoutError("recompute ops is not modelled with this layer",
                          f"recompute ops with {why}: op-level checkpointing is modelled for "
                          "pre-, sandwich and post-norm and parallel layers with SDPA, eager "
                          "or MLA attention (or LFM2's short convolutions, Granite 4.0-H's "
                          "Mamba2 layers) and a dense MLP, transformers' grouped experts or "
                          "the reference loop, without LoRA or compile")


def matmul_shapes(spec: ModelSpec, t: int, fused_qkv: bool = False
                  ) -> list[tuple[str, int, int, int]]:
    """A dense layer's projections in execution order as (item name, d_in, d_out on this
    rank, output width on this rank); the MLP's down projection last (never rerun). With
    ``fused_qkv`` one q/k/v projection (torchtitan's ``wqkv``, Phi3Attention's ``qkv_proj``),
    ``attn.qkv``; with ``ModelSpec.fused_gate_up`` one gate/up projection (Phi3MLP's
    ``gate_up_proj``), ``mlp.gate_up``."""
    h, q, kv, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_hidden_size
    qkv = (q + 2 * kv) // t
    attn = ([("attn.qkv", h, qkv, qkv)] if fused_qkv else
            [("attn.q", h, q // t, q // t), ("attn.k", h, kv // t, kv // t),
             ("attn.v", h, kv // t, kv // t)]) + [("attn.o_proj", q // t, h, h)]
    if spec.mlp.gated and spec.fused_gate_up:  # Phi3MLP's gate_up_proj: one mm, 2 f wide
        first = [("mlp.gate_up", h, 2 * f // t, 2 * f // t)]
    elif spec.mlp.gated:
        first = [("mlp.gate", h, f // t, f // t), ("mlp.up", h, f // t, f // t)]
    else:
        first = [("mlp.fc1", h, f // t, f // t)]
    return attn + first + [("mlp.down", f // t, h, h)]


@lru_cache(maxsize=512)
def layer_ops(spec: ModelSpec, wl: Workload, dm: Dims,
              saved: tuple[Term, ...], moe: bool = False, nope: bool = False
              ) -> tuple[Item, ...]:
    """The ops of one layer on this rank a policy counts, in execution order (``nth``
    numbered along them per family and width): the items (``layer_items``), and the ops no
    item keeps (named ""): a named norm's fp32 product ``x * rstd`` and a q/k norm's output
    (``_norm_ops``), RoPE's four products of width ``rope_dim`` (transformers'
    ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin``, then k's; the reference
    model's ``apply_rope``), and a dense MLP's down projection (never rerun: early stop;
    with post norms an item, ``mlp.down``, and the post norm's ops after it).
    ``saved``: what the layer saves without recompute (``memplan.model.layer.ops_items``
    gives it); ``moe``: an MoE layer, whose feed-forward's ops follow
    (``memplan.model.sac_moe.moe_items``); ``nope``: a layer without RoPE
    (``ModelSpec.nope_layer_interval``; in Llama 4 without its q/k norm either:
    ``_complex_rope_ops``)."""
    check_supported(spec, wl)
    terms = {t.name: t.size_bytes for t in saved}
    tokens, e, t = dm.tokens, dm.e, dm.tp
    named = _norms_nameable(spec, wl, dm, terms)

    def matmul(name: str, d_in: int, d_out: int, width: int) -> Item:
        rope = name in ("attn.q", "attn.k", "attn.qkv") and spec.position is PositionKind.ROPE
        covers = _COVERS.get(name, (name,))
        # (a row-parallel output is the full partial sum on each rank)
        return Item(name, tuple(c for c in covers if c in terms), tokens * width * e,
                    2.0 * d_in * d_out + (2.0 * d_out if _has_bias(spec, name) else 0.0),
                    MATMUL, width, 0, name.split(".")[0], rope or name == "mlp.gate")

    h = spec.hidden_size
    fp32 = _fp32_ops(spec, wl, dm)
    place = spec.norm_placement
    out = _norm_ops("attn_norm", terms, h, h, named, fp32_ops=fp32) if place.pre_norm else []
    fused = spec.fused_qkv or wl.fused_qkv
    mm = {m[0]: m for m in matmul_shapes(spec, t, fused)}
    if spec.mla is not None:
        out += _mla_ops(spec, dm, terms, named, fp32)
    else:
        out += _attention_ops(spec, wl, dm, terms, named, fp32,
                              [matmul(*m) for m in mm.values()], nope)
    if place.post_norm:
        # Gemma2DecoderLayer.forward: post_attention_layernorm on the attention's output
        # before the residual add (Olmo2DecoderLayer.forward: the same, no norm before)
        out += _norm_ops("attn_post_norm", terms, h, h, named, fp32_ops=fp32)
    if place.pre_norm and not spec.parallel_block:
        # (a parallel layer's MLP reads the attention norm's output: Cohere2DecoderLayer.
        # forward, ``self.mlp(hidden_states)`` after ``self.self_attn(hidden_states)``)
        out += _norm_ops("mlp_norm", terms, h, h, named, fp32_ops=fp32)
    if not moe:  # (an MoE block's items follow: ``memplan.model.sac_moe.moe_items``)
        mlp = [matmul(*mm[name]) for name in ("mlp.gate_up", "mlp.gate", "mlp.up", "mlp.fc1",
                                              "mlp.down") if name in mm]
        f = spec.ffn_hidden_size // t
        out += (_gelu_new_ops(terms, mlp, f, dm) if spec.activation_impl.value == "gelu_new"
                else _dense_mlp_ops(spec, terms, mlp, f))
        out += _down_ops(spec, terms, mlp[-1], named, fp32)
    return numbered(out)


def _attention_ops(spec: ModelSpec, wl: Workload, dm: Dims, terms: dict[str, int],
                   named: str, fp32: bool, matmuls: list[Item], nope: bool = False
                   ) -> list[Item]:
    """A generic attention block's ops in execution order (``layer_ops``): the q, k, v (or
    fused q/k/v) projections, each q/k norm after its projection, RoPE's four products (none
    in a NoPE layer, ``nope``; Llama 4's complex RoPE and L2 q/k norms after the three
    projections: ``_complex_rope_ops``), the core (``_core_ops``: SDPA's kernel, ``attn.out``
    with its logsumexp, or an eager core's ops) and the output projection (``matmuls``: the
    layer's projection items, ``matmul_shapes``' order)."""
    mm = {i.name: i for i in matmuls}
    out = []
    for name in ("attn.qkv",) if "attn.qkv" in mm else ("attn.q", "attn.k", "attn.v"):
        out.append(mm[name])
        if name in ("attn.q", "attn.k") and spec.qk_norm is not QkNorm.L2:
            out += _qk_norm_ops(spec, name, mm[name].width, terms, named, fp32)
    if spec.rope_complex and spec.position is PositionKind.ROPE:
        out += _complex_rope_ops(spec, dm, terms, nope)
    elif spec.position is PositionKind.ROPE and not nope:
        out += _rope_ops(spec)
    return out + _core_ops(spec, wl, dm, terms) + [mm["attn.o_proj"]]


def _rope_ops(spec: ModelSpec) -> list[Item]:
    """RoPE's ops a policy counts, none an item: transformers' ``apply_rotary_pos_emb``'s
    four products of width ``rope_dim`` (``q * cos + rotate_half(q) * sin``, then k's;
    rotate_half's ``cat`` is no family an attention layer's items have). With half-width
    tables (``rope_half_tables``: models/gpt_oss/modeling_gpt_oss.py ``_apply_rotary_emb``,
    ``first_half, second_half = torch.chunk(x, 2, dim=-1)``, four products of half the
    width, ``torch.cat((first_, second_), dim=-1)``) eight products of rope_dim / 2 and two
    concatenations of rope_dim (traced: transformers' GPT-OSS, each layer's ops)."""
    if spec.rope_half_tables:
        half = [_unkept(PRODUCT, spec.rope_dim // 2, "attn")] * 4
        return (half + [_unkept(CAT, spec.rope_dim, "attn")]) * 2
    return [_unkept(PRODUCT, spec.rope_dim, "attn")] * 4


def _mla_ops(spec: ModelSpec, dm: Dims, terms: dict[str, int], named: str,
            fp32: bool) -> list:
    """The attention's ops of an MLA layer (the module docstring; ``sac_ops.layer_ops``
    numbers them; ``memplan.model.sac_mla``'s docstring): ``terms``, the layer's saved terms without recompute; ``named``: the
    norms named by their ops; ``fp32``: an unnamed norm's rsqrt and products counted. Kept,
    an item adds to the block's working set (``own_extra``) unless it is one of the block's
    saved terms, which the checkpointed block's working set holds (``Mla.working_set``)."""
    mla, t, e, tokens = spec.mla, dm.tp, dm.e, dm.tokens
    assert mla is not None
    h, heads = spec.hidden_size, spec.num_attention_heads // t
    q_width, kv_a = heads * spec.head_dim, mla.kv_lora_rank + mla.qk_rope_head_dim
    kv_up = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    down_bias = 2.0 if spec.qkv_bias else 0.0

    def proj(name: str, d_in: int, width: int, covers: tuple[str, ...], bias: float = 0.0,
             own: bool = True):
        held = tuple(c for c in covers if c in terms)
        return Item(name, held, tokens * width * e, 2.0 * d_in * width + bias * width,
                    MATMUL, width, 0, "attn", own and not held)

    def norm(prefix: str, width: int) -> list:
        ops = _norm_ops(prefix, terms, width, width, named, "attn", fp32)
        ops = [i._replace(own_extra=False) for i in ops]
        # in fp32 the norm's input is the down projection's output: its item keeps it
        return [i for i in ops if not (fp32 and i.name == f"{prefix}.input_fp32")]

    out = []
    if mla.q_lora_rank:
        out.append(proj("mla.q_a", h, mla.q_lora_rank,
                        ("mla.q_norm.input_fp32",) if fp32 else (), down_bias))
        out += norm("mla.q_norm", mla.q_lora_rank)
        out.append(proj("mla.q_b", mla.q_lora_rank, q_width, ()))
    else:
        out.append(proj("mla.q_proj", h, q_width, ()))
    out.append(proj("mla.kv_a", h, kv_a, ("mla.kv_norm.input_fp32",) if fp32 else (),
                    down_bias))
    out += norm("mla.kv_norm", mla.kv_lora_rank)
    out.append(proj("mla.kv_b", mla.kv_lora_rank, kv_up, ("mla.kv_up",)))
    out += [_unkept(PRODUCT, mla.qk_rope_head_dim, "attn")] * 4
    out += [Item(name, (name,), terms[name], float(heads * spec.head_dim), CAT,
                 spec.head_dim, 0, "attn", False) for name in ("mla.q", "mla.k")]
    core = MlaBlock().core_flops_per_token(spec, dm.s_kv) / t
    out.append(Item("mla.out", ("mla.out", "mla.lse"), terms["mla.out"] + terms["mla.lse"],
                    core, ATTENTION_KERNEL, q_width, 0, "attn", False))
    out.append(proj("mla.o_proj", spec.attn_out_size // t, h, (),
                    2.0 if spec.attn_out_bias else 0.0, own=False))
    return out


def _down_ops(spec: ModelSpec, terms: dict[str, int], down: Item, named: str,
              fp32: bool) -> list[Item]:
    """A dense MLP's down projection and what follows it among the layer's ops. With a post
    norm, which reads its output and saves its fp32 copy (in fp32 the tensor itself), the
    rerun reaches the down projection: an item, kept its output skips it (Gemma2DecoderLayer.
    forward: post_feedforward_layernorm); so with dropout on the MLP's output, whose mask the
    rerun rebuilds from the forward's restored RNG state (torch/utils/checkpoint.py,
    ``preserve_rng_state``). Otherwise it never reruns (early stop): counted, no item."""
    h = spec.hidden_size
    if spec.norm_placement.post_norm:
        return [down] + _norm_ops("mlp_post_norm", terms, h, h, named, fp32_ops=fp32)
    return [down] if spec.dropout > 0 else [_unkept(MATMUL, down.width, "mlp")]


def _dense_mlp_ops(spec: ModelSpec, terms: dict[str, int], mlp: list[Item], f: int
                   ) -> list[Item]:
    """A dense MLP's items before its down projection, in execution order: the gate (or
    first) projection, the activation, the up projection and the product (``mlp``: its
    projections' items, the down projection last; ``f``: its width on this rank)."""
    act = Item("mlp.act", ("mlp.act",), terms["mlp.act"], float(f), ACTIVATION, f, 0, "mlp",
               False)
    if not spec.mlp.gated:
        return [mlp[0], act]
    if spec.fused_gate_up:
        # Phi3MLP.forward: gate_up_proj, chunk (views), act_fn(gate), up_states * act
        prod = Item("mlp.prod", ("mlp.prod",), terms["mlp.prod"], float(f), PRODUCT, f, 0,
                    "mlp", False)
        return [mlp[0], act, prod]
    prod = Item("mlp.prod", ("mlp.prod",), terms["mlp.prod"], float(f), PRODUCT, f, 0, "mlp",
                False)
    return [mlp[0], act, mlp[1], prod]


# the saved terms a fused projection's output is (``matmul_shapes``)
_COVERS = {"attn.qkv": ("attn.q", "attn.k", "attn.v"), "mlp.gate_up": ("mlp.gate", "mlp.up")}
# an item alive to its MLP's end whether kept or not: Phi3MLP.forward's ``gate`` is a view of
# gate_up_proj's output, a local to the function's return (``forward_peak``)
TO_MLP_END = "mlp.gate_up"


def _qk_norm_ops(spec: ModelSpec, name: str, local: int, terms: dict[str, int], named: str,
                 fp32: bool) -> list[Item]:
    """The q (or k) norm's ops after its projection ``name`` of ``local`` outputs on this
    rank: per head (Qwen3Attention.forward: ``q_norm(q_proj(x).view(..., head_dim))``, then
    k's), or over the whole projection (Olmo2Attention.forward: ``q_norm(q_proj(x))``)."""
    norm = f"attn.{name[-1]}_norm"
    if spec.qk_norm is QkNorm.HEAD:  # rows of head_dim: the rank's heads'
        return _norm_ops(norm, terms, spec.head_dim, local, named, "attn", fp32)
    if spec.qk_norm is QkNorm.FULL:
        return _norm_ops(norm, terms, local, local, "", "attn", fp32)
    return []


def _complex_rope_ops(spec: ModelSpec, dm: Dims, terms: dict[str, int], nope: bool
                      ) -> list[Item]:
    """Llama 4's RoPE and L2 q/k norms after the three projections (models/llama4/
    modeling_llama4.py Llama4TextAttention.forward), in execution order. ``apply_rotary_emb``:
    ``xq.float()`` and ``xk.float()`` (``aten._to_copy``, head_dim wide; no ops in fp32), the
    complex products by the table (``aten.mul`` of complex64, rope_dim / 2 wide; each saves
    the table alone, which needs no gradient), ``type_as`` back (two more casts; none in
    fp32). Then ``qk_norm`` on q, then on k (``_l2_norm_ops``). A NoPE layer (``nope``)
    rotates nothing and norms nothing; its temperature tuning (``attn_temperature_tuning``,
    on in Llama4TextConfig's defaults and both published configs) scales q: on the s
    positions ``cache_position.float()``, ``+ 1.0``, ``/ floor_scale``, ``floor``,
    ``log1p``, ``* attn_scale``, ``+ 1.0``, then ``query_states * attn_scales`` (fp32,
    head_dim wide) and ``.to(query_states.dtype)`` (none in fp32): counted, kept by no item
    (the product saves the (s,) scales alone). Traced: tests/traced/test_sac_policy.py,
    Llama 4 narrowed with s = h, the positions' cast among the norms' casts."""
    hd, half, low = spec.head_dim, spec.rope_dim // 2, dm.e < FP32_BYTES
    if nope:
        scale = [_unkept(COPY, dm.s, "attn"), _unkept(SHIFT, dm.s, "attn"),
                 _unkept(SCALE, dm.s, "attn"), _unkept(SHIFT, dm.s, "attn"),
                 _unkept(PRODUCT, hd, "attn")]
        return scale + [_unkept(COPY, hd, "attn")] * low
    casts = [_unkept(COPY, hd, "attn")] * (2 * low)
    products = [_unkept(PRODUCT, half, "attn")] * 2
    if spec.qk_norm is not QkNorm.L2:
        return casts + products + casts
    if not low and spec.rope_dim == hd:
        # in fp32 each norm's x.float() is RoPE's output itself, a view of its product's
        products = [_norm_item(f"attn.{n}_norm.input_fp32", spec, dm, terms, PRODUCT, half)
                    for n in "qk"]
    return (casts + products + casts + _l2_norm_ops("attn.q_norm", spec, dm, terms)
            + _l2_norm_ops("attn.k_norm", spec, dm, terms))


def _norm_item(name: str, spec: ModelSpec, dm: Dims, terms: dict[str, int], op: str,
               width: int) -> Item:
    """A q/k norm's saved term ``name`` as an item of op ``op``, ``width`` wide: one FLOP an
    element (the rank's heads of the q or k norm), adding to the attention's working set."""
    heads = spec.num_attention_heads if ".q_norm." in name else spec.num_kv_heads
    return Item(name, (name,), terms[name], float(heads // dm.tp * spec.head_dim), op, width,
                0, "attn", True)


def _l2_norm_ops(norm: str, spec: ModelSpec, dm: Dims, terms: dict[str, int]) -> list[Item]:
    """Llama 4's L2 norm of q (or k) after RoPE (Llama4TextL2Norm.forward:
    ``self._norm(x.float()).type_as(x)``, ``_norm``: ``x * torch.rsqrt(x.pow(2).mean(-1,
    keepdim=True) + self.eps)``, no weight), per head on rows of head_dim, in execution
    order: ``x.float()`` (``input_fp32``, ``aten._to_copy`` to fp32; saved by ``pow`` and the
    product), ``pow``, ``mean``, ``+ eps`` (no ops a policy counts), ``rsqrt`` (``stats``,
    fp32, one per row; saved by itself and the product), ``x * rstd`` (fp32, saved by no one)
    and ``type_as`` (16-bit: the tensor SDPA saves, ``attn.q``'s term; kept by no item). One
    FLOP an element each. In fp32 the casts are no ops and ``input_fp32`` is RoPE's product
    (``_complex_rope_ops``); with partial rotation a norm's term no op makes (``NORM``)."""
    hd, fp32 = spec.head_dim, f"{norm}.input_fp32"
    stats = [_norm_item(f"{norm}.stats", spec, dm, terms, RSQRT, 1),
             _unkept(PRODUCT, hd, "attn")]
    if dm.e >= FP32_BYTES:
        whole = spec.rope_dim == hd  # (else no op's output is the norm's input)
        return ([] if whole else [_norm_item(fp32, spec, dm, terms, NORM, hd)]) + stats
    return [_norm_item(fp32, spec, dm, terms, COPY, hd)] + stats + [_unkept(COPY, hd, "attn")]


def _fp32_ops(spec: ModelSpec, wl: Workload, dm: Dims) -> bool:
    """Whether an unnamed RMSNorm's ``rsqrt`` and two products are ops a policy counts (in
    fp32: ``_norm_ops``' ``fp32_ops``): an upcast RMSNorm in fp32 (fp32 weights, or under
    autocast on the fp32 stream), and in any dtype a model's own RMSNorm that multiplies its
    fp32 normalised tensor by the weight (``ModelSpec.norm_scale_fp32`` under
    ``NormImpl.UPCAST_FP32``: models/gemma2/modeling_gemma2.py Gemma2RMSNorm._norm ``x *
    torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`` then ``output * (1.0 +
    self.weight.float())``; models/olmo2/modeling_olmo2.py Olmo2RMSNorm.forward
    ``hidden_states * torch.rsqrt(variance + eps)`` then ``self.weight * hidden_states``)."""
    if spec.norm is not NormKind.RMSNORM:
        return False
    if wl.norm_impl is NormImpl.UPCAST_FP32:
        return spec.norm_scale_fp32
    return wl.norm_impl is NormImpl.UPCAST and (dm.e >= FP32_BYTES or dm.autocast)


def layer_items(spec: ModelSpec, wl: Workload, dm: Dims,
                saved: tuple[Term, ...], moe: bool = False) -> tuple[Item, ...]:
    """The items of one layer on this rank, in execution order (``Item``; ``layer_ops``)."""
    return tuple(i for i in layer_ops(spec, wl, dm, saved, moe) if i.name)


def _unkept(op: str, width: int, block: str) -> Item:
    """An op a policy counts that no item keeps."""
    return Item("", (), 0, 0.0, op, width, 0, block, False)


def numbered(ops: list[Item], seen: dict[tuple[str, int], int] | None = None
             ) -> tuple[Item, ...]:
    """``ops`` with each one's index among the ops of its family and width before it (after
    ``seen``'s counts); an unnamed norm's tensors (``NORM``) are not counted."""
    seen = dict(seen or {})
    out = []
    for i in ops:
        if i.op != NORM:
            nth = seen.get((i.op, i.width), 0)
            seen[(i.op, i.width)] = nth + 1
            i = i._replace(nth=nth)
        out.append(i)
    return tuple(out)


def counts(ops: tuple[Item, ...]) -> dict[tuple[str, int], int]:
    """How many of ``ops`` a policy counts per (family, width)."""
    seen: dict[tuple[str, int], int] = {}
    for i in ops:
        if i.op != NORM:
            seen[(i.op, i.width)] = seen.get((i.op, i.width), 0) + i.repeat
    return seen


def _has_bias(spec: ModelSpec, name: str) -> bool:
    if name.startswith("mlp."):
        return spec.mlp_bias
    return spec.attn_out_bias if name == "attn.o_proj" else spec.qkv_bias


def _norm_ops(norm: str, terms: dict[str, int], width: int, per_token: int, named: str,
              block: str = "", fp32_ops: bool = False) -> list[Item]:
    """A norm's saved terms, each an item of its own: elementwise, one FLOP per element
    (``per_token`` elements per token: a q/k norm's rows are the rank's heads). ``named``
    (``_norms_nameable``): which of its ops a policy names, in execution order; a term no
    named op makes is a ``NORM`` item (its op differs by implementation; kept, refused:
    ``kept_refusal``). ``UPCAST_OPS``: Hugging Face's ``LlamaRMSNorm.forward`` and
    ``Qwen3RMSNorm.forward``, the reference model's ``Norm`` under upcast:
    ``x.to(float32)`` (``input_fp32``), ``rsqrt`` of the mean square (``stats``, of width
    1), ``x * rstd`` (fp32, saved by no one), ``.to(dtype)`` (``normed``), ``weight *
    normed`` (``output``: a q/k norm's goes to RoPE, which saves nothing of it).
    ``CAST_OPS`` and ``SCALE_OPS``: an upcast-fp32 RMSNorm (``_upcast_fp32_ops``).
    ``block``: the block that runs it (the norm's own by default; a q/k norm's, the
    attention). ``fp32_ops``: unnamed, an upcast RMSNorm in fp32 (fp32 weights, or under
    autocast on the fp32 stream), whose casts are no ops but whose rsqrt and two products a
    policy counts all the same."""
    block = block or norm
    mine = {name: size for name, size in terms.items() if name.startswith(norm + ".")}
    own = block != norm  # a q/k norm's tensors add to the attention's working set
    if named in (CAST_OPS, SCALE_OPS):
        return _upcast_fp32_ops(norm, mine, width, per_token, named, block)
    if not named:
        counted = ([_unkept(RSQRT, 1, block)] + [_unkept(PRODUCT, width, block)] * 2
                   if fp32_ops else [])
        return [Item(name, (name,), size, float(per_token), NORM, width, 0, block, own)
                for name, size in mine.items()] + counted

    def item(name: str, op: str, w: int) -> Item:
        full = f"{norm}.{name}"
        if full not in mine:
            return _unkept(op, w, block)
        return Item(full, (full,), mine[full], float(per_token), op, w, 0, block, own)

    return [item("input_fp32", COPY, width), item("stats", RSQRT, 1),
            _unkept(PRODUCT, width, block), item("normed", COPY, width),
            item("output", PRODUCT, width)]


def _upcast_fp32_ops(norm: str, mine: dict[str, int], width: int, per_token: int,
                     named: str, block: str) -> list[Item]:
    """An upcast-fp32 RMSNorm's ops (``NormImpl.UPCAST_FP32``, a layer norm of ``width`` h)
    in execution order, each saved term ``mine`` an item where the op that makes it is one a
    policy counts the same in every implementation of the kind ``named`` says (a term of
    another op is a ``NORM`` item). Traced (aten ops under TorchDispatchMode, bf16):

    - the reference model's ``Norm.forward`` (memplan/profile/reference.py): ``x.float()``
      (``_to_copy``: ``input_fp32``), ``pow``, ``mean``, ``+ eps``, ``rsqrt`` (``stats``),
      ``xf * rstd`` (``mul``: ``normed``, fp32), ``self.weight.float()`` (``_to_copy`` of
      the weight, h wide: ``weight_fp32``), the product (``mul``), ``.to(x.dtype)``
      (``_to_copy``: ``output``); litgpt's RMSNorm.forward (litgpt/model.py) runs the same
      casts, rsqrt and products but squares by ``x * x``, a third fp32 product of width h
      before rsqrt. So without ``norm_scale_fp32`` (``CAST_OPS``) the casts and rsqrt are
      named and counted, the products neither (``normed`` is a ``NORM`` item: its index
      among them differs).
    - a model's own norm under ``norm_scale_fp32`` (``SCALE_OPS``; transformers 5.3):
      Gemma2RMSNorm.forward casts the weight (``self.weight.float()``, ``_to_copy``) and adds
      1 (the tensor its product saves), Olmo2RMSNorm.forward and GptOssRMSNorm.forward
      multiply by the 16-bit weight (no cast): the casts' indices differ by model, so the
      casts are neither named nor counted (``input_fp32``, ``weight_fp32`` and ``output``
      are ``NORM`` items); ``pow``, ``rsqrt`` (``stats``) and the two fp32 products (the
      first ``normed``) are every one's, named and counted."""
    rows = mine[f"{norm}.stats"] // FP32_BYTES  # (on every token: ``_norms_nameable``)

    def item(name: str, op: str, w: int, named_here: bool) -> Item:
        full = f"{norm}.{name}"
        flops = float(per_token) if name != "weight_fp32" else float(width) / rows
        if full not in mine:
            return _unkept(op, w, block) if named_here else _unkept(NORM, w, block)
        return Item(full, (full,), mine[full], flops, op if named_here else NORM, w, 0, block,
                    False)

    casts, products = named == CAST_OPS, named == SCALE_OPS
    ops = [item("input_fp32", COPY, width, casts), item("stats", RSQRT, 1, True),
           item("normed", PRODUCT, width, products), item("weight_fp32", COPY, width, casts),
           item("", PRODUCT, width, products), item("output", COPY, width, casts)]
    # (an op neither named nor counted, no term: dropped)
    return [i for i in ops if i.name or i.op != NORM]


def _norms_nameable(spec: ModelSpec, wl: Workload, dm: Dims, terms: dict[str, int],
                    qk_norms: bool = True) -> str:
    """Which ops of the norms a policy names (``_norm_ops``), "" where none: an upcast
    RMSNorm in a 16-bit dtype (in fp32 the casts are no ops), each saved term the bytes of
    the op output it names (not so under sequence parallelism, where the next linear saves
    the gathered output), the q/k norms' too: ``UPCAST_OPS``; under upcast-fp32
    (``_upcast_fp32_ops``, without biases; the layer's own norms and full-width q/k norms
    alone, no MLA, Mamba or short-convolution layers) ``CAST_OPS`` or, with
    ``norm_scale_fp32``, ``SCALE_OPS``. Ops of another block sharing a norm op's family and
    width (RoPE's products where head_dim is h, the gated product where f is) are counted
    with them (``layer_ops``)."""
    if spec.norm is not NormKind.RMSNORM or not wl.norm_impl.upcast \
            or dm.e >= FP32_BYTES or dm.stream_e != dm.e:
        return ""
    h, rows = spec.hidden_size, dm.rows
    named = UPCAST_OPS
    want = {"input_fp32": rows * h * FP32_BYTES, "stats": rows * FP32_BYTES,
            "normed": rows * h * dm.e, "output": rows * h * dm.e}
    if wl.norm_impl is NormImpl.UPCAST_FP32:
        if (spec.norm_bias or spec.mla is not None or spec.mamba is not None
                or spec.short_conv is not None or spec.qk_norm not in (QkNorm.NONE, QkNorm.FULL)):
            return ""
        named = SCALE_OPS if spec.norm_scale_fp32 else CAST_OPS
        want.update(normed=rows * h * FP32_BYTES, weight_fp32=h * FP32_BYTES)
    # (a post norm's output is saved by no one: no term)
    place = spec.norm_placement
    norms = (("attn_norm", "mlp_norm") if place.pre_norm else ()) + (
        ("attn_post_norm", "mlp_post_norm") if place.post_norm else ())
    if any(terms.get(f"{n}.{t}") != b for n in norms for t, b in want.items()
           if t != "output" or not n.endswith("_post_norm")):
        return ""
    if named != UPCAST_OPS:
        return named
    if spec.mla is not None and not _latent_norms_nameable(spec, dm, terms):
        return ""
    if spec.qk_norm is not QkNorm.HEAD or not qk_norms:  # (a layer without attention)
        return named
    # the q and k norms (Qwen3RMSNorm on rows of head_dim, one per head on this rank)
    for norm, width in (("attn.q_norm", spec.q_size), ("attn.k_norm", spec.kv_size)):
        heads = dm.tokens * width // dm.tp // spec.head_dim
        want = {"input_fp32": heads * spec.head_dim * FP32_BYTES, "stats": heads * FP32_BYTES,
                "normed": heads * spec.head_dim * dm.e}
        if any(terms.get(f"{norm}.{t}") != b for t, b in want.items()):
            return ""
    return named


def _latent_norms_nameable(spec: ModelSpec, dm: Dims, terms: dict[str, int]) -> bool:
    """Whether an MLA block's latent norms' saved terms are the bytes of the op outputs
    ``_norm_ops`` names them by: on every token (the down projections are not
    sequence-parallel), ``q_lora_rank`` and ``kv_lora_rank`` wide (``memplan.model.mla.
    _latent_norm``)."""
    mla = spec.mla
    assert mla is not None
    for norm, width in (("mla.q_norm", mla.q_lora_rank), ("mla.kv_norm", mla.kv_lora_rank)):
        if not width:
            continue
        want = {"input_fp32": dm.tokens * width * FP32_BYTES, "stats": dm.tokens * FP32_BYTES,
                "normed": dm.tokens * width * dm.e, "output": dm.tokens * width * dm.e}
        if any(terms.get(f"{norm}.{t}") != b for t, b in want.items()):
            return False
    return True


def valid_names(items: tuple[Item, ...]) -> list[str]:
    """What a save list may name: items, the terms they cover, and the groups (``mamba``
    where the items have a Mamba2 mixer's)."""
    names = [i.name for i in items]
    names += [t for i in items for t in i.terms if t not in names]
    mamba = any(n.startswith("mamba.") for n in names)
    return names + [g for g in GROUPS if g != "mamba" or mamba]


# a save list's name may be scoped ``SCOPE:name`` (scopes may nest: ``stage1:dense:attn.q``):
# a layer kind (``KINDS``: dense and MoE layers) or a pipeline stage (``stage0``, ``stage1``,
# ...); a layer keeps the unscoped names and those scoped to its kind and its stage
KINDS = ("dense", "moe", "conv", "mamba", "attn")
STAGE = "stage"


def _split(name: str) -> tuple[list[str], str]:
    *scopes, base = name.split(":")
    return scopes, base


def _stage_of(scope: str) -> int | None:
    rest = scope[len(STAGE):]
    return int(rest) if scope.startswith(STAGE) and rest.isdigit() else None


@lru_cache(maxsize=1024)  # (every estimate of a plan asks it of its list)
def stage_scoped(save: tuple[str, ...]) -> bool:
    """Whether ``save`` names a pipeline stage (a list per stage)."""
    return any(_stage_of(s) is not None for name in save for s in _split(name)[0])


@lru_cache(maxsize=1024)
def for_stage(save: tuple[str, ...], stage: int) -> tuple[str, ...]:
    """The names of ``save`` that apply on pipeline stage ``stage``, its stage scope removed
    (kind scopes kept), sorted: the list of a stage's layers."""
    out = set()
    for name in save:
        scopes, base = _split(name)
        stages = {_stage_of(s) for s in scopes} - {None}
        if stages and stages != {stage}:
            continue
        out.add(":".join([s for s in scopes if _stage_of(s) is None] + [base]))
    return tuple(sorted(out))


def scoped_stages(save: tuple[str, ...]) -> list[int]:
    """The stages ``save`` names, in order."""
    return sorted({n for name in save for n in map(_stage_of, _split(name)[0])
                   if n is not None})


def check_scopes(save: tuple[str, ...], spec: ModelSpec, pp: int) -> None:
    """Refuses a scope that is neither a layer kind of ``spec`` nor one of its ``pp``
    stages, by name."""
    kinds = {layer_kind_of(spec, i) for i in range(spec.num_layers)}
    for name in save:
        for scope in _split(name)[0]:
            stage = _stage_of(scope)
            if stage is not None and stage >= pp:
                raise MemplanError(f"recompute_save: {name!r} names stage {stage}; with pp "
                                   f"{pp} the stages are stage0..stage{pp - 1}")
            if stage is None and scope not in kinds:
                raise MemplanError(
                    f"recompute_save: unknown scope {scope!r} in {name!r}; a scope is a "
                    f"layer kind of {spec.name} ({', '.join(sorted(kinds))}) or a pipeline "
                    f"stage (stage0, stage1, ...)")


def linear_kind(spec: ModelSpec) -> str | None:
    """The kind (``KINDS``) of a hybrid model's layers without attention: "conv", LFM2's
    short convolutions (``ModelSpec.short_conv``); "mamba", Granite 4.0-H's Mamba2 layers
    (``ModelSpec.mamba``, not beside attention); else None."""
    if spec.short_conv is not None:
        return "conv"
    if spec.mamba is not None and not spec.mamba.parallel_attention:
        return "mamba"
    return None


def layer_kind_of(spec: ModelSpec, index: int) -> str:
    """The kind (``KINDS``) of layer ``index``: in a hybrid model (``linear_kind``) that
    kind or "attn", the attention layers; else "moe" or "dense"."""
    linear = linear_kind(spec)
    if linear is not None:
        return linear if spec.is_linear_layer(index) else "attn"
    return "moe" if spec.is_moe_layer(index) else "dense"


def kind_variant(kind: str) -> str:
    """The layer variant (``memplan.model.layer.layer_blocks``) of the layers of ``kind``:
    "linear" for short-convolution and Mamba2 layers, else the model's attention."""
    return "linear" if kind in ("conv", "mamba") else ""


def default_kind(spec: ModelSpec) -> str:
    """The kind a list names where all of a model's layers are of one kind."""
    if linear_kind(spec) is not None:
        return layer_kind_of(spec, 0)
    return "moe" if searched_moe(spec) else "dense"


def searched_moe(spec: ModelSpec) -> bool:
    """Whether a model's layers are all MoE layers (a save set is then searched and emitted
    for them); a model of dense and MoE layers takes a save list per kind (``moe:`` and
    ``dense:`` scopes)."""
    return spec.moe is not None and all(spec.is_moe_layer(i) for i in range(spec.num_layers))


def resolve(items: tuple[Item, ...], save: tuple[str, ...], spec: ModelSpec,
            kind: str | None = None) -> tuple[Item, ...]:
    """The items a save list keeps in a layer of ``kind`` (``KINDS``; by default the kind
    ``searched_moe`` names), in execution order; an unknown name is refused with the names
    it could be. Stage scopes must have been resolved (``for_stage``)."""
    kind = kind or default_kind(spec)
    chosen: set[str] = set()
    for scoped_name in save:
        scopes, name = _split(scoped_name)
        if any(_stage_of(s) is not None for s in scopes):
            raise MemplanError(f"recompute_save: {scoped_name!r} names a stage, and this "
                               "result is not made per stage (estimate, plan, --reserved "
                               "and --emit-policy are)")
        if any(s != kind for s in scopes):
            continue
        if name in GROUPS and (name != "mamba" or spec.mamba is not None):
            # (the Mamba2 mixer's items: Falcon-H1's block "mamba", Granite 4.0-H's in its
            # mixer's layers' attention block, named mamba.*); a group keeps what a policy
            # names of it: a norm's tensors from ops that differ by implementation (``NORM``,
            # ``kept_refusal``) are recomputed, as the emitted policy does (``assumption``
            # says which), where named one by one they are refused
            chosen |= {i.name for i in items if (i.block in GROUPS[name]
                       or name == "mamba" and i.name.startswith("mamba.")) and i.op != NORM}
            continue
        hits = {i.name for i in items if name == i.name or name in i.terms}
        if not hits:
            linear = linear_kind(spec)
            where = f"{kind} layers" if linear is not None else "layers"
            raise MemplanError(f"recompute_save: unknown name {name!r} for {spec.name}'s "
                               f"{where}; valid: {', '.join(valid_names(items))}"
                               + (f" (scope the names of one kind's layers: {linear}:NAME, "
                                  "attn:NAME)" if linear is not None else ""))
        chosen |= hits
    return tuple(i for i in items if i.name in chosen)


def per_stage(save: tuple[str, ...], pp: int) -> dict[int, tuple[str, ...]] | None:
    """With a list per stage, each of the ``pp`` stages' lists, else None."""
    if not stage_scoped(save):
        return None
    return {s: for_stage(save, s) for s in range(max(pp, *[n + 1 for n in scoped_stages(save)]))}


def stage_lists(kept: list[tuple[str, ...]]) -> tuple[str, ...]:
    """One save list from a list per stage (stage i keeps ``kept[i]``): the names every stage
    keeps unscoped, the others scoped ``stageN:``."""
    common = set.intersection(*(set(k) for k in kept)) if kept else set()
    return tuple(sorted(common | {f"{STAGE}{i}:{n}" for i, k in enumerate(kept)
                                  for n in k if n not in common}))


def kept_terms(kept: tuple[Item, ...]) -> tuple[Term, ...]:
    """What a layer keeps beyond its input: each kept item's output."""
    return tuple(Term(f"ops.{i.name}", i.size_bytes) for i in kept)


def rerun_flops_per_token(items: tuple[Item, ...], kept: tuple[Item, ...]) -> float:
    """Forward FLOPs of one token that the backward's rerun spends on this rank: every item
    not kept (a dense MLP's down projection never reruns, early stop, but where a post norm
    or dropout reads its output: the item ``mlp.down``)."""
    names = {i.name for i in kept}
    return sum(i.flops_per_token for i in items if i.name not in names)


def forward_peak(moment_blocks: list[tuple[str, int]], items: tuple[Item, ...],
                 kept: tuple[Item, ...], mlp_end: int = 0, parallel: bool = False,
                 returned: tuple[str, int] = ("", 0), out_mask: int = 0) -> int:
    """The largest of a checkpointed layer's forward moments (``(block name, alive +
    transient bytes)``, ``memplan.model.layer.forward_moments`` under full recompute) with the
    kept outputs made by then: those of the blocks before its block, and its own block's
    ``own_extra`` ones. ``mlp_end``: what the layer holds at the MLP's down projection
    beyond the MLP's own tensors (its input, the residual, the checkpointed input), where
    every kept MLP output is alive with the down projection's input and output (traced:
    torchtitan's block with the MLP kept, one residual-sized tensor above its working set).
    A kept norm output is its reader's input, which that block's moments hold anyway
    (``input_held``; ``parallel``: a parallel layer, whose MLP reads the attention norm's
    output too). ``returned``: a kept attention item the blocks after the attention hold anyway,
    and how many of its bytes (an eager core's returned probabilities, which the decoder
    layer holds to its end: ``memplan.model.attention.eager_held_item``). ``out_mask``: the
    bool mask of dropout on the MLP's output, which ``mlp_end`` counts beside the dropout's
    and the projection's outputs; a kept projection output stays past it, to the residual
    add's output (GPT2Block.forward: ``residual + feed_forward_hidden_states``)."""
    # (plain loops: a plan asks this of every frontier set of every layout it upgrades)
    order: dict[str, int] = {}
    for i in items:
        if i.block not in order:
            order[i.block] = len(order)
    made = [0] * (len(order) + 1)  # kept bytes made in each block, in block order
    own = [0] * (len(order) + 1)  # of them, those adding to their own block's working set
    for i in kept:
        made[order[i.block]] += i.size_bytes
        if i.own_extra:
            own[order[i.block]] += i.size_bytes
    before = [0] * (len(order) + 1)  # kept bytes made in the blocks before each
    for k in range(len(order)):
        before[k + 1] = before[k] + made[k]
    best = 0
    if mlp_end:
        down_in = held = 0
        for i in items:  # the down projection's input: the MLP's last item before it
            if i.block == "mlp" and i.name != "mlp.down":
                down_in = 0 if i in kept else i.size_bytes
            if i.name == TO_MLP_END and i not in kept:
                held = i.size_bytes
        down_in += held
        # the kept outputs made by then: the blocks' up to the MLP's (a post norm's after
        # it not yet; a kept down projection's output is the one ``mlp_end`` counts)
        at = order.get("mlp", len(order) - 1) + 1
        late = sum(i.size_bytes for i in kept if i.name == "mlp.down")
        best = mlp_end + before[at] - late + down_in - input_held(kept, "mlp", parallel)
        if out_mask and late:
            best += late - out_mask
    after = order.get("attn", len(order))  # the blocks after it hold ``returned``
    dup = min(next((i.size_bytes for i in kept if i.name == returned[0]), 0), returned[1])
    if mlp_end and "mlp" in order and order["mlp"] > after:
        best -= dup
    for block, value in moment_blocks:
        at = order.get(block, len(order))
        best = max(best, value + before[at] + own[at] - input_held(kept, block, parallel)
                   - (dup if at > after else 0))
    return best


# the block that reads each norm's output as its input
READER = {"attn_norm": "attn", "mlp_norm": "mlp"}
# the post norm that reads each mixer's last output as its input (``NormPlacement``)
POST_READER = {"attn.o_proj": "attn_post_norm", "mlp.down": "mlp_post_norm"}


def input_held(kept: tuple[Item, ...], block: str, parallel: bool = False) -> int:
    """Bytes of ``kept`` that ``block``'s forward moments hold anyway: the output of the norm
    before it, its input (``memplan.model.layer.forward_moments``: a checkpointed mixer's
    moments hold its input, the decoder layer's ``hidden_states`` while the mixer runs;
    traced: Llama and Qwen3 keeping ``mlp_norm.output``, no more than keeping nothing). In a
    parallel layer (``parallel``: Cohere2DecoderLayer.forward) the MLP's moments hold the
    attention norm's output, its input too, and the attention's output, a local until the
    layer's sum (``memplan.model.layer._beside_second``): kept, ``attn.o_proj`` adds nothing
    there."""
    held = 0
    for i in kept:
        # (Falcon-H1's mixer, block "mamba", reads the norm's output first: sac_falcon)
        if (READER.get(i.block) == block or parallel and block == "mlp"
                and i.block == "attn_norm" or block == "mamba" and i.block == "attn_norm"
                ) and i.name == f"{i.block}.output":
            held += i.size_bytes
        elif parallel and block == "mlp" and i.name == "attn.o_proj":
            held += i.size_bytes
        elif POST_READER.get(i.name) == block:
            # a post norm's input, the mixer's output its working set holds
            # (``memplan.model.norm.Norm.working_set``)
            held += i.size_bytes
    return held


def assumption(spec: ModelSpec, wl: Workload, kinds: dict[str, tuple[Item, ...]],
               pp: int = 1) -> str:
    """The assumptions' line for ``Recompute.OPS``: what each layer keeps and what its rerun
    costs (per stage where the list differs by stage; per layer kind, ``kinds``' items each,
    where dense and MoE layers differ)."""
    def keeps(save: tuple[str, ...]) -> str:
        out = []
        groups = {_split(n)[1] for n in save} & set(GROUPS)
        for kind, items in kinds.items():
            kept = resolve(items, save, spec, kind)
            every = sum(i.flops_per_token for i in items)
            rerun = rerun_flops_per_token(items, kept)
            names = ", ".join(i.name for i in kept) or "nothing"
            # a group's norm tensors no policy names: recomputed (``resolve``)
            left = [i.name for i in items if i.op == NORM and any(
                i.block in GROUPS[g] for g in groups)]
            out.append((f"{kind} layers: " if len(kinds) > 1 else "")
                       + f"{names}; its backward reruns the rest, {rerun / every:.0%} of the "
                       "keepable ops' FLOPs" + (f" (of the groups named, {', '.join(left)}: "
                                                "no op a policy names makes them)"
                                                if left else ""))
        return "; ".join(out)

    stages = per_stage(wl.recompute_save, pp)
    if stages is None:
        what = "each layer keeps its input and " + keeps(wl.recompute_save)
    else:
        what = "each layer keeps its input and, " + "; ".join(
            f"on stage {n}, {keeps(save)}" for n, save in stages.items())
    # (a hybrid model's kinds, "mamba" and "attn", are MoE layers where their items are)
    names = {i.name.split(".")[0] for items in kinds.values() for i in items}
    stop = ("the experts' down projection reruns: the routing weights' product saves its "
            "output" if "moe" in names else "")
    dense = ("" if "mlp" not in names
             else "a dense MLP's down projection reruns: its post norm saves its output"
             if spec.norm_placement.post_norm
             else "a dense MLP's down projection reruns: its dropout's mask is rebuilt"
             if spec.dropout > 0 else "a dense MLP's down projection never reruns: early stop")
    stop = "; ".join(s for s in (stop, dense) if s)
    return f"recompute ops (PyTorch selective activation checkpointing per layer): {what} ({stop})"


# an eager core's ops a policy names (``_eager_core_ops``): its two batched matmuls
# (``aten.bmm``) and the probabilities' dropout (``aten.native_dropout``, CUDA's fused kernel)
BMM, DROPOUT = "bmm", "dropout"


def _core_ops(spec: ModelSpec, wl: Workload, dm: Dims, terms: dict[str, int]) -> list[Item]:
    """The attention core's items: SDPA's kernel (``attn.out``, its output and logsumexp), or
    an eager core's ops (``_eager_core_ops``)."""
    if wl.attention is Kernel.EAGER:
        return _eager_core_ops(spec, dm, terms)
    core = AttentionBlock().core_flops_per_token(spec, dm.s_kv) / dm.tp
    return [Item("attn.out", ("attn.out", "attn.lse"), terms["attn.out"] + terms["attn.lse"],
                 core, ATTENTION_KERNEL, spec.q_size // dm.tp, 0, "attn", False)]


def eager_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    """Why an eager core's ops are not modelled one by one, or None: modelled as transformers'
    ``eager_attention_forward`` runs them (models/llama/modeling_llama.py; GPT-2's in
    models/gpt2/modeling_gpt2.py; Gemma 2's soft-capping in models/gemma2/modeling_gemma2.py)
    in a dense layer, without sinks; a sliding window is only its additive mask (the same
    size as the causal one: ``attention.eager_mask_bytes``), no tensor of the core changes.
    fp16 is bf16's (the same sizes) but for transformers' fp32 softmax of 16-bit weights
    (``softmax(dtype=torch.float32)`` on the fp16 scores, no autocast), which on CUDA
    upcasts without copying its input; under autocast the scores it reads are fp32 (the
    fp32 mask added) in either dtype.
    An upcast-fp32 RMSNorm in a 16-bit dtype casts its input, weight and output (Gemma2RMSNorm.
    forward: ``x.float()``, ``self.weight.float()``, ``type_as(x)``; OLMo 2's two), ops no
    policy names (``_norms_nameable``): at s_kv = h they share the core's casts' width."""
    p = wl.precision.policy
    norm_casts = (wl.norm_impl is NormImpl.UPCAST_FP32 and p.autocast is None
                  and p.compute.itemsize < FP32_BYTES)
    checks = (
        (wl.attention is not Kernel.EAGER, f"attention {wl.attention.value}"),
        (spec.moe is not None and not spec.attn_sinks,
         "eager attention in MoE layers (modelled for GPT-OSS's, with its sinks)"),
        (spec.mla is not None, "eager attention in MLA layers"),
        (spec.attn_sinks and (wl.softmax_fp32 or p.autocast is not None or spec.dropout > 0
                              or spec.attn_logit_softcap is not None),
         ("eager attention with sinks and an fp32 softmax, autocast, dropout or "
          "soft-capping (modelled as GPT-OSS's eager_attention_forward runs: the softmax in "
          "the scores' dtype, no dropout)")),
        (norm_casts and wl.seq_len == spec.hidden_size,
         ("eager attention at a sequence as long as the hidden size with upcast-fp32 norms "
          "in a 16-bit dtype (the softmax's casts share the width of the norms' casts, which "
          "no policy counts)")),
        (p.compute is DType.FP16 and p.autocast is None and wl.softmax_fp32,
         ("eager attention in fp16 with an fp32 softmax (CUDA's softmax(dtype=float32) "
          "upcasts fp16 without the copy other dtypes make)")),
    )
    return next((why for cond, why in checks if cond), None)


def _eager_core_ops(spec: ModelSpec, dm: Dims, terms: dict[str, int]) -> list[Item]:
    """An eager core's ops in execution order (transformers' ``eager_attention_forward``:
    ``torch.matmul(query, key.transpose)`` then the scaling and the additive mask, ``softmax``
    (in fp32 with ``dtype=torch.float32``, a 16-bit input copied to fp32 first, then
    ``.to(query.dtype)``), ``dropout``, ``torch.matmul(attn_weights, value)``): the items
    ``attn.scores`` (the first bmm's output, saved by no one), ``attn.softmax`` (its output,
    saved by its backward), ``attn.softmax_cast`` (the cast back, saved by the value matmul;
    16-bit weights only: under autocast the value matmul's own cast of its input, not named),
    ``attn.dropout`` (``native_dropout``'s output and bool mask) and ``attn.context`` (the
    value bmm's output, whose transposed copy the output projection saves). The scaling
    (``* scaling``, a number's product: ``scale``) is counted, no item. With sinks (models/
    gpt_oss/modeling_gpt_oss.py ``eager_attention_forward``: ``torch.cat([attn_weights,
    sinks], dim=-1)`` after the mask, an op no item keeps; the row max, ``max`` and ``sub``,
    no ops a policy counts; the softmax in the scores' dtype over s_kv + 1 columns, its
    output ``attn.softmax`` with the sink column; ``probs[..., :-1]`` a view the value
    matmul reads without a copy; dropout at p = 0 and ``.to`` of the same dtype no ops). What each kept
    adds to the checkpointed core's moments is ``core_peak``'s (``memplan.model.eager.
    checkpointed_moments``). FLOPs: 2 s_kv q / t a token per bmm (the
    whole square: an eager core masks, it does not skip), one an element of the rest."""
    heads, s_kv, e = spec.num_attention_heads // dm.tp, dm.s_kv, dm.e
    scores = dm.b * heads * dm.s * s_kv
    bmm, per_element = 2.0 * s_kv * spec.q_size / dm.tp, float(heads * s_kv)

    def item(name: str, covers: tuple[str, ...], size: int, flops: float, op: str,
             width: int) -> Item:
        return Item(name, tuple(c for c in covers if c in terms), size, flops, op, width, 0,
                    "attn", False)

    out = [item("attn.scores", (), scores * e, bmm, BMM, s_kv),
           *(_softcap_ops(spec, terms, scores * e, per_element, s_kv)
             or [_unkept(SCALE, s_kv, "attn")])]
    # softmax in fp32 on 16-bit weights: a copy to fp32 before it, a cast back after it
    cast = terms["attn.softmax"] > scores * e and not dm.autocast
    if cast:  # softmax(dtype=float32) copies its 16-bit input to fp32 first
        out.append(_unkept(COPY, s_kv, "attn"))
    # GPT-OSS's sinks: torch.cat([attn_weights, sinks], dim=-1), the softmax s_kv + 1 wide
    sink = int(spec.attn_sinks)
    if sink:
        out.append(_unkept(CAT, s_kv + 1, "attn"))
    out.append(item("attn.softmax", ("attn.softmax",),
                    terms["attn.softmax"] + sink * scores // s_kv * e, per_element,
                    SOFTMAX, s_kv + sink))
    if cast:
        out.append(item("attn.softmax_cast", ("attn.softmax_cast",), scores * e,
                        per_element, COPY, s_kv))
    if spec.dropout > 0:
        out.append(item("attn.dropout", ("attn.softmax_dropout_mask",
                                         "attn.softmax_dropout_out"),
                        terms["attn.softmax_dropout_mask"] + scores * e, per_element,
                        DROPOUT, s_kv))
    out.append(item("attn.context", (), dm.tokens * spec.q_size // dm.tp * e, bmm, BMM,
                    spec.head_dim))
    return out


def _softcap_ops(spec: ModelSpec, terms: dict[str, int], size: int, per_element: float,
                 s_kv: int) -> list[Item]:
    """Logit soft-capping between the scores and the mask (models/gemma2/modeling_gemma2.py
    ``eager_attention_forward``: ``torch.matmul(query, key_states.transpose(2, 3)) *
    scaling``, then ``attn_weights / softcap``, ``torch.tanh``, ``* softcap``): the scaling
    (a ``mul`` by a number, the policy's ``scale``, kept by none), ``attn.softcap_tanh``
    (``aten.tanh``, whose backward saves its output: the ``attn.softcap_tanh`` term) and
    ``attn.softcap`` (the product by the cap, a ``scale``; saved by no one), each a
    score-sized tensor in the compute dtype (tanh runs in it under autocast too). The
    division (``aten.div`` by a number) is no op a policy counts. What each kept adds to the
    checkpointed core's moments is ``memplan.model.eager._softcap_moments``' and
    ``_after_mask``'s. FLOPs: one an element each (the division's and the scaling's rerun
    whatever is kept, as the mask's add, and are no item's). Nothing without soft-capping."""
    if spec.attn_logit_softcap is None:
        return []
    return [_unkept(SCALE, s_kv, "attn"),
            Item("attn.softcap_tanh", tuple(c for c in ("attn.softcap_tanh",) if c in terms),
                 size, per_element, TANH, s_kv, 0, "attn", False),
            Item("attn.softcap", (), size, per_element, SCALE, s_kv, 0, "attn", False)]


def core_peak(core: tuple[tuple[int, tuple[tuple[str, int], ...]], ...],
              items: tuple[Item, ...], kept: tuple[Item, ...], parallel: bool = False) -> int:
    """The largest of a checkpointed eager core's moments (``(bytes, what each kept core
    item adds there)``, ``memplan.model.layer._ops_forward``: the attention's moment with
    each of the core's, ``memplan.model.eager.checkpointed_moments``) with the kept outputs
    made by then: those of the blocks before the attention, the attention's own extra ones
    (q and k before RoPE) and each kept core output's addition there."""
    blocks: list[str] = []
    for i in items:
        if i.block == "attn":
            break
        if i.block not in blocks:
            blocks.append(i.block)
    before = sum(i.size_bytes for i in kept if i.block in blocks or i.block == "attn"
                 and i.own_extra) - input_held(kept, "attn", parallel)
    best = 0
    for value, adds in core:
        extra = dict(adds)
        best = max(best, value + before + sum(extra.get(i.name, 0) for i in kept))
    return best


def _gelu_new_ops(terms: dict[str, int], mlp: list[Item], f: int, dm: Dims) -> list[Item]:
    """An ungated MLP with transformers' gelu_new (activations.py NewGELUActivation.forward:
    ``0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 *
    torch.pow(input, 3.0))))``, Python evaluating ``0.5 * input`` first), in execution order:
    the first projection (``mlp.fc1``), ``0.5 * input`` (``mlp.gelu_half_x``, the first
    number-scaled tensor f wide), the two other scalings (kept by none), ``tanh``
    (``mlp.gelu_tanh``), ``1.0 + tanh`` (``mlp.gelu_one_plus_tanh``) and their product
    (``mlp.act``). Sizes as ``memplan.model.mlp.gelu_new_saved``: under autocast ``pow``
    runs on an fp32 cast of the input (the ``mlp.fc1`` term, which no item names: the
    projection's output is saved by no one), tanh and the sum are fp32 and so is the product,
    which the down projection casts back (the ``mlp.act`` term, no item either). One FLOP an
    element each."""
    elements = dm.tokens * f
    wide = FP32_BYTES if dm.autocast else dm.e

    def item(name: str, op: str, e: int, covered: bool = True) -> Item:
        # kept, tanh's output outlives its step (the chain's peak: ``memplan.model.mlp.
        # _gelu_new_working_bytes``), where the others are alive anyway
        covers = (name,) if covered and name in terms else ()
        return Item(name, covers, elements * e, float(f), op, f, 0, "mlp", op == TANH)

    fc1 = mlp[0]._replace(terms=() if dm.autocast else mlp[0].terms)
    return [fc1, item("mlp.gelu_half_x", SCALE, dm.e), _unkept(SCALE, f, "mlp"),
            _unkept(SCALE, f, "mlp"), item("mlp.gelu_tanh", TANH, wide),
            item("mlp.gelu_one_plus_tanh", SHIFT, wide),
            item("mlp.act", PRODUCT, wide, covered=not dm.autocast)]
