"""Where a job died, read from the Python traceback printed with its out-of-memory error.

torch-free. The frames of a traceback name the code that asked for the memory: the optimizer's
foreach update, DeepSpeed's gradient reduction, ``from_pretrained``'s loading. Each rule below
names a file (the end of its path) and the functions of it that mark one phase of a training
job, each cited by the framework file and function it was read from; the frames are read from
the innermost (where the allocation failed) outwards, and the first frame a rule knows gives
the operation; the first that names a phase gives the phase. A collective
(``torch.distributed.all_reduce``) names no phase of its own: the frames around it say whose it
is (DeepSpeed's gradient reduction, FSDP's unsharding in a forward). A module's forward under
a backward is the recomputation of a checkpointed forward.

Three traceback layouts are read: Python's own (``File "PATH", line N, in FUNC``), IPython's
(``File PATH:N, in Class.FUNC(args)``) and rich's boxed one (``PATH:N in FUNC``, the function on
the next line when the path is long). Launcher prefixes (``[rank3]:``) are removed and tell
the ranks apart; chained exceptions ("During handling of the above exception") split a
traceback into blocks, the first of which holds the frame that raised.

Frames of the same shape come with each allocation of a memory snapshot (innermost first:
``memplan.measure.memory_timeline``), which ``phase_of_frames`` reads the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The phases a job can die in, in the order a job reaches them.
PHASES = ("loading", "setup", "forward", "backward", "gradient communication",
          "optimizer step", "checkpoint save", "evaluation", "generation")
# the phase a bare collective gets when no frame around it names one
COMMUNICATION = "collective communication"


@dataclass(frozen=True)
class Frame:
    path: str  # as printed, "/" separators
    function: str  # the function's own name (a method's class dropped)
    line: int | None = None


@dataclass(frozen=True)
class Rule:
    path: str  # the end of the frame's path
    functions: frozenset[str]
    phase: str | None  # None: the frames around it say (a collective)
    operation: str
    source: str  # the framework file and function this rule was read from

    def matches(self, frame: Frame) -> bool:
        return frame.path.endswith(self.path) and frame.function in self.functions


def _rule(path: str, functions: str, phase: str | None, operation: str, source: str) -> Rule:
    return Rule(path, frozenset(functions.split()), phase, operation, source)


OPT, GRAD, SAVE, LOAD, SETUP = ("optimizer step", "gradient communication", "checkpoint save",
                                "loading", "setup")
_ZERO12 = "deepspeed/runtime/zero/stage_1_and_2.py"
_ZERO3 = "deepspeed/runtime/zero/stage3.py"
_ENGINE = "deepspeed/runtime/engine.py"

RULES: tuple[Rule, ...] = (
    # --- the optimizer step ---------------------------------------------------------------
    _rule("torch/optim/adamw.py", "_multi_tensor_adamw", OPT,
          "the foreach (multi-tensor) AdamW update: its intermediate lists (torch._foreach_sqrt "
          "of exp_avg_sq, then the denominator), each tensor the size of its parameter in fp32",
          "torch/optim/adamw.py _multi_tensor_adamw (torch up to 2.5; from 2.6 AdamW runs "
          "adam.py's)"),
    _rule("torch/optim/adam.py", "_multi_tensor_adam", OPT,
          "the foreach (multi-tensor) Adam update: its intermediate lists (torch._foreach_sqrt "
          "of exp_avg_sq, then the denominator), each tensor the size of its parameter in fp32",
          "torch/optim/adam.py _multi_tensor_adam"),
    _rule("torch/optim/adamw.py", "_single_tensor_adamw", OPT,
          "the for-loop AdamW update (one parameter's temporaries at a time)",
          "torch/optim/adamw.py _single_tensor_adamw (torch up to 2.5)"),
    _rule("torch/optim/adam.py", "_single_tensor_adam", OPT,
          "the for-loop Adam update (one parameter's temporaries at a time)",
          "torch/optim/adam.py _single_tensor_adam"),
    _rule("torch/optim/adamw.py", "_fused_adamw", OPT, "the fused AdamW kernel",
          "torch/optim/adamw.py _fused_adamw (torch up to 2.5)"),
    _rule("torch/optim/adam.py", "_fused_adam", OPT, "the fused Adam kernel",
          "torch/optim/adam.py _fused_adam"),
    _rule("torch/optim/adamw.py", "_init_group", OPT,
          "the first optimizer step creating AdamW's states (exp_avg, exp_avg_sq: zeros_like "
          "each parameter)", "torch/optim/adamw.py AdamW._init_group (torch up to 2.5)"),
    _rule("torch/optim/adam.py", "_init_group", OPT,
          "the first optimizer step creating Adam's states (exp_avg, exp_avg_sq: zeros_like "
          "each parameter)", "torch/optim/adam.py Adam._init_group"),
    _rule("torch/optim/optimizer.py", "wrapper _use_grad step", OPT, "the optimizer step",
          "torch/optim/optimizer.py Optimizer.profile_hook_step's wrapper and _use_grad"),
    _rule("torch/nn/utils/clip_grad.py", "clip_grad_norm_ _get_total_norm "
          "_clip_grads_with_norm_", OPT,
          "gradient clipping before the step (clip_grad_norm_: a norm per gradient, foreach)",
          "torch/nn/utils/clip_grad.py clip_grad_norm_ and _get_total_norm"),
    _rule("torch/amp/grad_scaler.py", "step unscale_ _unscale_grads_ _maybe_opt_step", OPT,
          "the loss scaler's unscaling and step (GradScaler)",
          "torch/amp/grad_scaler.py GradScaler.step and unscale_"),
    _rule("lightning/pytorch/core/optimizer.py", "step", OPT,
          "the optimizer step (LightningOptimizer; its closure's forward and backward are "
          "deeper frames)", "lightning/pytorch/core/optimizer.py LightningOptimizer.step "
          "(lightning 2.6)"),
    _rule("pytorch_lightning/core/optimizer.py", "step", OPT,
          "the optimizer step (LightningOptimizer)", "pytorch_lightning/core/optimizer.py "
          "LightningOptimizer.step (pytorch_lightning 2.6)"),
    _rule("accelerate/optimizer.py", "step", OPT, "the optimizer step (AcceleratedOptimizer)",
          "accelerate/optimizer.py AcceleratedOptimizer.step"),
    _rule("accelerate/accelerator.py", "clip_grad_norm_", OPT,
          "gradient clipping before the step (Accelerator.clip_grad_norm_)",
          "accelerate/accelerator.py Accelerator.clip_grad_norm_"),
    _rule("torch/cuda/amp/grad_scaler.py", "step unscale_ _unscale_grads_ _maybe_opt_step", OPT,
          "the loss scaler's unscaling and step (GradScaler)",
          "torch/cuda/amp/grad_scaler.py GradScaler.step (torch before 2.3)"),
    _rule("torch/optim/sgd.py", "_multi_tensor_sgd _single_tensor_sgd _fused_sgd", OPT,
          "the SGD update (its momentum buffers made on the first step)",
          "torch/optim/sgd.py _multi_tensor_sgd"),
    _rule("deepspeed/ops/adam/fused_adam.py", "step", OPT, "DeepSpeed's FusedAdam step",
          "deepspeed/ops/adam/fused_adam.py FusedAdam.step"),
    _rule("deepspeed/ops/adam/cpu_adam.py", "step step_subgroup", OPT,
          "DeepSpeedCPUAdam's step (the gradients copied to the host, the weights back)",
          "deepspeed/ops/adam/cpu_adam.py DeepSpeedCPUAdam.step"),
    _rule("deepspeed/runtime/bf16_optimizer.py", "step", OPT,
          "DeepSpeed's BF16_Optimizer step (its fp32 flat partition)",
          "deepspeed/runtime/bf16_optimizer.py BF16_Optimizer.step"),
    _rule("deepspeed/runtime/fp16/fused_optimizer.py", "step step_fused_adam", OPT,
          "DeepSpeed's FP16_Optimizer step (its fp32 flat groups)",
          "deepspeed/runtime/fp16/fused_optimizer.py FP16_Optimizer.step"),
    _rule("bitsandbytes/optim/optimizer.py", "step init_state update_step", OPT,
          "the bitsandbytes optimizer step (its states created on the first)",
          "bitsandbytes/optim/optimizer.py Optimizer8bit.step and init_state"),
    _rule(_ZERO12, "step _optimizer_step get_flat_partition scaled_global_norm "
          "get_grad_norm_direct unscale_and_clip_grads complete_grad_norm_calculation_for_cpu"
          "_offload", OPT,
          "DeepSpeed ZeRO-1/2's optimizer step on this rank's flat fp32 partition (the "
          "optimizer sees one flat tensor per parameter group, so a foreach temporary is the "
          "whole partition)",
          "deepspeed/runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.step and "
          "_optimizer_step (deepspeed 0.19.8)"),
    _rule(_ZERO3, "step _optimizer_step _prepare_fp32_grad_for_sub_group _prepare_sub_group "
          "unscale_and_clip_grads _pre_step _post_step", OPT,
          "DeepSpeed ZeRO-3's optimizer step on one fp32 sub-group (sub_group_size elements)",
          "deepspeed/runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3.step and "
          "_optimizer_step (deepspeed 0.19.8)"),
    _rule(_ENGINE, "step _take_model_step", OPT, "the DeepSpeed engine's optimizer step",
          "deepspeed/runtime/engine.py DeepSpeedEngine.step and _take_model_step"),
    _rule("megatron/core/optimizer/optimizer.py", "step step_with_ready_grads prepare_grads",
          OPT, "Megatron's optimizer step",
          "megatron/core/optimizer/optimizer.py MixedPrecisionOptimizer.step"),
    _rule("megatron/core/optimizer/distrib_optimizer.py", "step_with_ready_grads", OPT,
          "Megatron's distributed optimizer step",
          "megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer"),
    # --- gradient communication -----------------------------------------------------------
    _rule(_ZERO12, "reduce_ipg_grads average_tensor allreduce_bucket allreduce_and_copy "
          "allreduce_and_copy_with_multiple_ranks allreduce_and_scatter allreduce_no_retain "
          "buffered_reduce_fallback gradient_reduction_w_predivide "
          "reduce_independent_p_g_buckets_and_remove_grads reduce_ready_partitions_and_remove"
          "_grads overlapping_partition_gradients_reduce_epilogue reduce_gradients "
          "independent_gradient_partition_epilogue copy_grads_in_partition "
          "async_accumulate_grad_in_cpu_via_gpu", GRAD,
          "DeepSpeed ZeRO-1/2's gradient reduction: the reduce bucket (reduce_bucket_size "
          "elements, two with overlap_comm) and the gradient partition it fills",
          "deepspeed/runtime/zero/stage_1_and_2.py reduce_ipg_grads and average_tensor "
          "(deepspeed 0.19.8)"),
    _rule(_ZERO3, "reduce_ipg_grads __reduce_and_partition_ipg_grads __avg_scatter_grads "
          "__avg_scatter_contiguous_grads partition_grads reduce_ready_partitions_and_remove"
          "_grads reduce_independent_p_g_buckets_and_remove_grads "
          "independent_gradient_partition_epilogue", GRAD,
          "DeepSpeed ZeRO-3's gradient reduce-scatter (the reduce bucket, reduce_bucket_size "
          "elements)", "deepspeed/runtime/zero/stage3.py __reduce_and_partition_ipg_grads "
          "(deepspeed 0.19.8)"),
    _rule("deepspeed/runtime/comm/coalesced_collectives.py", "reduce_scatter_coalesced "
          "all_to_all_quant_reduce", GRAD, "DeepSpeed's coalesced gradient reduce-scatter",
          "deepspeed/runtime/comm/coalesced_collectives.py reduce_scatter_coalesced"),
    _rule(_ENGINE, "allreduce_gradients buffered_allreduce_fallback allreduce_bucket "
          "allreduce_and_copy allreduce_no_retain", GRAD,
          "the DeepSpeed engine's gradient all-reduce (no ZeRO: allreduce_bucket_size buckets)",
          "deepspeed/runtime/engine.py allreduce_gradients (deepspeed 0.19.8)"),
    _rule("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_reduce "
          "foreach_reduce_scatter_copy_in", GRAD,
          "FSDP2's gradient reduce-scatter (its input: the unsharded gradients in the reduce "
          "dtype)", "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce"),
    _rule("torch/distributed/fsdp/_runtime_utils.py", "_post_backward_hook _reduce_grad", GRAD,
          "FSDP1's gradient reduce-scatter",
          "torch/distributed/fsdp/_runtime_utils.py _post_backward_hook and _reduce_grad"),
    _rule("megatron/core/distributed/param_and_grad_buffer.py", "start_grad_sync "
          "finish_grad_sync", GRAD, "Megatron's gradient reduce-scatter or all-reduce",
          "megatron/core/distributed/param_and_grad_buffer.py start_grad_sync"),
    # --- collectives: their phase comes from the frames around them -------------------------
    _rule("torch/distributed/distributed_c10d.py", "all_reduce all_reduce_coalesced", None,
          "an all-reduce", "torch/distributed/distributed_c10d.py all_reduce"),
    _rule("torch/distributed/distributed_c10d.py", "reduce_scatter_tensor _reduce_scatter_base "
          "reduce_scatter", None, "a reduce-scatter",
          "torch/distributed/distributed_c10d.py reduce_scatter_tensor"),
    _rule("torch/distributed/distributed_c10d.py", "all_gather_into_tensor _all_gather_base "
          "all_gather", None, "an all-gather",
          "torch/distributed/distributed_c10d.py all_gather_into_tensor"),
    _rule("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_all_gather "
          "foreach_all_gather_copy_out", None,
          "FSDP2 unsharding a layer's parameters (the all-gather output: the layer's full "
          "parameters)", "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py "
          "foreach_all_gather"),
    _rule("torch/distributed/fsdp/_flat_param.py", "unshard _alloc_padded_unsharded_flat_param "
          "_all_gather_flat_param", None, "FSDP1 unsharding a flat parameter (all-gather)",
          "torch/distributed/fsdp/_flat_param.py FlatParamHandle.unshard"),
    _rule("deepspeed/runtime/zero/partitioned_param_coordinator.py", "fetch_sub_module "
          "_fetch_sub_module_impl __all_gather_params __all_gather_params_", None,
          "DeepSpeed ZeRO-3 gathering a module's parameters (all-gather)",
          "deepspeed/runtime/zero/partitioned_param_coordinator.py fetch_sub_module"),
    _rule("deepspeed/runtime/zero/partition_parameters.py", "all_gather_coalesced _all_gather "
          "_allgather_param _allgather_params_coalesced", None,
          "DeepSpeed ZeRO-3 gathering parameters (all-gather)",
          "deepspeed/runtime/zero/partition_parameters.py _allgather_params_coalesced"),
    # --- checkpoint save (before setup: a state_dict hook may unshard) -----------------------
    _rule("torch/serialization.py", "save _save", SAVE, "torch.save",
          "torch/serialization.py save"),
    _rule("torch/nn/modules/module.py", "state_dict", SAVE,
          "taking a state_dict (its hooks gather sharded weights)",
          "torch/nn/modules/module.py Module.state_dict"),
    _rule("torch/distributed/fsdp/_state_dict_utils.py", "_pre_state_dict_hook "
          "_full_pre_state_dict_hook _post_state_dict_hook _full_post_state_dict_hook "
          "_common_unshard_pre_state_dict_hook", SAVE,
          "FSDP gathering a full state dict (unsharded weights on every rank unless "
          "offload_to_cpu / rank0_only)",
          "torch/distributed/fsdp/_state_dict_utils.py _full_pre_state_dict_hook"),
    _rule("torch/distributed/fsdp/fully_sharded_data_parallel.py", "full_optim_state_dict "
          "optim_state_dict", SAVE, "FSDP gathering the full optimizer state dict",
          "torch/distributed/fsdp/fully_sharded_data_parallel.py optim_state_dict"),
    _rule("torch/distributed/checkpoint/state_dict_saver.py", "save _save_state_dict "
          "async_save", SAVE, "torch.distributed.checkpoint's save",
          "torch/distributed/checkpoint/state_dict_saver.py save"),
    _rule("torch/distributed/checkpoint/state_dict.py", "get_state_dict get_model_state_dict "
          "get_optimizer_state_dict", SAVE, "torch.distributed.checkpoint gathering a state dict",
          "torch/distributed/checkpoint/state_dict.py get_state_dict"),
    _rule("transformers/trainer.py", "_save_checkpoint save_model _save "
          "_save_optimizer_and_scheduler", SAVE, "the Trainer saving a checkpoint",
          "transformers/trainer.py Trainer._save_checkpoint"),
    _rule("transformers/modeling_utils.py", "save_pretrained", SAVE, "save_pretrained",
          "transformers/modeling_utils.py PreTrainedModel.save_pretrained"),
    _rule(_ENGINE, "save_checkpoint _save_checkpoint _save_zero_checkpoint save_16bit_model "
          "save_fp16_model _zero3_consolidated_16bit_state_dict", SAVE,
          "DeepSpeed saving a checkpoint (save_16bit_model gathers ZeRO-3's weights)",
          "deepspeed/runtime/engine.py save_checkpoint and save_16bit_model"),
    _rule("lightning/pytorch/strategies/strategy.py", "save_checkpoint", SAVE,
          "Lightning saving a checkpoint", "lightning/pytorch/strategies/strategy.py "
          "Strategy.save_checkpoint (lightning 2.6)"),
    _rule("pytorch_lightning/strategies/strategy.py", "save_checkpoint", SAVE,
          "Lightning saving a checkpoint", "pytorch_lightning/strategies/strategy.py "
          "Strategy.save_checkpoint (pytorch_lightning 2.6)"),
    _rule("accelerate/accelerator.py", "save_state get_state_dict save_model", SAVE,
          "Accelerate saving a checkpoint", "accelerate/accelerator.py save_state"),
    _rule("safetensors/torch.py", "save_file save", SAVE, "safetensors' save",
          "safetensors/torch.py save_file"),
    # --- loading ------------------------------------------------------------------------------
    _rule("transformers/modeling_utils.py", "_load_state_dict_into_meta_model load_state_dict "
          "_load_parameter_into_model _move_missing_keys_from_meta_to_device load_shard_file "
          "_load_pretrained_model from_pretrained", LOAD,
          "from_pretrained loading the weights onto the GPU",
          "transformers/modeling_utils.py from_pretrained, _load_pretrained_model and "
          "_load_state_dict_into_meta_model (4.x) / _load_parameter_into_model (5.x)"),
    _rule("transformers/models/auto/auto_factory.py", "from_pretrained", LOAD,
          "from_pretrained loading the weights",
          "transformers/models/auto/auto_factory.py from_pretrained"),
    _rule("accelerate/utils/modeling.py", "set_module_tensor_to_device load_checkpoint_in_model",
          LOAD, "accelerate placing a loaded weight on its device",
          "accelerate/utils/modeling.py set_module_tensor_to_device"),
    _rule("accelerate/big_modeling.py", "dispatch_model load_checkpoint_and_dispatch", LOAD,
          "accelerate dispatching the model to its devices",
          "accelerate/big_modeling.py dispatch_model"),
    _rule("torch/serialization.py", "load", LOAD, "torch.load (a checkpoint loaded)",
          "torch/serialization.py load"),
    _rule("safetensors/torch.py", "load_file load", LOAD, "safetensors' load",
          "safetensors/torch.py load_file"),
    _rule("transformers/trainer.py", "_load_from_checkpoint _load_optimizer_and_scheduler", LOAD,
          "the Trainer resuming from a checkpoint", "transformers/trainer.py "
          "Trainer._load_from_checkpoint"),
    _rule(_ENGINE, "load_checkpoint _load_checkpoint _load_zero_checkpoint", LOAD,
          "DeepSpeed loading a checkpoint", "deepspeed/runtime/engine.py load_checkpoint"),
    _rule("accelerate/accelerator.py", "load_state", LOAD, "Accelerate loading a checkpoint",
          "accelerate/accelerator.py load_state"),
    _rule("torch/nn/modules/module.py", "to cuda _apply", LOAD,
          "moving the model to the GPU (Module.to / .cuda)",
          "torch/nn/modules/module.py Module.to and _apply"),
    # --- setup --------------------------------------------------------------------------------
    _rule(_ZERO12, "__init__ initialize_optimizer_states _create_param_mapping "
          "initialize_gradient_partitioning_data_structures", SETUP,
          "DeepSpeed ZeRO-1/2 setting up: the flat fp32 partition and the optimizer states "
          "(initialize_optimizer_states)",
          "deepspeed/runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__ and "
          "initialize_optimizer_states"),
    _rule(_ZERO3, "__init__ _create_fp32_partitions _setup_for_real_optimizer "
          "initialize_optimizer_states _create_fp16_partitions_with_defragmentation", SETUP,
          "DeepSpeed ZeRO-3 setting up its fp32 partitions and optimizer states",
          "deepspeed/runtime/zero/stage3.py _create_fp32_partitions"),
    _rule(_ENGINE, "__init__ _configure_optimizer _configure_zero_optimizer "
          "_configure_distributed_model _configure_basic_optimizer", SETUP,
          "deepspeed.initialize (the model moved to the GPU, the optimizer built)",
          "deepspeed/runtime/engine.py DeepSpeedEngine._configure_optimizer"),
    _rule("deepspeed/__init__.py", "initialize", SETUP, "deepspeed.initialize",
          "deepspeed/__init__.py initialize"),
    _rule("accelerate/accelerator.py", "prepare prepare_model _prepare_deepspeed "
          "_prepare_fsdp2", SETUP, "accelerator.prepare (the model placed and wrapped)",
          "accelerate/accelerator.py Accelerator.prepare_model"),
    _rule("torch/distributed/fsdp/fully_sharded_data_parallel.py", "__init__", SETUP,
          "wrapping the model in FSDP", "torch/distributed/fsdp/fully_sharded_data_parallel.py "
          "FullyShardedDataParallel.__init__"),
    _rule("torch/nn/parallel/distributed.py", "__init__", SETUP,
          "wrapping the model in DDP (its gradient buckets, the parameters broadcast)",
          "torch/nn/parallel/distributed.py DistributedDataParallel.__init__"),
    # --- generation and evaluation (a forward inside them is theirs) -------------------------
    _rule("transformers/generation/utils.py", "generate _sample _beam_search", "generation",
          "generate (inference inside the job: its KV cache and logits)",
          "transformers/generation/utils.py GenerationMixin.generate"),
    _rule("transformers/trainer.py", "evaluate evaluation_loop prediction_step", "evaluation",
          "the Trainer's evaluation loop", "transformers/trainer.py Trainer.evaluation_loop"),
    # --- backward -----------------------------------------------------------------------------
    _rule("lightning/pytorch/loops/optimization/automatic.py", "backward_fn", "backward",
          "the backward pass (Lightning's closure)",
          "lightning/pytorch/loops/optimization/automatic.py backward_fn (lightning 2.6)"),
    _rule("lightning/pytorch/strategies/strategy.py", "backward", "backward",
          "the backward pass (Lightning)", "lightning/pytorch/strategies/strategy.py "
          "Strategy.backward (lightning 2.6)"),
    _rule("pytorch_lightning/strategies/strategy.py", "backward", "backward",
          "the backward pass (Lightning)", "pytorch_lightning/strategies/strategy.py "
          "Strategy.backward (pytorch_lightning 2.6)"),
    _rule("torch/utils/checkpoint.py", "unpack_hook recompute_fn backward", "backward",
          "recomputing a checkpointed forward (activation checkpointing)",
          "torch/utils/checkpoint.py unpack_hook (non-reentrant) and CheckpointFunction.backward"),
    _rule("torch/autograd/graph.py", "_engine_run_backward", "backward", "the backward pass",
          "torch/autograd/graph.py _engine_run_backward"),
    _rule("torch/autograd/__init__.py", "backward grad", "backward", "the backward pass",
          "torch/autograd/__init__.py backward"),
    _rule("torch/_tensor.py", "backward", "backward", "the backward pass",
          "torch/_tensor.py Tensor.backward"),
    _rule("accelerate/accelerator.py", "backward", "backward", "the backward pass",
          "accelerate/accelerator.py Accelerator.backward"),
    _rule(_ENGINE, "backward", "backward", "the backward pass (DeepSpeed engine)",
          "deepspeed/runtime/engine.py DeepSpeedEngine.backward"),
    _rule("megatron/core/pipeline_parallel/schedules.py", "backward_step", "backward",
          "the backward pass", "megatron/core/pipeline_parallel/schedules.py backward_step"),
    # --- forward ------------------------------------------------------------------------------
    _rule("lightning/pytorch/strategies/strategy.py", "training_step", "forward",
          "the training step's forward (Lightning)", "lightning/pytorch/strategies/strategy.py "
          "Strategy.training_step (lightning 2.6)"),
    _rule("pytorch_lightning/strategies/strategy.py", "training_step", "forward",
          "the training step's forward (Lightning)", "pytorch_lightning/strategies/strategy.py "
          "Strategy.training_step (pytorch_lightning 2.6)"),
    _rule("transformers/loss/loss_utils.py", "ForCausalLMLoss fixed_cross_entropy", "forward",
          "the loss: cross-entropy over the logits (fp32 upcast)",
          "transformers/loss/loss_utils.py ForCausalLMLoss"),
    _rule("torch/nn/functional.py", "cross_entropy", "forward",
          "the loss: cross-entropy over the logits", "torch/nn/functional.py cross_entropy"),
    _rule("torch/nn/modules/module.py", "_call_impl _wrapped_call_impl __call__", "forward",
          "a module's forward", "torch/nn/modules/module.py Module._call_impl"),
    _rule(_ENGINE, "forward", "forward", "the forward pass (DeepSpeed engine)",
          "deepspeed/runtime/engine.py DeepSpeedEngine.forward"),
    _rule("torch/nn/parallel/distributed.py", "forward", "forward", "DDP's forward",
          "torch/nn/parallel/distributed.py DistributedDataParallel.forward"),
    _rule("transformers/trainer.py", "compute_loss", "forward", "the Trainer's forward and loss",
          "transformers/trainer.py Trainer.compute_loss"),
    _rule("megatron/core/pipeline_parallel/schedules.py", "forward_step", "forward",
          "the forward pass", "megatron/core/pipeline_parallel/schedules.py forward_step"),
)

# phases that a forward found deeper belongs to (a recomputation, a generation, an evaluation)
_CONTEXTS = ("backward", "generation", "evaluation")


@dataclass(frozen=True)
class DiedIn:
    """Where the traceback says the job died."""

    phase: str  # one of PHASES, or COMMUNICATION
    operation: str  # in words
    frame: str  # "path:line in function" of the frame the operation was read from
    source: str  # the rule's framework file and function
    innermost: str  # the innermost frame of the traceback, "path:line in function"
    rank: int | None = None  # the launcher prefix of the frames read


def _show(f: Frame) -> str:
    """The frame with its path from the installed package's root (after site-packages/)."""
    cut = max(f.path.rfind("site-packages/"), f.path.rfind("dist-packages/"))
    short = f.path[f.path.index("-packages/", cut) + len("-packages/"):] if cut >= 0 else f.path
    return f"{short}:{f.line} in {f.function}" if f.line is not None else \
        f"{short} in {f.function}"


