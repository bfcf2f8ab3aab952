"""``--framework``: the implementation defaults each training framework runs, with their source.

A user describes a run with the knobs they set in their framework (precision, layout, recompute,
attention backend where the framework offers a choice, batch, sequence); the framework decides
the rest: which norm kernel and optimizer implementation run, who holds the logits, what the
loss upcasts, how tensor parallelism and data-parallel gradients are laid out. Each preset here
is a selection of the mechanisms the model reads (``Mechanism``: the optimizer's implementation,
the kernels, selective recompute, the loss, the training loop, the data-parallel policy, the
layout), each ``Selection`` the settings it gives that mechanism, each setting with the file
and function it was read from and the version checked. An option the user gives explicitly
always wins over the preset.

``generic`` is plain PyTorch as memplan's reference model runs it (``memplan.profile.
reference``): torch.optim's foreach AdamW (its CUDA default), Hugging Face-style upcast norms,
the loss on fp32 logits, nothing held beyond what autograd saves.

Behaviours a framework has that memplan does not model yet are refused by name where they
would change the bytes (``validate``), not estimated as if they were the generic ones.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any, NamedTuple

from memplan.errors import LayoutError
from memplan.spec import ModelSpec, NormKind
from memplan.workload import LORA_HEAD, Framework, FsdpUnits, LogitsHeld, Recompute, Workload


class Default(NamedTuple):
    """One implementation default of a framework: a ``memplan.api`` keyword, its value (or a
    function of the model spec), and where the framework's code sets it."""

    field: str
    value: Any
    source: str

    def resolve(self, spec: ModelSpec) -> Any:
        return self.value(spec) if callable(self.value) else self.value


class Mechanism(Enum):
    """The typed policies a preset selects from, each read by one part of the model (value:
    what it decides, and where)."""

    OPTIMIZER = "the optimizer's implementation: its step temporaries (model/optimizer.py)"
    KERNELS = ("what the blocks' kernels save and hold: norms, attention core, MoE experts, "
               "fused projections, RoPE tables, masks, a KV cache (model/ blocks)")
    RECOMPUTE = "how selective recompute picks what to save (model/sac.py)"
    LOSS = "the loss and its logits: dtype, implementation, split (model/head.py)"
    LOOP = ("the training loop: the logits it holds, the embedding output the model's "
            "forward keeps, gradients zeroed or freed (model/head.py, model/stage.py)")
    DATA_PARALLEL = ("the data-parallel policy: FSDP units, DDP gradient buffers "
                     "(model/model_states.py, model/sharding.py)")
    LAYOUT = "tensor-parallel style and pipeline split (parallel.py, model/pipeline.py)"
    STEP_TIME = ("how a step is timed: its compute at a flat end-to-end MFU or kernel by "
                 "kernel with the framework's fused pointwise kernels, and whether the "
                 "pipeline's sends overlap compute (planning/timing.py)")


# The settings (Workload or ParallelConfig fields) of each mechanism: a preset selects a
# mechanism by setting some of them.
SETTINGS: dict[Mechanism, frozenset[str]] = {
    Mechanism.OPTIMIZER: frozenset({"optimizer_impl", "flat_partition",
                                    "adapters_in_model_dtype"}),
    Mechanism.KERNELS: frozenset({"norm_impl", "softmax_fp32", "moe_impl", "window_mask",
                                  "attn_weights_held", "mask_per_sequence", "positions_held",
                                  "kv_cache", "fused_qkv", "rope_cache", "attention_impl",
                                  "mlp_impl", "cp_exchange"}),
    Mechanism.RECOMPUTE: frozenset({"selective_impl"}),
    Mechanism.LOSS: frozenset({"logits_fp32", "loss_impl", "loss_split",
                                "loss_chunk_backward"}),
    Mechanism.LOOP: frozenset({"logits_held", "embeds_held", "keep_grads", "grad_sync"}),
    Mechanism.DATA_PARALLEL: frozenset({"fsdp_units", "grad_buffers", "ddp_any_size",
                                        "zero_bucket_numel", "zero_bucket_buffers",
                                        "zero3_plain_gathers", "fsdp_version", "backward_prefetch",
                                        "use_orig_params", "zero3_prefetch_numel",
                                        "zero3_max_live_numel", "zero3_reuse_distance_numel",
                                        "zero3_persistence_numel"}),
    Mechanism.LAYOUT: frozenset({"tp_style", "pipeline_split", "pipeline_buffers"}),
    Mechanism.STEP_TIME: frozenset({"step_model", "pipeline_p2p"}),
}


class Selection(NamedTuple):
    """A framework's choice of one mechanism: the settings it gives it, each with its
    source (``Default``; each a setting of that mechanism, ``SETTINGS``)."""

    mechanism: Mechanism
    defaults: tuple[Default, ...]


