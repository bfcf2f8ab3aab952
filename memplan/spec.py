"""Model specifications and exact parameter counts.

A ``ModelSpec`` describes a decoder-only transformer by the numbers that decide its memory:
layer count, widths, heads, vocabulary, norm and MLP kinds, biases, tied embeddings, positions,
dropout and mixture-of-experts. It loads from the TOML catalog (``model_specs/models``), from any
TOML file with the same fields, or from a Hugging Face style ``config.json`` (read as data only;
no network, no code execution).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from memplan.choices import Field, Record, model_validator
from memplan.choices import PlainEnum
from memplan.arguments import file_fields
from memplan.catalog import data_dir, suggest
from memplan.errors import MemplanError, ValidationError, validation_message
from memplan.inputs import MODEL_FILE_BYTES, read_json, read_toml, regular_file
from memplan.hf.param_table import ParamTable


class NormKind(PlainEnum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class MlpKind(PlainEnum):
    """Gated kinds (swiglu, geglu) have three matrices; the others two."""

    GELU = "gelu"
    RELU = "relu"
    SWIGLU = "swiglu"
    GEGLU = "geglu"

    @property
    def gated(self) -> bool:
        return self in (MlpKind.SWIGLU, MlpKind.GEGLU)


class ActivationImpl(PlainEnum):
    """How the MLP's activation runs.

    kernel    one aten op (F.gelu, exact or tanh-approximated; F.silu; F.relu), saving its
              input (ReLU its output)
    gelu_new  transformers' NewGELUActivation (activations.py: ACT2FN["gelu_new"], GPT-2's
              default), the Python formula 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))):
              autograd saves its tanh output, 0.5*x and 1+tanh beside the input
    xielu     transformers' XIELUActivation (activations.py ``_xielu_python``, Apertus's
              hidden_act; the fused CUDA kernel is a separate package): torch.where over two
              branches with two learned scalars (alpha_p, alpha_n), parameters of the MLP
              (``memplan.model.mlp.xielu_saved``)
    """

    KERNEL = "kernel"
    GELU_NEW = "gelu_new"
    XIELU = "xielu"


class PositionKind(PlainEnum):
    ROPE = "rope"
    LEARNED = "learned"
    NONE = "none"


class QkNorm(PlainEnum):
    """An RMSNorm on the query and key projections' outputs, before RoPE.

    head  one weight of head_dim each for q and k, shared by the heads (Qwen3's and Gemma 3's
          ``q_norm`` / ``k_norm``: models/qwen3/modeling_qwen3.py Qwen3Attention.__init__)
    full  over the whole projection: weights of heads*head_dim and kv_heads*head_dim
          (OLMo 2: models/olmo2/modeling_olmo2.py Olmo2Attention.__init__)
    l2    per head, without weights, after RoPE and on the layers with RoPE only (Llama 4:
          models/llama4/modeling_llama4.py Llama4TextL2Norm, x * rsqrt(mean(x^2) + eps) in
          fp32; Llama4TextAttention.__init__ builds it when use_qk_norm and use_rope): its
          terms are a per-head norm's without the weighted product; with NoPE layers
          (``nope_layer_interval``) the layers without RoPE have none
    """

    NONE = "none"
    HEAD = "head"
    FULL = "full"
    L2 = "l2"


class NormPlacement(PlainEnum):
    """Where a layer's norms sit around its two mixers (attention, feed-forward).

    pre       norm -> mixer -> residual add (Llama, GPT-2): two norms per layer
    sandwich  norm -> mixer -> norm -> residual add (Gemma 2 / 3: input_layernorm,
              post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm;
              models/gemma2/modeling_gemma2.py Gemma2DecoderLayer.forward): four norms
    post      mixer -> norm -> residual add, the mixers reading the residual stream itself
              (OLMo 2: models/olmo2/modeling_olmo2.py Olmo2DecoderLayer.forward): two norms
    """

    PRE = "pre"
    SANDWICH = "sandwich"
    POST = "post"

    @property
    def norms_per_layer(self) -> int:
        return 4 if self is NormPlacement.SANDWICH else 2

    @property
    def pre_norm(self) -> bool:
        return self is not NormPlacement.POST

    @property
    def post_norm(self) -> bool:
        return self is not NormPlacement.PRE


# Bounds that keep a mistyped spec from running for minutes or exhausting memory (the
# estimate's work grows with the layer count; the planner factors the expert count): far
# above the deepest published models (Llama 3.1 405B: 126 layers; Megatron-LM's 1T: 128)
# and the widest expert counts (DeepSeek-V3: 256 routed experts).
MAX_LAYERS = 10_000
MAX_EXPERTS = 1_000_000
# Widths, head counts and head dims: 2^24, a thousand times the widest published (Llama 3.1
# 405B: hidden 16,384, ffn 53,248; 128 heads), so products of widths stay far inside the
# planner's 64-bit integers and a float's range (a 400-digit width overflowed to a traceback).
MAX_WIDTH = 2**24
# Vocabulary rows and context lengths: 2^31, the int32 range of token ids and positions
# (the largest published vocabularies are ~256k, Gemma; contexts 1M-10M tokens).
MAX_ROWS = 2**31


class MoESpec(Record):
    """Mixture-of-experts feed-forward: routed experts, optional shared experts."""


    num_experts: int = Field(gt=0, le=MAX_EXPERTS)
    top_k: int = Field(gt=0, le=MAX_EXPERTS)
    expert_ffn_hidden_size: int = Field(gt=0, le=MAX_WIDTH)
    num_shared_experts: int = Field(default=0, ge=0, le=MAX_EXPERTS)
    shared_expert_ffn_hidden_size: int = Field(default=0, ge=0, le=MAX_WIDTH)
    layer_freq: int = Field(default=1, gt=0, le=MAX_LAYERS,
                            description="every layer_freq-th layer is MoE")
    first_dense_layers: int = Field(default=0, ge=0, le=MAX_LAYERS, description=(
        "the first k layers have a dense MLP of ffn_hidden_size (DeepSeek-V3's "
        "first_k_dense_replace)"))
    router_bias: bool = False
    router_fp32: bool = Field(default=False, description=(
        "the router's linear runs on fp32 copies of its input and weight (DeepSeek-V3's "
        "DeepseekV3TopkRouter.forward), which it saves"))
    shared_expert_gate: bool = Field(default=False, description=(
        "a bias-free h -> 1 linear whose sigmoid scales the shared experts' output (Qwen2-MoE's "
        "shared_expert_gate: models/qwen2_moe/modeling_qwen2_moe.py "
        "Qwen2MoeSparseMoeBlock.forward)"))
    shared_experts_last: bool = Field(default=False, description=(
        "the shared experts run after the routed experts, on the block's input kept aside "
        "(DeepSeek-V3: models/deepseek_v3/modeling_deepseek_v3.py DeepseekV3MoE.forward, "
        "hidden_states + self.shared_experts(residuals); Glm4MoeMoE, Dots1MoE), where "
        "Qwen2-MoE, Hunyuan and ERNIE 4.5 run them first; under recompute the shared output "
        "is then not yet alive while the routed experts run"))
    stacked_experts: bool = Field(default=False, description=(
        "the routed experts' weights as two 3-D tensors per layer, gate_up_proj (E, 2f, h) and "
        "down_proj (E, h, f) (transformers 5: MixtralExperts, Qwen2MoeExperts, "
        "DeepseekV3NaiveMoe), where separate expert MLPs have 2 or 3 tensors each"))
    split_gate_up: bool = Field(default=False, description=(
        "stacked experts with gate and up as two 3-D tensors, three per layer: torchtitan "
        "0.3.0's GroupedExperts (models/common/moe.py: w1_EFD, w2_EDF, w3_EFD); the same "
        "bytes, one more tensor (a fused AdamW step each)"))

    clamped_swiglu: bool = Field(default=False, description=(
        "the routed experts' SwiGLU clamped, (clamp(up) + 1) * g * sigmoid(1.702 g) with g = "
        "clamp(gate) (GPT-OSS: models/gpt_oss/modeling_gpt_oss.py GptOssExperts._apply_gate), "
        "which saves the gate/up output, the clamped gate, the sigmoid, up + 1 and their "
        "product"))
    router_topk_softmax: bool = Field(default=False, description=(
        "the router takes the top-k logits and softmaxes only them, in its own dtype (GPT-OSS: "
        "GptOssTopKRouter.forward), saving the k weights, not every expert's probability"))
    parallel_experts: bool = Field(default=False, description=(
        "the model's own experts can run as one F.linear per expert over its split of the "
        "rows sorted by expert, concatenated (IBM Granite's MoE: models/granitemoe/"
        "modeling_granitemoe.py GraniteMoeParallelExperts.forward, weights (E, 2f, h) and "
        "(E, h, f)), routed by the softmax of the top-k fp32 logits (GraniteMoeTopKGating."
        "forward) and combined by index_add into zeros (GraniteMoeMoE.forward), as "
        "transformers 5.3 writes it. Read where a workload asks for that code (moe_impl "
        "parallel); transformers 5.23 runs the same weights as GraniteMoeExperts through "
        "its experts interface (moe_impl grouped, the hf preset's default)"))
    router_logits_fp32: bool = Field(default=False, description=(
        "the router casts its logits to fp32 after its linear in the compute dtype (IBM "
        "Granite's MoE, transformers 5.23: models/granitemoe/modeling_granitemoe.py "
        "GraniteMoeTopKRouter.forward, F.linear(x, w).float()), so the softmax of its top-k "
        "(router_topk_softmax) runs, and saves its output, in fp32; the fp32 logits are "
        "returned and stay bound to the block's end (GraniteMoeMoE.forward's ``_``), saved by "
        "nothing (topk's backward keeps its indices only)"))
    router_weights_cast: bool = Field(default=False, description=(
        "the router casts its renormalised fp32 top-k weights to the block input's dtype "
        "(ERNIE 4.5: models/ernie4_5_moe/modeling_ernie4_5_moe.py Ernie4_5_MoeTopKRouter."
        "forward, routing_weights.to(hidden_states.dtype); Granite's GraniteMoeTopKRouter."
        "forward, .type_as(hidden_states) of its fp32 top-k softmax), so the experts' "
        "weighted rows stay in the compute dtype"))
    router_weight_fp32: bool = Field(default=False, description=(
        "the router's weight is built in fp32 whatever the model's dtype (ERNIE 4.5: "
        "Ernie4_5_MoeTopKRouter.__init__, torch.zeros(..., dtype=torch.float32)), so an fp32 "
        "router's ``self.weight.float()`` is the weight itself: router_fp32 saves the input's "
        "fp32 copy only"))
    router_logits_held: bool = Field(default=False, description=(
        "the router returns its linear's fp32 logits beside the probabilities its softmax "
        "made (a new tensor, which the softmax saves) and the block binds them to its end "
        "(ERNIE 4.5: Ernie4_5_MoeSparseMoeBlock.forward, ``_, top_k_index, top_k_weights = "
        "self.gate(hidden_states)``): T E fp32 values no backward saves, alive while the "
        "experts run"))
    router_norm_clamped: bool = Field(default=False, description=(
        "the router renormalises its top-k weights by their sum clamped from below (ERNIE "
        "4.5: Ernie4_5_MoeTopKRouter.forward, routing_weights / torch.clamp(routing_weights."
        "sum(dim=-1, keepdim=True), min=self.norm_min)): clamp's backward saves its input, "
        "the sum, and the division the clamped sum, T fp32 values each"))
    every_expert: bool = Field(default=False, description=(
        "the model's own code runs every token through every expert, its input scaled by the "
        "router's sigmoid of the top-k logits (zero for the others), the outputs summed "
        "(Llama 4: models/llama4/modeling_llama4.py Llama4Router.forward, Llama4TextMoe."
        "forward: hidden_states.repeat(num_experts, 1) * scores; Llama4TextExperts.forward: "
        "torch.bmm over gate_up_proj (E, h, 2f) and down_proj (E, f, h)). Read where the "
        "framework runs the model's own code (transformers: the hf preset's moe_impl "
        "every); the step's hardware FLOPs then count every expert, its model FLOPs the "
        "routed top-k's (memplan.planning.timing.runs_every_expert)"))

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be at most num_experts ({self.num_experts})")
        if self.num_shared_experts and not self.shared_expert_ffn_hidden_size:
            raise ValueError("shared_expert_ffn_hidden_size is required when num_shared_experts > 0")
        return self


class MlaSpec(Record):
    """Multi-head latent attention (DeepSeek-V2/V3; models/deepseek_v3/modeling_deepseek_v3.py
    DeepseekV3Attention): queries through a low-rank projection (h -> q_lora_rank, an RMSNorm,
    -> heads * (nope + rope)), keys and values from one compressed projection h -> kv_lora_rank
    + rope (an RMSNorm on the kv_lora_rank part, then -> heads * (nope + v)), the decoupled
    RoPE key (qk_rope_head_dim) shared by the heads. The spec's head_dim is the query/key head
    (nope + rope) and its num_kv_heads the query heads."""


    q_lora_rank: int = Field(ge=0, le=MAX_WIDTH, description=(
        "0: one h -> heads * (nope + rope) projection"))
    kv_lora_rank: int = Field(gt=0, le=MAX_WIDTH)
    qk_nope_head_dim: int = Field(gt=0, le=MAX_WIDTH)
    qk_rope_head_dim: int = Field(gt=0, le=MAX_WIDTH)
    v_head_dim: int = Field(gt=0, le=MAX_WIDTH)


class LinearAttentionSpec(Record):
    """Gated DeltaNet linear attention in place of attention on most layers (Qwen3-Next:
    models/qwen3_next/modeling_qwen3_next.py Qwen3NextGatedDeltaNet): in_proj_qkvz (h -> 2 *
    key_dim + 2 * value_dim), in_proj_ba (h -> 2 * value heads), a depthwise causal conv1d of
    conv_kernel taps over q, k and v, A_log and dt_bias per value head, a gated RMSNorm of
    value_head_dim (Qwen3NextRMSNormGated), out_proj (value_dim -> h); the chunked gated delta
    rule in chunks of chunk_size tokens (torch_chunk_gated_delta_rule's default 64).
    key_dim = num_key_heads * key_head_dim, value_dim = num_value_heads * value_head_dim."""


    num_key_heads: int = Field(gt=0, le=MAX_WIDTH)
    num_value_heads: int = Field(gt=0, le=MAX_WIDTH)
    key_head_dim: int = Field(gt=0, le=MAX_WIDTH)
    value_head_dim: int = Field(gt=0, le=MAX_WIDTH)
    conv_kernel: int = Field(gt=0, le=MAX_WIDTH)
    full_attention_interval: int = Field(gt=0, le=MAX_LAYERS, description=(
        "every n-th layer (index % n == n - 1) is a full-attention layer, the others linear "
        "(Qwen3NextConfig.__init__: full_attention_interval, default 4)"))
    chunk_size: int = Field(default=64, gt=0, le=MAX_WIDTH)

    @model_validator(mode="after")
    def _check(self) -> LinearAttentionSpec:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"num_key_heads ({self.num_key_heads}) must divide "
                             f"num_value_heads ({self.num_value_heads})")
        return self

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv1d: q, k and v (Qwen3NextGatedDeltaNet.conv_dim)."""
        return 2 * self.key_dim + self.value_dim


class ShortConvSpec(Record):
    """LFM2's gated short convolution in place of attention on every layer but
    ``attention_layers`` (models/lfm2/modeling_lfm2.py Lfm2ShortConv, transformers 5.3):
    in_proj (h -> 3 h, chunked into the gates B and C and the input x), a depthwise conv1d of
    conv_kernel taps (conv_L_cache) over B * x, C * conv, out_proj (h -> h); conv_bias on the
    three."""


    conv_kernel: int = Field(gt=0, le=MAX_WIDTH)
    conv_bias: bool = False
    attention_layers: tuple[int, ...] = Field(description=(
        "the 0-based indices of the full-attention layers (Lfm2Config.layer_types: "
        "full_attention; the others conv)"))


class MambaSpec(Record):
    """A Mamba2 mixer in place of attention on every layer but ``attention_layers``
    (Granite 4.0-H: models/granitemoehybrid/modeling_granitemoehybrid.py
    GraniteMoeHybridMambaLayer, transformers 5.3): in_proj (h -> 2 d + 2 G n + H, d = H P the
    inner width), a depthwise conv1d of conv_kernel taps over x, B and C (d + 2 G n
    channels), dt_bias, A_log and D per head, a gated RMSNorm of d, out_proj (d -> h); the
    chunked SSD scan in chunks of chunk_size tokens."""


    num_heads: int = Field(gt=0, le=MAX_WIDTH)
    head_dim: int = Field(gt=0, le=MAX_WIDTH)
    state_size: int = Field(gt=0, le=MAX_WIDTH)
    num_groups: int = Field(gt=0, le=MAX_WIDTH)
    conv_kernel: int = Field(gt=0, le=MAX_WIDTH)
    chunk_size: int = Field(gt=0, le=MAX_WIDTH)
    conv_bias: bool = True
    proj_bias: bool = False
    out_proj_bias: bool | None = Field(default=None, description=(
        "out_proj's bias where it is not proj_bias's (Falcon-H1's projectors_bias: "
        "FalconH1Mixer.out_proj; in_proj's is mamba_proj_bias); None: as proj_bias"))
    gated_norm: bool = Field(default=True, description=(
        "the scan's output through a gated RMSNorm of d (GraniteMoeHybridRMSNormGated); "
        "false: gated by silu(gate) alone, no norm, no weight (Falcon-H1 with mamba_rms_norm "
        "false: FalconH1Mixer.torch_forward, y * silu(gate))"))
    norm_before_gate: bool = Field(default=False, description=(
        "the gated norm normalises the scan's output before gating it, norm(y) * "
        "silu(gate) (Falcon-H1's mamba_norm_before_gate: FalconH1RMSNormGated.forward, "
        "transformers 5.3, whose FalconH1Config defaults it true; every published Falcon-H1 "
        "config false); false: norm(y * silu(gate)), as GraniteMoeHybridRMSNormGated always "
        "runs it; the same saved sizes either way (memplan.model.mamba), the op order of "
        "memplan.model.sac_falcon; meaningless without gated_norm"))
    parallel_attention: bool = Field(default=False, description=(
        "every layer runs the mixer and an attention side by side on its input norm's "
        "output and adds their outputs (Falcon-H1: models/falcon_h1/modeling_falcon_h1.py "
        "FalconH1DecoderLayer.forward, memplan.model.falcon_h1), each mixer reading its own "
        "scalar copy of the norm's output, in_proj's output times a per-channel muP vector "
        "(FalconH1Mixer.mup_vector, a buffer), both outputs scaled; attention_layers then "
        "lists every layer"))
    attention_layers: tuple[int, ...] = Field(description=(
        "the 0-based indices of the attention layers (layer_types: attention; the others "
        "mamba)"))

    @model_validator(mode="after")
    def _check(self) -> MambaSpec:
        if self.num_heads % self.num_groups:
            raise ValueError(f"num_groups ({self.num_groups}) must divide num_heads "
                             f"({self.num_heads})")
        return self

    @property
    def inner(self) -> int:
        """d = H P, the scan's width (GraniteMoeHybridMambaLayer.intermediate_size)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv1d: x, B and C (d + 2 G n)."""
        return self.inner + 2 * self.num_groups * self.state_size

    @property
    def out_bias(self) -> bool:
        """Whether out_proj has a bias (``out_proj_bias``, else ``proj_bias``)."""
        return self.proj_bias if self.out_proj_bias is None else self.out_proj_bias

    @property
    def width(self) -> int:
        """in_proj's output per token: the gate, the conv's channels, dt (2 d + 2 G n + H)."""
        return self.inner + self.conv_dim + self.num_heads


class ModelSpec(Record):
    """A decoder-only transformer. Widths are element counts, not bytes."""

    name: str
    source: str = Field(description="where the numbers come from")
    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    hidden_size: int = Field(gt=0, le=MAX_WIDTH)
    ffn_hidden_size: int = Field(gt=0, le=MAX_WIDTH)
    num_attention_heads: int = Field(gt=0, le=MAX_WIDTH)
    num_kv_heads: int = Field(gt=0, le=MAX_WIDTH)
    head_dim: int = Field(gt=0, le=MAX_WIDTH)
    vocab_size: int = Field(gt=0, le=MAX_ROWS)
    max_seq_len: int = Field(gt=0, le=MAX_ROWS)
    norm: NormKind
    mlp: MlpKind
    activation_impl: ActivationImpl = ActivationImpl.KERNEL
    position: PositionKind
    tied_embeddings: bool
    qkv_bias: bool = False
    fused_qkv: bool = Field(default=False, description=(
        "one q/k/v projection parameter (GPT-2's c_attn, litgpt's qkv, torchtitan's wqkv, "
        "Phi-3's qkv_proj) where separate q, k and v projections have three"))
    fused_gate_up: bool = Field(default=False, description=(
        "a gated MLP's gate and up projections as one parameter (Phi-3's gate_up_proj: "
        "models/phi3/modeling_phi3.py Phi3MLP)"))
    qk_norm: QkNorm = QkNorm.NONE
    qk_norm_token_major: bool = Field(default=False, description=(
        "per-head q/k norms run on the projections' token-major view, before the transpose to "
        "heads (Qwen3: models/qwen3/modeling_qwen3.py Qwen3Attention.forward, "
        "self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2); "
        "Glm4MoeAttention likewise), where Gemma 3 and EXAONE 4 normalise the transposed, "
        "head-major q and k: compiled, the norm's kernel then writes RoPE's output "
        "token-major (memplan.model.compiled.rerun_output_copy_bytes)"))
    norm_placement: NormPlacement = NormPlacement.PRE
    rope_keeps_dtype: bool = Field(default=False, description=(
        "RoPE casts the rotated q and k back to their own dtype (OLMo 2's apply_rotary_pos_emb: "
        "q_embed.to(q.dtype)), so under autocast they stay in the low dtype where other "
        "models' come out fp32 from the fp32 tables"))
    rope_per_layer_type: bool = Field(default=False, description=(
        "one pair of RoPE tables per layer type (sliding, full), each kept by that type's "
        "layers (Gemma 3: models/gemma3/modeling_gemma3.py Gemma3TextModel.forward fills "
        "position_embeddings[layer_type], the local layers' base frequency their own)"))
    embeds_scaled_copy: bool = Field(default=False, description=(
        "the model's forward scales the embedding's output into a new tensor and keeps the "
        "unscaled one in its local inputs_embeds until it returns (Gemma 2: models/gemma2/"
        "modeling_gemma2.py Gemma2Model.forward: hidden_states = inputs_embeds, then "
        "hidden_states * normalizer; Gemma: GemmaModel.forward), beside the first layer's "
        "input from the start; Gemma 3 scales inside its embedding module "
        "(Gemma3TextScaledWordEmbedding.forward), whose unscaled output is freed at once"))
    norm_scale_fp32: bool = Field(default=False, description=(
        "the model's RMSNorm multiplies its fp32 normalised tensor by the weight before the cast "
        "back (Gemma's x * (1 + w): Gemma2RMSNorm.forward; OLMo 2's w * x: Olmo2RMSNorm."
        "forward), as --norm upcast-fp32 does; where the framework runs the model's own norm "
        "(transformers) that is its norm implementation"))
    eager_softmax_fp32: bool = Field(default=True, description=(
        "the model's own eager attention runs its softmax in fp32 and casts the probabilities "
        "back for the value matmul (transformers' eager_attention_forward of Llama and the "
        "families built on it: softmax(..., dtype=torch.float32).to(query.dtype)); false: in "
        "the scores' dtype (models/gpt2/modeling_gpt2.py eager_attention_forward: "
        "softmax(attn_weights, dim=-1)). Read where the framework runs the model's own "
        "attention code (transformers: the hf preset's softmax_fp32)"))
    use_cache: bool = Field(default=True, description=(
        "the model's config asks its forward for a key/value cache (transformers' "
        "PretrainedConfig.use_cache, true in every configuration class memplan.hf reads): "
        "the hf preset's kv_cache, which LlamaModel.forward and the others build in training "
        "too"))
    final_logit_softcap: float | None = Field(default=None, gt=0, description=(
        "logits -> cap * tanh(logits / cap) before the loss (Gemma 2's "
        "final_logit_softcapping)"))
    attn_logit_softcap: float | None = Field(default=None, gt=0, description=(
        "attention scores -> cap * tanh(scores / cap) before the softmax (Gemma 2's "
        "attn_logit_softcapping; transformers applies it in eager attention only)"))
    sliding_window: int | None = Field(default=None, gt=0, le=MAX_ROWS, description=(
        "tokens a sliding-window layer attends to"))
    sliding_window_pattern: int = Field(default=0, ge=0, le=MAX_LAYERS, description=(
        "with a sliding window: 0, every layer slides; n, every n-th layer (index % n == n - "
        "1) attends to the full sequence and the others slide (Gemma 2: 2, Gemma 3: 6)"))
    mla: MlaSpec | None = None
    attn_out_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = Field(default=False, description="LayerNorm with a bias (beta)")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    moe: MoESpec | None = None
    nope_layer_interval: int = Field(default=0, ge=0, le=MAX_LAYERS, description=(
        "with RoPE: 0, every layer rotates q and k; n, every n-th layer (index % n == n - 1) "
        "attends without positions (SmolLM3's no_rope_layers: models/smollm3/"
        "modeling_smollm3.py SmolLM3Attention.use_rope); the RoPE tables are the model's, "
        "made once per forward"))
    rotary_dim: int | None = Field(default=None, gt=0, le=MAX_WIDTH, description=(
        "partial rotary embeddings: RoPE rotates the first rotary_dim of each head and passes "
        "the rest through (Phi-4-mini's partial_rotary_factor: models/phi3/modeling_phi3.py "
        "apply_rotary_pos_emb, Phi3RotaryEmbedding of int(head_dim * factor)); None: the "
        "whole head"))
    parallel_block: bool = Field(default=False, description=(
        "one norm per layer whose output both attention and the MLP read, their outputs "
        "added to the residual together (Cohere2DecoderLayer.forward: residual + attn(x) + "
        "mlp(x), x = input_layernorm(residual)); with norm_placement pre only"))
    norm_centres_twice: bool = Field(default=False, description=(
        "a Python LayerNorm that subtracts the mean twice, once for the variance and once for "
        "the normalisation, each fp32 difference saved (Cohere2LayerNorm.forward: "
        "(x - mean).pow(2).mean() and (x - mean) * rsqrt(var + eps)); with norm_scale_fp32 "
        "its weight multiplies the fp32 normalised tensor"))
    rope_complex: bool = Field(default=False, description=(
        "RoPE's table is one complex64 tensor made in fp32 whatever the dtype, the rotation a "
        "complex product that saves it (Llama 4: models/llama4/modeling_llama4.py "
        "Llama4TextRotaryEmbedding.forward: torch.polar; apply_rotary_emb: "
        "view_as_complex(xq.float()) * freqs_cis), where cos and sin tables are two real "
        "ones in the activations' dtype"))
    rope_tables_fp32: bool = Field(default=False, description=(
        "the rotary embedding returns its cos and sin tables in fp32 whatever the compute "
        "dtype (ERNIE 4.5: models/ernie4_5_moe/modeling_ernie4_5_moe.py Ernie4_5_Moe"
        "RotaryEmbedding.forward, \"keeping it in full precision\": no cast to x.dtype), "
        "where Llama's casts them to the hidden states' dtype"))
    rope_half_tables: bool = Field(default=False, description=(
        "the rotary embedding's cos and sin tables are rope_dim / 2 wide, one column per "
        "frequency, and the rotation multiplies each half of q and k by them (GPT-OSS: "
        "models/gpt_oss/modeling_gpt_oss.py GptOssRotaryEmbedding.forward: emb = freqs; "
        "_apply_rotary_emb: first_half * cos - second_half * sin), where Llama's repeat the "
        "frequencies to rope_dim (emb = torch.cat((freqs, freqs), dim=-1))"))
    rope_interleaved: bool = Field(default=False, description=(
        "RoPE rotates interleaved pairs: apply_rotary_pos_emb repeats the first half of each "
        "table pairwise (ERNIE 4.5's: cos[..., :d // 2].repeat_interleave(2, dim=-1)), a new "
        "(1, 1, s, rope_dim) copy of cos and of sin in every layer, which the rotation's "
        "products save (q.float() * cos, rotate_half(q).float() * sin), not the model's "
        "tables: those are the model's forward's locals, saved only as the inputs of "
        "checkpointed layers"))
    window_chunked: bool = Field(default=False, description=(
        "the sliding window is fixed chunks of sliding_window tokens: a query attends to the "
        "keys of its own chunk up to itself (Llama 4's attention_chunk_size: masking_utils.py "
        "chunked_overlay, create_chunked_causal_mask); its mask and kernels are a sliding "
        "window's, its FLOPs the chunk's"))
    window_mask_always: bool = Field(default=False, description=(
        "the model's forward builds the sliding-window mask on every call, whether or not a "
        "layer slides (transformers' Qwen2MoeModel.forward fills causal_mask_mapping with "
        "create_sliding_window_causal_mask; with use_sliding_window off its config's window "
        "is 0, so masking_utils.py _ignore_causal_mask_sdpa never skips it): a mask no layer "
        "reads, alive until the forward returns"))
    window_mask_alone: bool = Field(default=False, description=(
        "with a sliding window the model's forward builds the window's mask in place of the "
        "causal one, one mask for every layer (transformers' MistralModel.forward: "
        "mask_function = create_causal_mask if config.sliding_window is None else "
        "create_sliding_window_causal_mask; Mixtral's, Phi-3's and Ministral 3's alike), "
        "where others build both (Qwen2's, Ministral's and Gemma's causal_mask_mapping)"))
    scaled_residual: bool = Field(default=False, description=(
        "each sub-layer's output is scaled by a multiplier before the residual add "
        "(Granite's residual_multiplier: GraniteDecoderLayer.forward, residual + out * m): "
        "nothing saved, but in backward the multiplication makes a scaled copy of the "
        "residual stream's gradient for the sub-layer, beside the stream's own; a fully "
        "recomputed layer's rerun runs with both alive"))
    attn_sinks: bool = Field(default=False, description=(
        "a learned logit per query head that joins every row of the scores before the "
        "softmax and is dropped after it (GPT-OSS's sinks: models/gpt_oss/modeling_gpt_oss.py "
        "GptOssAttention.sinks, eager_attention_forward)"))
    linear_attention: LinearAttentionSpec | None = Field(default=None, description=(
        "gated DeltaNet layers in place of attention but on every full_attention_interval-th "
        "layer (Qwen3-Next)"))
    short_conv: ShortConvSpec | None = Field(default=None, description=(
        "LFM2's gated short-convolution layers in place of attention but on "
        "short_conv.attention_layers"))
    mamba: MambaSpec | None = Field(default=None, description=(
        "Mamba2 mixers in place of attention but on mamba.attention_layers (Granite 4.0-H)"))
    attn_output_gate: bool = Field(default=False, description=(
        "the attention's q projection is twice as wide, its second half per head a gate whose "
        "sigmoid scales the attention output before o_proj (Qwen3NextAttention.forward: "
        "torch.chunk(q_proj(x).view(..., head_dim * 2), 2), attn_output * sigmoid(gate))"))
    approximate: str | None = Field(default=None, description=(
        "why this spec's blocks only approximate the model (a model type memplan has no reader "
        "for, read as its nearest known block: memplan.hf.fallback); None: the spec is the "
        "model"))
    exact_num_params: int | None = Field(default=None, gt=0, description=(
        "the model's exact parameter count where the spec is approximate: transformers' own "
        "build of its config on the meta device (memplan.hf.fallback)"))
    param_table: ParamTable | None = Field(default=None, description=(
        "the model's parameter tensors as transformers builds them on the meta device, by "
        "layer (memplan.hf.param_table): where given, the weights, gradients and optimizer "
        "states follow them instead of the blocks' own tensors (memplan.hf.fallback)"))

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.param_table is not None and len(self.param_table.layer_rows) != self.num_layers:
            raise ValueError(f"param_table lists {len(self.param_table.layer_rows)} layers, "
                             f"num_layers is {self.num_layers}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.norm_bias and self.norm is NormKind.RMSNORM:
            raise ValueError("norm_bias is only meaningful for layernorm")
        if self.activation_impl is ActivationImpl.XIELU and (self.mlp is not MlpKind.GELU
                                                             or self.moe is not None):
            raise ValueError("activation_impl xielu is a plain dense MLP's (mlp gelu, no moe)")
        if self.fused_gate_up and not self.mlp.gated:
            raise ValueError(f"fused_gate_up needs a gated mlp (swiglu, geglu), got {self.mlp.value}")
        if self.norm_centres_twice and self.norm is not NormKind.LAYERNORM:
            raise ValueError("norm_centres_twice is a LayerNorm's")
        if self.parallel_block and self.norm_placement is not NormPlacement.PRE:
            raise ValueError(f"parallel_block needs norm_placement pre, got "
                             f"{self.norm_placement.value}")
        if self.rotary_dim is not None and (self.rotary_dim > self.head_dim
                                            or self.rotary_dim % 2 or self.mla is not None):
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must be even, at most head_dim "
                             f"({self.head_dim}), and without mla")
        if self.mla is not None:
            head = self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
            if self.head_dim != head or self.num_kv_heads != self.num_attention_heads:
                raise ValueError(
                    f"with mla, head_dim ({self.head_dim}) must be qk_nope_head_dim + "
                    f"qk_rope_head_dim ({head}) and num_kv_heads ({self.num_kv_heads}) "
                    f"num_attention_heads ({self.num_attention_heads})")
            if self.qk_norm is not QkNorm.NONE or self.fused_qkv:
                raise ValueError("mla has its own low-rank norms: qk_norm and fused_qkv do not apply")
        if (self.qk_norm is QkNorm.L2 and self.nope_layer_interval and self.sliding_window
                and self.sliding_window_pattern != self.nope_layer_interval):
            raise ValueError(f"an l2 qk_norm with NoPE layers and a window needs the windowed "
                             f"layers to be those with RoPE: sliding_window_pattern "
                             f"({self.sliding_window_pattern}) must be nope_layer_interval "
                             f"({self.nope_layer_interval})")
        if self.window_chunked and self.sliding_window is None:
            raise ValueError("window_chunked needs a sliding_window (the chunk)")
        mixers = [m for m in (self.short_conv, self.mamba) if m is not None]
        if mixers and (self.linear_attention is not None or len(mixers) > 1 or any(
                not 0 <= i < self.num_layers for i in mixers[0].attention_layers)):
            raise ValueError(f"short_conv or mamba attention_layers must be layer indices "
                             f"below num_layers ({self.num_layers}), with one such mixer and "
                             "without linear_attention")
        if (self.mamba is not None and self.mamba.parallel_attention
                and self.mamba.attention_layers != tuple(range(self.num_layers))):
            raise ValueError("mamba.parallel_attention runs attention beside the mixer on every "
                             f"layer: attention_layers must be 0 .. {self.num_layers - 1}")
        if self.moe is not None and self.moe.first_dense_layers >= self.num_layers:
            raise ValueError(f"moe.first_dense_layers ({self.moe.first_dense_layers}) must be "
                             f"below num_layers ({self.num_layers})")
        return self

    @property
    def q_size(self) -> int:
        """Width of the query projection output: heads * head_dim (not always hidden_size)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_kv_heads * self.head_dim

    @property
    def attn_out_size(self) -> int:
        """Width of the attention output the output projection reads: heads * v_head_dim with
        MLA, else heads * head_dim."""
        return self.num_attention_heads * (self.mla.v_head_dim if self.mla else self.head_dim)

    @property
    def rope_fp32_under_autocast(self) -> bool:
        """Whether RoPE's q and k come out fp32 under autocast (the fp32 cos/sin tables times
        the low-precision projections), unless RoPE casts them back (``rope_keeps_dtype``)."""
        return self.position is PositionKind.ROPE and not self.rope_keeps_dtype

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates per head: MLA's decoupled RoPE head, ``rotary_dim`` where it is
        partial (transformers' int(head_dim * partial_rotary_factor)), else the whole head."""
        if self.rotary_dim is not None:
            return self.rotary_dim
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) has an MoE feed-forward."""
        moe = self.moe
        return (moe is not None and index >= moe.first_dense_layers
                and index % moe.layer_freq == moe.layer_freq - 1)

    def is_nope_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) of a RoPE model attends without RoPE."""
        n = self.nope_layer_interval
        return n > 0 and index % n == n - 1

    def is_linear_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) mixes tokens without attention: a gated DeltaNet
        layer (``linear_attention``), a short-convolution layer (``short_conv``) or a Mamba2
        layer (``mamba``)."""
        if self.short_conv is not None:
            return index not in self.short_conv.attention_layers
        if self.mamba is not None:
            return index not in self.mamba.attention_layers
        la = self.linear_attention
        return la is not None and index % la.full_attention_interval != \
            la.full_attention_interval - 1

    def is_sliding_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) attends to a sliding window."""
        if self.sliding_window is None:
            return False
        n = self.sliding_window_pattern
        return n == 0 or index % n != n - 1

    @property
    def has_linear_layers(self) -> bool:
        """Whether some layers mix tokens without attention (``is_linear_layer``)."""
        return (self.linear_attention is not None or self.short_conv is not None
                or self.mamba is not None)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def counts(self) -> ParamCounts:
        return param_counts(self)

    @property
    def num_params(self) -> int:
        return param_counts(self).total