def phase_of_frames(frames: Sequence[Frame]) -> DiedIn | None:
    """The phase and operation of ``frames``, innermost first; None when no rule knows any."""
    operation: tuple[Rule, Frame] | None = None
    phase: str | None = None
    for i, f in enumerate(frames):
        rule = next((r for r in RULES if r.matches(f)), None)
        if rule is None:
            continue
        if operation is None:
            operation = (rule, f)
        if rule.phase is None:
            continue
        phase = rule.phase
        if phase == "forward":  # a forward under a backward, a generation, an evaluation
            outer = next((r for g in frames[i + 1:] for r in RULES
                          if r.matches(g) and r.phase in _CONTEXTS), None)
            if outer is not None:
                phase = outer.phase
                if outer.phase == "backward" and operation[0].phase in ("forward", None):
                    operation = (_RECOMPUTE, f) if operation[0].phase == "forward" else operation
        break
    if operation is None:
        return None
    rule, at = operation
    return DiedIn(phase or COMMUNICATION, rule.operation, _show(at), rule.source,
                  _show(frames[0]) if frames else "")


_RECOMPUTE = Rule("", frozenset(), "backward",
                  "recomputing a checkpointed forward (a module's forward inside the backward)",
                  "torch/utils/checkpoint.py (activation checkpointing) under "
                  "torch/autograd/graph.py _engine_run_backward")