def _hf_norm(spec: ModelSpec) -> str:
    # LlamaRMSNorm / Qwen2RMSNorm / MistralRMSNorm are Python upcasts; GPT-2's nn.LayerNorm is
    # one aten kernel; Gemma's and OLMo 2's RMSNorms scale the fp32 tensor before the cast
    # (Cohere2LayerNorm too: ModelSpec.norm_centres_twice)
    if spec.norm is NormKind.LAYERNORM:
        return "upcast-fp32" if spec.norm_centres_twice else "fused"
    return "upcast-fp32" if spec.norm_scale_fp32 else "upcast"


def _hf_softmax(spec: ModelSpec) -> bool:
    # the family's own eager_attention_forward decides (ModelSpec.eager_softmax_fp32)
    return spec.eager_softmax_fp32


def _hf_moe(spec: ModelSpec) -> str:
    # the experts' implementation transformers picks for stacked experts (Granite's MoE
    # too: GraniteMoeExperts under use_experts_implementation), unless the model's own MoE
    # runs every token through every expert (MoESpec.every_expert: Llama 4)
    return "every" if spec.moe is not None and spec.moe.every_expert else "grouped"


def _hf_cache(spec: ModelSpec) -> bool:
    # the model's config.json decides (ModelSpec.use_cache); Trainer leaves it as it is
    return spec.use_cache


def titan_moe_refusal(spec: ModelSpec) -> str | None:
    """What torchtitan's MoE block cannot run of the spec's, or None: a shared-expert gate
    (``MoE.forward`` adds the shared output as it is), GPT-OSS's clamped experts (its own
    GptOssGroupedExperts), Llama 4's every-expert MoE, Granite's parallel experts."""
    moe = spec.moe
    assert moe is not None, "an MoE block needs spec.moe"
    for field, why in (("shared_expert_gate", "no sigmoid gate on its shared experts"),
                       ("clamped_swiglu", "GroupedExperts' plain SwiGLU"),
                       ("every_expert", "top-k routing"),
                       ("parallel_experts", "stacked GroupedExperts")):
        if getattr(moe, field):
            return f"moe_impl titan with moe.{field} (torchtitan 0.3.0's MoE: {why})"
    if not spec.mlp.gated:
        return "moe_impl titan with ungated experts (GroupedExperts: silu(w1 x) * w3 x)"
    return None


def _titan_moe(spec: ModelSpec) -> str:
    # torchtitan's own block where it can express the spec's MoE (titan_moe_refusal: no
    # shared-expert gate, no clamped or every-expert or parallel experts, gated experts);
    # memplan's reference loop otherwise, as before torchtitan's block was modelled
    if spec.moe is None or titan_moe_refusal(spec) is None:
        return "titan"
    return "loop"


def _titan_units(spec: ModelSpec) -> str:
    return "root" if spec.tied_embeddings else "torchtitan"


_TRANSFORMERS = "transformers 5.24"
_ACCELERATE = "accelerate 1.15.0"
_TITAN = "torchtitan 0.3.0"
_LITGPT = "litgpt 0.5.13 / lightning 2.6"
_MEGATRON = "megatron-core 0.16.1"
_DEEPSPEED = "deepspeed 0.19.8"