class LayerParams(NamedTuple):
    """Parameter counts of one transformer layer, split by how tensor parallelism treats them.

    ``tp_sharded`` are split across TP ranks (column-parallel weights and biases, row-parallel
    weights); ``replicated`` are held whole by every TP rank (norms, row-parallel biases, the
    router, as in Megatron-LM). ``expert`` is routed experts' weights, split by EP and then TP.
    """

    tp_sharded: int
    replicated: int
    expert: int = 0

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.expert


class ParamCounts(NamedTuple):
    """Exact parameter counts of a model by part."""

    embedding: int  # token embedding V*h
    position_embedding: int  # learned positions max_seq*h, else 0
    layers: tuple[LayerParams, ...]
    final_norm: int
    head: int  # output projection V*h, 0 when tied to the embedding

    @property
    def total(self) -> int:
        return (self.embedding + self.position_embedding + sum(lp.total for lp in self.layers)
                + self.final_norm + self.head)


def norm_params(spec: ModelSpec) -> int:
    return spec.hidden_size * (2 if spec.norm_bias else 1)


def qk_norm_params(spec: ModelSpec) -> int:
    """The q and k norms' weights (``QkNorm``): replicated by TP for ``head`` (one head_dim
    weight each), as the projections they follow for ``full`` (counted with them)."""
    if spec.qk_norm is QkNorm.HEAD:
        return 2 * spec.head_dim
    if spec.qk_norm is QkNorm.FULL:
        return spec.q_size + spec.kv_size
    return 0