# Python: File "PATH", line N, in FUNC; IPython: File PATH:N, in Class.FUNC(args);
# rich: PATH:N in FUNC (the function on the next line when the path is long)
_PY = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d{1,9}), in (?P<func>[\w.<>]+)')
_IPY = re.compile(r"File (?P<path>[^\s\"]+\.py):(?P<line>\d{1,9}), in (?P<func>[\w.<>]+)")
_RICH = re.compile(r"(?P<path>[^\s│]+\.py):(?P<line>\d{1,9}) in(?: (?P<func>[\w.<>]+))?")
# a frame's line is short: longer lines (a progress bar, a dump) are not searched for one
_MAX_LINE = 2000
_PREFIX = re.compile(r"^\s*\[(?:default)?rank(\d+)\]:\s?|^\s*(\d+):\s")
_NEW_BLOCK = re.compile(r"Traceback \(most recent call last\)|During handling of the above "
                        r"exception|The above exception was the direct cause")


def _frame(path: str, line: str, func: str) -> Frame:
    return Frame(path.replace("\\", "/"), func.rsplit(".", 1)[-1], int(line))


def traceback_blocks(text: str) -> list[tuple[int | None, list[Frame]]]:
    """Each traceback in ``text`` as (rank of its prefix, frames outermost first)."""
    blocks: dict[int | None, list[list[Frame]]] = {}
    pending: dict[int | None, tuple[str, str]] = {}  # rich: a path whose function is next
    order: list[tuple[int | None, list[Frame]]] = []
    for raw in text.splitlines():
        m = _PREFIX.match(raw)
        rank = int(m.group(1) or m.group(2)) if m else None
        line = raw[m.end():] if m else raw
        stack = blocks.setdefault(rank, [])
        if _NEW_BLOCK.search(line) or not stack:
            if not stack or stack[-1]:
                stack.append([])
                order.append((rank, stack[-1]))
            if _NEW_BLOCK.search(line):
                continue
        if rank in pending:
            path, num = pending.pop(rank)
            func = line.strip(" │|").split()
            if func and re.fullmatch(r"[\w.<>]+", func[0]):
                stack[-1].append(_frame(path, num, func[0]))
            continue
        if len(line) > _MAX_LINE or ".py" not in line:
            continue
        found = _PY.search(line) or _IPY.search(line) or _RICH.search(line)
        if found is None:
            continue
        if found.re is _RICH and found.group("func") is None:
            pending[rank] = (found.group("path"), found.group("line"))
            continue
        stack[-1].append(_frame(found.group("path"), found.group("line"), found.group("func")))
    return [(rank, frames) for rank, frames in order if frames]


def died_in(text: str, rank: int | None = None) -> DiedIn | None:
    """Where the traceback in ``text`` says the job died: of the rank ``rank`` when its lines
    carry that prefix, else of the first traceback whose frames a rule knows. None when the
    text holds no traceback, or none of its frames is known."""
    blocks = traceback_blocks(text)
    mine = [b for b in blocks if b[0] == rank] if rank is not None else []
    for block_rank, frames in (mine or blocks):
        found = phase_of_frames(list(reversed(frames)))
        if found is not None:
            return DiedIn(found.phase, found.operation, found.frame, found.source,
                          found.innermost, block_rank)
    return None


def frames_of(entries: Iterable[dict]) -> list[Frame]:
    """A snapshot's frames (dicts of "filename", "line", "name"), innermost first."""
    out = []
    for f in entries:
        if isinstance(f, dict) and isinstance(f.get("filename"), str):
            line = f.get("line")
            out.append(Frame(f["filename"].replace("\\", "/"), str(f.get("name", "")),
                             line if isinstance(line, int) else None))
    return out


__all__ = ["COMMUNICATION", "PHASES", "RULES", "DiedIn", "Frame", "died_in", "frames_of",
           "phase_of_frames", "traceback_blocks"]