PRESETS: dict[Framework, tuple[Selection, ...]] = {
    Framework.GENERIC: (),
    Framework.HF: (
        Selection(Mechanism.OPTIMIZER, (
            Default("optimizer_impl", "fused",
                    f"transformers/training_args.py TrainingArguments.optim: adamw_torch_fused "
                    f"for torch >= 2.8 ({_TRANSFORMERS})"),
        )),
        Selection(Mechanism.KERNELS, (
            Default("norm_impl", _hf_norm,
                    f"models/llama/modeling_llama.py LlamaRMSNorm.forward upcasts to fp32 in "
                    f"Python; Gemma2RMSNorm / Olmo2RMSNorm scale the fp32 tensor before the cast "
                    f"back; GPT-2 uses nn.LayerNorm ({_TRANSFORMERS})"),
            Default("softmax_fp32", _hf_softmax,
                    f"the family's eager_attention_forward (eager attention only): "
                    f"models/llama/modeling_llama.py softmax(..., dtype=torch.float32)."
                    f"to(query.dtype), as Mistral's, Mixtral's, Qwen2's, Qwen3's, the MoE Qwens', "
                    f"Gemma 2/3's, Phi-3's, OLMo 2's and DeepSeek-V3's; models/gpt2/"
                    f"modeling_gpt2.py softmax(attn_weights, dim=-1) in the scores' dtype "
                    f"({_TRANSFORMERS})"),
            Default("moe_impl", _hf_moe,
                    f"integrations/moe.py grouped_mm_experts_forward: the experts' default "
                    f"implementation (modeling_utils.py get_correct_experts_implementation) for "
                    f"the stacked experts of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3; "
                    f"models/llama4/modeling_llama4.py Llama4TextMoe.forward runs its own "
                    f"bmm experts over every token ({_TRANSFORMERS}); Granite's MoE "
                    f"(models/granitemoe/modeling_granitemoe.py GraniteMoeExperts under "
                    f"use_experts_implementation, routed by GraniteMoeTopKRouter) grouped as "
                    f"well (transformers 5.23 and 5.24); transformers 5.3 ran its own "
                    f"GraniteMoeParallelExperts per expert (GraniteMoeMoE.forward): moe_impl "
                    f"parallel. grouped_mm_experts_forward as 5.23 writes it (the routed pairs "
                    f"sorted, the rows gathered once); as 5.3 wrote it (gathered by token, "
                    f"then copied sorted): moe_impl grouped-token"),
            Default("window_mask", True,
                    f"masking_utils.py sdpa_mask: a sliding-window layer gets an explicit mask "
                    f"unless the sequence is shorter than the window (_ignore_causal_mask_sdpa); "
                    f"integrations/sdpa_attention.py repeats K and V for it (use_gqa_in_sdpa "
                    f"needs no mask) ({_TRANSFORMERS})"),
            Default("attn_weights_held", True,
                    f"models/llama/modeling_llama.py LlamaDecoderLayer.forward: hidden_states, "
                    f"_ = self.self_attn(...) keeps eager_attention_forward's attn_weights "
                    f"until the layer returns; the other families' decoder layers alike "
                    f"({_TRANSFORMERS})"),
            Default("positions_held", True,
                    f"models/llama/modeling_llama.py LlamaModel.forward passes cache_position "
                    f"(torch.arange(seq_len), position_ids its view; 5.23: position_ids, arange "
                    f"+ past_seen_tokens) to every decoder layer as a keyword argument; "
                    f"modeling_layers.py GradientCheckpointingLayer.__call__ checkpoints "
                    f"partial(super().__call__, **kwargs), which holds it to the layer's "
                    f"backward ({_TRANSFORMERS})"),
            Default("mask_per_sequence", True,
                    f"masking_utils.py eager_mask: torch.where(mask, 0.0, min_dtype) over "
                    f"sdpa_mask's boolean mask expanded to (batch, 1, q, kv) ({_TRANSFORMERS})"),
            Default("kv_cache", _hf_cache,
                    f"models/llama/modeling_llama.py LlamaModel.forward builds a DynamicCache "
                    f"when the config's use_cache (every configuration class's default), also in "
                    f"training without gradient checkpointing; cache_utils.py DynamicLayer.update "
                    f"concatenates each layer's K and V into it ({_TRANSFORMERS})"),
        )),
        Selection(Mechanism.LOSS, (
            Default("logits_fp32", True,
                    f"loss/loss_utils.py ForCausalLMLoss: logits.float() ({_TRANSFORMERS})"),
        )),
        Selection(Mechanism.LOOP, (
            Default("logits_held", LogitsHeld.LOSS.value,
                    f"models/llama/modeling_llama.py LlamaForCausalLM.forward keeps `logits` for "
                    f"its CausalLMOutputWithPast while the loss upcasts a copy; Trainer."
                    f"compute_loss drops the output before backward ({_TRANSFORMERS})"),
            Default("embeds_held", True,
                    f"models/llama/modeling_llama.py LlamaModel.forward: inputs_embeds = "
                    f"self.embed_tokens(input_ids), hidden_states = inputs_embeds, then the "
                    f"decoder layers and the final norm rebind hidden_states while the local "
                    f"inputs_embeds keeps the embedding's output until the model returns, "
                    f"before lm_head; the other families' XModel.forward alike "
                    f"({_TRANSFORMERS})"),
            # DDP (--zero 0) and FSDP2 (--zero 3) only: under DeepSpeed (--zero 1/2) Trainer
            # syncs every micro-batch, which is what "last" holds there (memplan.parallel)
            Default("grad_sync", "last",
                    f"trainer.py Trainer._inner_training_loop runs each micro-batch but a step's "
                    f"last under accelerator.no_sync (unless sync_each_batch or DeepSpeed); "
                    f"accelerate/accelerator.py Accelerator.no_sync: DDP's no_sync(), FSDP2's "
                    f"set_requires_gradient_sync(False); GradientAccumulationPlugin."
                    f"sync_each_batch defaults to False (accelerate 1.15.0, {_TRANSFORMERS})"),
        )),
        Selection(Mechanism.DATA_PARALLEL, (
            Default("fsdp_version", 1,
                    f"utils/dataclasses.py FullyShardedDataParallelPlugin.__post_init__: "
                    f"fsdp_version = int(os.environ.get('FSDP_VERSION', '1')); transformers "
                    f"training_args.py TrainingArguments._process_fsdp_args: "
                    f"fsdp_config.get('version', 1) ({_ACCELERATE}, {_TRANSFORMERS})"),
            Default("backward_prefetch", "none",
                    f"utils/dataclasses.py FullyShardedDataParallelPlugin.__post_init__: "
                    f"backward_prefetch None (NO_PREFETCH) unless FSDP_BACKWARD_PREFETCH; "
                    f"training_args.py _process_fsdp_args: fsdp_config.get('backward_prefetch', "
                    f"'NO_PREFETCH') ({_ACCELERATE}, {_TRANSFORMERS})"),
            Default("use_orig_params", True,
                    f"training_args.py TrainingArguments._process_fsdp_args: "
                    f"fsdp_config.get('use_orig_params', 'true') (Accelerate's own plugin "
                    f"defaults to False) ({_TRANSFORMERS})"),
        )),
    ),
    Framework.TORCHTITAN: (
        Selection(Mechanism.OPTIMIZER, (
            Default("optimizer_impl", "fused",
                    f"components/optimizer/optimizer.py OptimizersContainer config: implementation "
                    f"= 'fused' ({_TITAN})"),
        )),
        Selection(Mechanism.KERNELS, (
            Default("norm_impl", "fused",
                    f"models/common/nn_modules.py RMSNorm: nn.RMSNorm, which runs F.rms_norm, "
                    f"CUDA's fused kernel ({_TITAN})"),
            Default("fused_qkv", True,
                    f"models/common/attention.py FusedQKVLinear (fuse_qkv in the llama3 flavors) "
                    f"({_TITAN})"),
            Default("moe_impl", _titan_moe,
                    f"models/common/moe.py MoE.forward: TokenChoiceTopKRouter (its gate under "
                    f"fp32 autocast), RoutedExperts with LocalTokenDispatcher (models/common/"
                    f"token_dispatcher.py _local_reorder, combine) and GroupedExperts "
                    f"(torch._grouped_mm in bf16), shared experts after them, for every MoE "
                    f"flavor (qwen3, deepseek_v3, kimi_k2, gpt_oss's router and dispatcher); "
                    f"memplan's reference loop for an MoE torchtitan's block cannot express "
                    f"(a shared-expert gate, clamped, every-expert or parallel experts) "
                    f"({_TITAN})"),
            Default("rope_cache", "layer",
                    f"models/common/rope.py RoPE.__init__: register_buffer('cache', ...) in "
                    f"every attention layer, complex64 (max_seq_len, head_dim/2), cut to "
                    f"training.seq_len by models/common/decoder.py Decoder.Config."
                    f"update_from_config ({_TITAN})"),
            Default("cp_exchange", "allgather",
                    "config/job_config.py Parallelism.context_parallel_rotate_method = "
                    "'allgather', set by distributed/utils.py create_context_parallel_ctx "
                    "through torch's set_rotate_method (torchtitan 0.2.2; the Dec 2024 "
                    "benchmarks' 9dec370 the same)"),
        )),
        Selection(Mechanism.RECOMPUTE, (
            Default("selective_impl", "op",
                    f"distributed/activation_checkpoint.py SelectiveAC._wrap_block: the per-op "
                    f"policy, its save list _get_default_save_ops, every second mm recomputed "
                    f"({_TITAN})"),
        )),
        Selection(Mechanism.LOSS, (
            Default("logits_fp32", True,
                    f"components/loss.py cross_entropy_loss: pred.flatten(0, 1).float() "
                    f"({_TITAN})"),
            Default("loss_impl", "torchtitan",
                    f"components/loss.py cross_entropy_loss: on logits sharded over the "
                    f"vocabulary (under TP: models/common/decoder_sharding.py "
                    f"set_decoder_sharding_config keeps lm_head's output S(-1)) "
                    f"_LossParallelCrossEntropy, whose forward keeps the shifted logits and whose "
                    f"backward makes three logits-sized tensors ({_TITAN})"),
            Default("loss_chunk_backward", "in-loss",
                    f"components/loss.py ChunkedLossWrapper.__call__ (the loss of the llama3 and "
                    f"qwen3 registry's 8B/70B/405B and 0.6B-32B configs, 8 chunks; Trainer."
                    f"Config's "
                    f"default loss is unchunked): each chunk's lm_head, loss and backward inside "
                    f"the loss call, lm_head's sync off but for the last chunk ({_TITAN})"),
        )),
        Selection(Mechanism.LOOP, (
            Default("logits_held", LogitsHeld.LOSS.value,
                    f"trainer.py Trainer._forward_backward_body: `pred = model(inputs)` stays "
                    f"referenced while loss_fn upcasts a copy, `del pred` before backward "
                    f"({_TITAN})"),
            Default("keep_grads", True,
                    f"trainer.py Trainer.train_step: optimizers.zero_grad(set_to_none="
                    f"training.disable_cuda_graphs), which config/configs.py defaults to False "
                    f"({_TITAN})"),
        )),
        Selection(Mechanism.DATA_PARALLEL, (
            Default("fsdp_units", _titan_units,
                    f"distributed/fsdp.py apply_fsdp_to_decoder: fully_shard on tok_embeddings "
                    f"(resharded after forward), on [norm, lm_head] (not resharded after "
                    f"forward) and on each block; with tied weights one unit of all three "
                    f"({_TITAN})"),
        )),
        Selection(Mechanism.LAYOUT, (
            Default("pipeline_split", "weighted",
                    f"distributed/pipeline_parallel.py pipeline_llm: without "
                    f"module_fqns_per_model_part, _generate_llm_fqn_per_model_part splits the "
                    f"layers with the embedding and the head counted as pipeline_parallel_first/"
                    f"last_stage_less_layers (1) layers each ({_TITAN})"),
            Default("tp_style", "dtensor",
                    f"models/llama3/infra/parallelize.py apply_tp: DTensor ColwiseParallel / "
                    f"RowwiseParallel / SequenceParallel plans ({_TITAN})"),
            Default("pipeline_buffers", "torch",
                    f"distributed/pipeline_parallel.py _pipeline_module_split: each stage a "
                    f"torch.distributed.pipelining PipelineStage, run by trainer.py "
                    f"Trainer.pp_forward_backward_step's pp_schedule.step(..., return_outputs="
                    f"False) ({_TITAN}; torch 2.13 stage.py, schedules.py)"),
        )),
    ),
    Framework.LIGHTNING: (
        Selection(Mechanism.OPTIMIZER, (
            Default("optimizer_impl", "fused",
                    f"litgpt/pretrain.py: instantiate_torch_optimizer(..., fused=fabric.device."
                    f"type == 'cuda') ({_LITGPT})"),
        )),
        Selection(Mechanism.KERNELS, (
            Default("norm_impl", "upcast-fp32",
                    f"litgpt/model.py RMSNorm.forward: x.float() normalised in fp32 and multiplied "
                    f"by weight.float() before the cast back ({_LITGPT})"),
            Default("rope_cache", "model",
                    f"litgpt/model.py GPT.max_seq_length: register_buffer('cos' / 'sin', "
                    f"rope_cache()) for max_seq_length positions, which litgpt/pretrain.py sets "
                    f"to train.max_seq_length; each forward slices them ({_LITGPT})"),
            Default("attention_impl", "litgpt",
                    f"litgpt/model.py CausalSelfAttention.forward: qkv.split views, RoPE through "
                    f"torch.cat, k/v repeat_interleave for grouped queries, y.reshape after "
                    f"SDPA ({_LITGPT})"),
            Default("mlp_impl", "litgpt",
                    f"litgpt/model.py LLaMAMLP.forward: x_fc_1 = self.fc_1(x); x_fc_2 = "
                    f"self.fc_2(x); F.silu(x_fc_1) * x_fc_2 ({_LITGPT})"),
        )),
        Selection(Mechanism.LOSS, (
            Default("logits_fp32", True,
                    f"lightning/fabric/plugins/precision/half.py HalfPrecision.convert_output and "
                    f"amp.py MixedPrecision.convert_output return fp32 logits ({_LITGPT})"),
            Default("loss_split", 128,
                    f"litgpt/utils.py chunked_cross_entropy(chunk_size=128): the flattened logits "
                    f"split into 128-token pieces, each its own cross_entropy, nothing "
                    f"checkpointed ({_LITGPT})"),
        )),
        Selection(Mechanism.LOOP, (
            Default("logits_held", LogitsHeld.STEP.value,
                    f"litgpt/pretrain.py fit: `logits = model(input_ids)` is a loop variable "
                    f"({_LITGPT})"),
            # under DeepSpeed (--zero 1/2) Fabric syncs every micro-batch, which is what
            # "last" holds there (memplan.parallel)
            Default("grad_sync", "last",
                    f"litgpt/pretrain.py fit and finetune/*.py: each micro-batch but a step's "
                    f"last under fabric.no_backward_sync(model, enabled=is_accumulating): "
                    f"DDPStrategy's DistributedDataParallel.no_sync(), FSDPStrategy's "
                    f"FullyShardedDataParallel.no_sync(), ModelParallelStrategy's "
                    f"set_requires_gradient_sync(False); DeepSpeedStrategy has no backward "
                    f"sync control (lightning_fabric/strategies/deepspeed.py) ({_LITGPT})"),
        )),
    ),
    Framework.MEGATRON: (
        Selection(Mechanism.OPTIMIZER, (
            Default("optimizer_impl", "fused",
                    f"megatron/core/optimizer/__init__.py: Apex / Transformer Engine FusedAdam "
                    f"({_MEGATRON})"),
        )),
        Selection(Mechanism.KERNELS, (
            Default("norm_impl", "fused",
                    f"megatron/core/extensions/transformer_engine.py TENorm, megatron/core/fusions/"
                    f"fused_layer_norm.py FusedLayerNorm ({_MEGATRON})"),
        )),
        Selection(Mechanism.LOSS, (
            Default("loss_impl", "megatron",
                    f"megatron/core/tensor_parallel/cross_entropy.py _VocabParallelCrossEntropy: "
                    f"the fp32 copy of the logits becomes the saved softmax in place, its backward "
                    f"works in place on it; GPTModel.forward keeps the logits while the loss runs "
                    f"({_MEGATRON}; without --cross-entropy-loss-fusion)"),
        )),
        Selection(Mechanism.DATA_PARALLEL, (
            Default("grad_buffers", "view",
                    f"megatron/core/distributed/param_and_grad_buffer.py: gradients are views "
                    f"of persistent contiguous buffers ({_MEGATRON})"),
            Default("ddp_any_size", True,
                    f"Megatron-LM megatron/training/training.py get_model wraps every model "
                    f"chunk in megatron/core/distributed DistributedDataParallel, whose "
                    f"param_and_grad_buffer.py _ParamAndGradBuffer.__init__ allocates the "
                    f"gradient buffer (torch.zeros(numel)) at any data-parallel size "
                    f"({_MEGATRON})"),
        )),
        Selection(Mechanism.LAYOUT, (
            Default("tp_style", "megatron",
                    f"megatron/core/tensor_parallel/layers.py Column/RowParallelLinear "
                    f"({_MEGATRON})"),
        )),
        Selection(Mechanism.STEP_TIME, (
            Default("step_model", "kernels",
                    f"the layer's pointwise work runs as fused kernels, each timed by the bytes "
                    f"it moves: megatron/core/fusions/fused_layer_norm.py FusedLayerNorm, "
                    f"fused_bias_dropout.py bias_dropout_add_fused_train, fused_bias_gelu.py "
                    f"bias_gelu_impl, fused_bias_swiglu.py bias_swiglu_impl, fused_softmax.py "
                    f"ScaledUpperTriangMaskedSoftmax (scaled_upper_triang_masked_softmax_cuda), "
                    f"called from megatron/core/transformer/transformer_layer.py "
                    f"TransformerLayer._forward_attention and _forward_post_mlp (the "
                    f"self_attn_bda and mlp_bda bias-dropout-adds) and mlp.py MLP.forward "
                    f"({_MEGATRON})"),
            Default("pipeline_p2p", "blocking",
                    f"megatron/core/pipeline_parallel/schedules.py "
                    f"forward_backward_pipelining_without_interleaving: "
                    f"P2PCommunicator.send_forward_recv_backward / send_backward_recv_forward "
                    f"call p2p_communication.py _communicate with wait_on_reqs True, which "
                    f"waits on each request before the next compute; the interleaved schedule "
                    f"overlaps them under overlap_p2p_comm ({_MEGATRON})"),
        )),
    ),
}
# DeepSpeed as the transformers Trainer runs it (TrainingArguments(deepspeed=ds_config)): the
# model's own kernels, loss and held logits are the hf preset's; the optimizer and the
# data-parallel buffers are DeepSpeed's engine's; gradients are reduced in every micro-batch's
# backward (trainer.py _inner_training_loop never enters no_sync under DeepSpeed)
PRESETS[Framework.DEEPSPEED] = (
        *(sel for sel in PRESETS[Framework.HF]
          if sel.mechanism in (Mechanism.KERNELS, Mechanism.LOSS)),
        Selection(Mechanism.LOOP, tuple(d for sel in PRESETS[Framework.HF]
                                        if sel.mechanism is Mechanism.LOOP
                                        for d in sel.defaults if d.field != "grad_sync")),
        Selection(Mechanism.OPTIMIZER, (
            Default("optimizer_impl", "fused",
                    f"ops/adam/fused_adam.py FusedAdam.step: multi_tensor_apply over the fp32 "
                    f"partition, no temporaries beyond exp_avg and exp_avg_sq (the optimizer "
                    f"'AdamW'/'Adam' of a ds_config, engine.py _configure_basic_optimizer) "
                    f"({_DEEPSPEED})"),
            Default("adapters_in_model_dtype", True,
                    f"runtime/engine.py DeepSpeedEngine._cast_module_mixed_precision (from "
                    f"_configure_distributed_model, bf16 or fp16 enabled): every parameter of a "
                    f"castable dtype, peft's fp32 adapters included, is cast to the model's "
                    f"(p.data = p.data.to(param_dtype)); the ZeRO optimizer then keeps fp32 "
                    f"partitions of the trainable ones ({_DEEPSPEED})"),
            Default("flat_partition", True,
                    f"runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__: the "
                    f"optimizer's params are one flat fp32 partition per group "
                    f"(single_partition_of_fp32_groups); .step: flatten(averaged_gradients[i]) "
                    f"copies the gradient partition, .to(fp32) makes the fp32 gradient the "
                    f"optimizer reads ({_DEEPSPEED})"),
        )),
        Selection(Mechanism.DATA_PARALLEL, (
            Default("zero_bucket_numel", 500_000_000,
                    f"runtime/zero/config.py DeepSpeedZeroConfig.reduce_bucket_size = 5e8; "
                    f"stage_1_and_2.py setup_buckets: torch.empty(reduce_bucket_size) in the "
                    f"gradients' dtype at a backward's first gradient hook ({_DEEPSPEED})"),
            Default("zero_bucket_buffers", 1,
                    f"runtime/zero/config.py contiguous_gradients = True, overlap_comm True "
                    f"for stage 3 only (overlap_comm_valid): one bucket, a second "
                    f"with overlap_comm (stage_1_and_2.py setup_buckets buf_1) ({_DEEPSPEED})"),
        )),
)