def attention_params(spec: ModelSpec) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one attention block.

    q: h*(a*d), k and v: h*(g*d) each, output: (a*d)*h; q/k/v biases are column-parallel
    (sharded), the output bias is row-parallel (replicated); per-head q/k norms replicated,
    full-width ones sharded with their projections. MLA: ``mla_params``.
    """
    if spec.mla is not None:
        return mla_params(spec)
    h = spec.hidden_size
    q_out = spec.q_size * (2 if spec.attn_output_gate else 1)  # the gate's half of q_proj
    weights = h * q_out + 2 * h * spec.kv_size + spec.q_size * h
    qkv_bias = (q_out + 2 * spec.kv_size) if spec.qkv_bias else 0
    out_bias = h if spec.attn_out_bias else 0
    qk = qk_norm_params(spec)
    full = spec.qk_norm is QkNorm.FULL
    sinks = spec.num_attention_heads if spec.attn_sinks else 0  # replicated, as the norms
    return weights + qkv_bias + (qk if full else 0), out_bias + (0 if full else qk) + sinks


def linear_attention_params(spec: ModelSpec) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one gated DeltaNet block
    (Qwen3NextGatedDeltaNet.__init__): in_proj_qkvz h * (2 * key_dim + 2 * value_dim),
    in_proj_ba h * 2 * Hv, conv1d weight conv_dim * conv_kernel (depthwise, no bias), dt_bias
    and A_log of Hv each, out_proj value_dim * h: split with the heads; the gated norm's
    weight of value_head_dim, replicated."""
    la, h = spec.linear_attention, spec.hidden_size
    assert la is not None
    sharded = (h * (2 * la.key_dim + 2 * la.value_dim) + h * 2 * la.num_value_heads
               + la.conv_dim * la.conv_kernel + 2 * la.num_value_heads + la.value_dim * h)
    return sharded, la.value_head_dim