# The fields a preset sets: those of the layout (``ParallelConfig``), the rest the workload's.
# One that neither the user nor the preset sets keeps its own default, declared once on
# ``Workload`` or ``ParallelConfig``: the generic preset is those defaults.
LAYOUT_FIELDS = frozenset({"tp_style", "grad_buffers"})


def defaults(framework: Framework) -> tuple[Default, ...]:
    """Every setting ``framework``'s preset gives, its mechanisms in order."""
    return tuple(d for selection in PRESETS[framework] for d in selection.defaults)


FIELDS = frozenset(d.field for framework in PRESETS for d in defaults(framework))


def parse(value: object) -> Framework:
    """A framework from its name or itself; None is the generic preset."""
    if value is None:
        return Framework.GENERIC
    if isinstance(value, Framework):
        return value
    try:
        return Framework(str(value).lower())
    except ValueError:
        names = ", ".join(f.value for f in Framework)
        raise LayoutError("framework must be one of the presets",
                          f"framework must be one of {names}, got {value!r}") from None


def apply(framework: Framework, spec: ModelSpec, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` keyword arguments with each field the preset sets filled from it where the
    user left it unset (absent or None); the others keep the model's own default."""
    out = dict(given)
    for default in defaults(framework):
        if out.get(default.field) is None:
            out[default.field] = default.resolve(spec)
    return out


def assumptions(framework: Framework, spec: ModelSpec, used: Callable[[str], Any]) -> list[str]:
    """One line per preset default that the estimate used (``used(field)`` is the value it
    ran with), with its source; nothing for the generic preset."""
    out = []
    for d in defaults(framework):
        if used(d.field) == d.resolve(spec):
            out.append(f"{framework.value}: {d.field} = {_show(d.resolve(spec))} ({d.source})")
    return out


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


class Refusal(NamedTuple):
    """An option a framework does not offer, or offers in a form memplan does not model."""

    applies: Callable[[Any, Any], bool]  # (layout, workload) -> refused?
    option: str
    why: str


REFUSALS: dict[Framework, tuple[Refusal, ...]] = {
    Framework.HF: (
        Refusal(lambda par, wl: wl.recompute.label == "selective", "--recompute selective",
                "transformers has no selective recompute; gradient_checkpointing_enable() "
                "checkpoints each decoder layer, which is --recompute full"),
    ),
    Framework.TORCHTITAN: (),
    Framework.LIGHTNING: (),
    Framework.MEGATRON: (
        Refusal(lambda par, wl: par is not None and int(par.zero) >= 2
                and wl.fsdp_units is not FsdpUnits.BUCKETS, "--zero 2 or 3",
                "Megatron-LM's distributed optimizer (--use-distributed-optimizer) shards the "
                "optimizer states and keeps whole gradient buffers (--zero 1); its FSDP "
                "(--use-megatron-fsdp, read by --megatron-args) shards gradients (2) or also "
                "weights (3) as units of buckets"),
    ),
    Framework.GENERIC: (),
    Framework.DEEPSPEED: (
        Refusal(lambda par, wl: par is not None and int(par.zero) == 0,
                "--zero 0",
                "memplan models DeepSpeed's ZeRO stages 1, 2 (runtime/zero/stage_1_and_2.py "
                "DeepSpeedZeroOptimizer) and 3 (stage3.py, the parameter coordinator "
                "memplan.model.deepspeed_coordinator); stage 0's bf16 optimizer is not "
                "modelled yet"),
        Refusal(lambda par, wl: par is not None and int(par.zero) == 1 and (
                    wl.zero_bucket_buffers != 1
                    or (wl.global_batch_size or 0)
                    > wl.micro_batch_size * par.data_parallel_degree),
                "--zero 1 with overlap_comm, without contiguous_gradients or with gradient "
                "accumulation",
                "DeepSpeed's stage 1 is traced with one bucket and one micro-batch per step "
                "(stage_1_and_2.py reduce_gradients after backward); the others are not"),
        Refusal(lambda par, wl: wl.precision.value not in ("bf16-mixed", "fp16-mixed"),
                "a precision other than bf16-mixed or fp16-mixed",
                "DeepSpeed's ZeRO keeps bf16/fp16 weights and gradients with an fp32 "
                "partition (bf16 or fp16 enabled); an fp32 run clones an fp32 partition "
                "beside fp32 weights, not modelled"),
        Refusal(lambda par, wl: par is not None and (par.tp > 1 or par.pp > 1 or par.cp > 1
                                                     or par.ep > 1),
                "--tp, --pp, --cp or --ep above 1",
                "DeepSpeed's pipeline engine (runtime/pipe), AutoTP, Ulysses and MoE groups "
                "are not modelled: data parallelism only"),
        Refusal(lambda par, wl: wl.recompute.label == "selective", "--recompute selective",
                "transformers has no selective recompute; gradient_checkpointing_enable() "
                "checkpoints each decoder layer, which is --recompute full"),
        Refusal(lambda par, wl: wl.optimizer.value != "adamw",
                "an optimizer other than AdamW",
                "DeepSpeed's ZeRO is traced with AdamW (the Trainer's adamw_torch_fused) on "
                "its flat fp32 partitions; bitsandbytes' states on them are not"),
        Refusal(lambda par, wl: bool(wl.lora_rank) and (
                    wl.base_quant.value != "none"
                    or bool(set(wl.lora_targets or ()) & set(LORA_HEAD))
                    or (par is not None and (int(par.zero) not in (2, 3)
                                             or bool(par.offload)))),
                "LoRA with a quantized base, on the output projection, at stage 1 or with "
                "offload",
                "DeepSpeed with peft's LoRA is traced at ZeRO-2 and ZeRO-3 with a bf16/fp16 "
                "base and adapters on the decoder's projections (the engine casts them to the "
                "model's dtype; only they have fp32 partitions, gradients and states; ZeRO-3 "
                "partitions and gathers the frozen weights too); a quantized (nf4/int8) base "
                "partitioned by ZeRO-3, the head's adapter, stage 1 and offload are not"),
        Refusal(lambda par, wl: par is not None and bool(par.offload) and not (
                    (int(par.zero) in (1, 2, 3)
                     and {o.value for o in par.offload} == {"optimizer"})
                    or (int(par.zero) == 3
                        and {o.value for o in par.offload} == {"optimizer", "params"})),
                "--offload other than the optimizer at stage 1, 2 or 3, or the optimizer and "
                "params at stage 3",
                "DeepSpeed's ZeRO-Offload is modelled at stages 1 and 2 (stage_1_and_2.py with "
                "cpu_offload) and 3 (stage3.py offload_optimizer), and the parameters' offload "
                "with it at stage 3 (offload_param), each traced; offload_param alone and for "
                "activations it is not"),
    ),
}
REFUSALS[Framework.TORCHTITAN] += (
    Refusal(lambda par, wl: par is not None and int(par.zero) in (1, 2), "--zero 1 or 2",
            "torchtitan shards with FSDP2 (data_parallel_shard_degree: --zero 3) or replicates "
            "(data_parallel_replicate_degree: --zero 0); it has no ZeRO-1 or ZeRO-2"),
)


def validate(par: Any, wl: Any) -> None:
    """Raise ``LayoutError`` naming the framework and the option it does not offer."""
    framework = wl.framework
    for refusal in REFUSALS[framework]:
        if refusal.applies(par, wl):
            raise LayoutError(f"framework {framework.value} does not offer {refusal.option}",
                              f"--framework {framework.value} with {refusal.option}: "
                              f"{refusal.why}")


def accumulation_refused(par: Any, wl: Any) -> str | None:
    """The option ``wl``'s framework refuses for ``par`` only with gradient accumulation
    (more than one micro-batch per step: DeepSpeed's stage 1, ``REFUSALS``), or None: a plan
    then searches only the micro-batch that makes one per step."""
    if not REFUSALS[wl.framework]:
        return None
    dp = par.data_parallel_degree
    one = wl.model_copy(update={"global_batch_size": wl.micro_batch_size * dp})
    many = wl.model_copy(update={"global_batch_size": 2 * wl.micro_batch_size * dp})
    for refusal in REFUSALS[wl.framework]:
        if refusal.applies(par, many) and not refusal.applies(par, one):
            return f"framework {wl.framework.value} does not offer {refusal.option}"
    return None


def refused_recompute(framework: Framework) -> set[str]:
    """The recompute policies (labels) ``framework`` refuses (``REFUSALS``)."""
    out = set()
    for policy in Recompute:
        wl = Workload(framework=framework, recompute=policy)
        if any(r.applies(None, wl) for r in REFUSALS[framework]):
            out.add(policy.label)
    return out