def short_conv_params(spec: ModelSpec) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one short-convolution block (Lfm2ShortConv.
    __init__): in_proj h * 3h, the depthwise conv1d h * K, out_proj h * h, with conv_bias a
    bias on each (3h, h, h): split with the channels but out_proj's bias, replicated."""
    sc, h = spec.short_conv, spec.hidden_size
    assert sc is not None
    bias = 1 if sc.conv_bias else 0
    return 3 * h * h + h * sc.conv_kernel + h * h + bias * 4 * h, bias * h


def mamba_params(spec: ModelSpec) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one Mamba2 block (GraniteMoeHybridMambaLayer.
    __init__): the conv1d (d + 2 G n) * K and, with conv_bias, its bias; in_proj h * (2 d +
    2 G n + H) (with proj_bias its bias); dt_bias, A_log and D of H each; the gated norm's
    weight of d; out_proj d * h (its bias replicated): split with the heads."""
    m, h = spec.mamba, spec.hidden_size
    assert m is not None
    conv = m.conv_dim * m.conv_kernel + (m.conv_dim if m.conv_bias else 0)
    width = m.width
    in_proj = h * width + (width if m.proj_bias else 0)
    norm = m.inner if m.gated_norm else 0
    return conv + in_proj + 3 * m.num_heads + norm + m.inner * h, h if m.out_bias else 0


def mla_params(spec: ModelSpec) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one MLA block (``MlaSpec``): the down
    projections (h -> q_lora_rank, h -> kv_lora_rank + rope) and their norms replicated, as
    Megatron-LM's MLASelfAttention duplicates them; the up and output projections sharded.
    ``qkv_bias`` / ``attn_out_bias`` stand for DeepSeek's attention_bias, which covers the two
    down projections and the output projection."""
    mla, h, a = spec.mla, spec.hidden_size, spec.num_attention_heads
    assert mla is not None
    rope = mla.qk_rope_head_dim
    kv_down = h * (mla.kv_lora_rank + rope) + ((mla.kv_lora_rank + rope) if spec.qkv_bias else 0)
    kv_up = mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim)
    out = spec.attn_out_size * h
    out_bias = h if spec.attn_out_bias else 0
    if mla.q_lora_rank:
        q_down = h * mla.q_lora_rank + (mla.q_lora_rank if spec.qkv_bias else 0)
        replicated = q_down + mla.q_lora_rank + kv_down + mla.kv_lora_rank
        sharded = mla.q_lora_rank * spec.q_size + kv_up + out
    else:
        replicated = kv_down + mla.kv_lora_rank
        sharded = h * spec.q_size + kv_up + out
    return sharded, replicated + out_bias


def mlp_params(spec: ModelSpec, ffn: int) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one dense MLP of width ``ffn``.

    Gated: gate and up h*f each plus down f*h; otherwise up and down. Up/gate biases are sharded,
    the down bias replicated.
    """
    h = spec.hidden_size
    num_in = 2 if spec.mlp.gated else 1
    weights = (num_in + 1) * h * ffn
    in_bias = num_in * ffn if spec.mlp_bias else 0
    out_bias = h if spec.mlp_bias else 0
    return weights + in_bias, out_bias


def activation_params(spec: ModelSpec) -> int:
    """A dense MLP's activation's own parameters: xIELU's alpha_p and alpha_n, one element
    each (activations.py XIELUActivation.__init__), held whole by every TP rank."""
    return 2 if spec.activation_impl is ActivationImpl.XIELU else 0


def layer_params(spec: ModelSpec, index: int) -> LayerParams:
    attn_sharded, attn_repl = (
        attention_params(spec) if not spec.is_linear_layer(index)
        else short_conv_params(spec) if spec.short_conv is not None
        else mamba_params(spec) if spec.mamba is not None
        else linear_attention_params(spec))
    if spec.mamba is not None and spec.mamba.parallel_attention:  # the mixer beside it
        mamba_sharded, mamba_repl = mamba_params(spec)
        attn_sharded, attn_repl = attn_sharded + mamba_sharded, attn_repl + mamba_repl
    moe = spec.moe
    norms = (1 if spec.parallel_block else spec.norm_placement.norms_per_layer) * norm_params(spec)
    if moe is None or not spec.is_moe_layer(index):
        mlp_sharded, mlp_repl = mlp_params(spec, spec.ffn_hidden_size)
        return LayerParams(attn_sharded + mlp_sharded,
                           attn_repl + mlp_repl + norms + activation_params(spec))
    expert_sharded, expert_repl = mlp_params(spec, moe.expert_ffn_hidden_size)
    router = (spec.hidden_size * moe.num_experts + (moe.num_experts if moe.router_bias else 0)
              + (spec.hidden_size if moe.shared_expert_gate else 0))
    shared_sharded, shared_repl = (0, 0)
    if moe.num_shared_experts:
        shared_sharded, shared_repl = mlp_params(
            spec, moe.num_shared_experts * moe.shared_expert_ffn_hidden_size)
    return LayerParams(
        tp_sharded=attn_sharded + shared_sharded,
        replicated=attn_repl + shared_repl + norms + router,
        expert=moe.num_experts * (expert_sharded + expert_repl),
    )


@lru_cache(maxsize=256)
def param_counts(spec: ModelSpec) -> ParamCounts:
    """Exact parameter counts by part (embedding, each layer, final norm, head)."""
    h = spec.hidden_size
    if spec.param_table is not None:  # the tensors transformers builds (memplan.hf.param_table)
        table = spec.param_table
        return ParamCounts(
            embedding=spec.vocab_size * h, position_embedding=0,
            layers=tuple(LayerParams(*table.layer_split(i)) for i in range(spec.num_layers)),
            final_norm=table.final_elements(),
            head=0 if spec.tied_embeddings else spec.vocab_size * h)
    return ParamCounts(
        embedding=spec.vocab_size * h,
        position_embedding=spec.max_seq_len * h if spec.position is PositionKind.LEARNED else 0,
        layers=tuple(layer_params(spec, i) for i in range(spec.num_layers)),
        final_norm=norm_params(spec),
        head=0 if spec.tied_embeddings else spec.vocab_size * h,
    )


# --- loading -------------------------------------------------------------------------------

def _models_dir() -> Path:
    return data_dir() / "models"


@lru_cache(maxsize=1)
def catalog_names() -> tuple[str, ...]:
    """Names of the catalog models (file stems under ``model_specs/models``)."""
    return tuple(sorted(p.stem for p in _models_dir().glob("*.toml")))


def _validated(data: dict[str, Any], where: str) -> ModelSpec:
    try:
        file_fields(ModelSpec, data)  # a file's true is not 1, nor its "64" 64
    except MemplanError as err:
        raise MemplanError(f"{where}: {err}") from None
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as err:
        raise MemplanError(f"{where}: {validation_message(err)}") from err


def _read_toml(path: Path) -> dict[str, Any]:
    return read_toml(path, "model file", MODEL_FILE_BYTES)


def _model_path(key: str) -> Path | None:
    """The file ``key`` names (a folder: its config.json), None when nothing is there."""
    path = Path(key).expanduser()
    try:
        exists, folder = path.exists(), path.is_dir()
        inside = folder and (path / "config.json").exists()
    except (OSError, ValueError):  # a name too long, or with a NUL, names no file
        return None
    if folder and not inside:
        raise MemplanError(f"model: {path} is a folder without a config.json")
    if not exists:
        return None
    return regular_file(path / "config.json" if folder else path, "model file")


def load_model(name_or_path: str) -> ModelSpec:
    """A catalog name (``llama-2-7b``), a TOML spec file, or a Hugging Face ``config.json``."""
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise MemplanError(f"model must be a catalog name or a model file's path, got "
                           f"{name_or_path!r}")
    key = name_or_path.strip()
    if key.lower() in catalog_names():
        return _load_catalog(key.lower())
    path = _model_path(key)
    if path is not None:
        if path.suffix == ".toml":
            data = _read_toml(path)
            data.setdefault("name", path.stem)
            return _validated(data, str(path))
        return spec_from_hf_config(path)
    raise MemplanError(
        f"unknown model {name_or_path!r}: not in the catalog and not a file"
        + suggest(key, list(catalog_names()))
        + " (`memplan models` lists the catalog)"
    )


@lru_cache(maxsize=64)
def _load_catalog(name: str) -> ModelSpec:
    path = _models_dir() / f"{name}.toml"
    return _validated(_read_toml(path), str(path))


def load_hf_json(path: Path) -> dict[str, Any]:
    """Read a JSON file as data, with a one-line error when it is malformed."""
    data = read_json(path, "config", MODEL_FILE_BYTES)
    if not isinstance(data, dict):

        raise MemplanError(f"config {path}: expected a JSON object, got {type(data).__name__}")
    return data


def spec_from_hf_config(path: Path) -> ModelSpec:
    """Read ``path`` (a Hugging Face ``config.json``) into a ``ModelSpec``."""
    from memplan.hf.config import model_name  # only config files need the translator

    path = Path(path)
    return spec_from_hf_dict(load_hf_json(path), str(path), model_name(path))


def spec_from_hf_dict(data: dict[str, Any], where: str, name: str) -> ModelSpec:
    """A ``ModelSpec`` from a config's fields (``config.json`` or ``PretrainedConfig.to_dict()``,
    ``memplan.hf.config``); ``where`` names it in errors."""
    from memplan.hf.families import spec_fields

    spec = _validated(spec_fields(data, where, name), where)
    if spec.approximate and spec.exact_num_params not in (None, spec.num_params):
        # an unknown model type read as its nearest known block (memplan.hf.fallback)
        own, exact = spec.num_params, spec.exact_num_params
        note = (f"; its blocks count {own:,} ({100 * (own - exact) / exact:+.1f}%), which the "
                "estimate's weights, gradients and optimizer states follow")
        spec = spec.model_copy(update={"approximate": spec.approximate + note})
    return spec
