"""A DeepSpeed config (``--deepspeed-config ds_config.json``) as memplan's inputs.

The keys and defaults are DeepSpeed 0.19.8's (``deepspeed/runtime/config.py``,
``deepspeed/runtime/zero/config.py`` DeepSpeedZeroConfig); each key becomes the memplan input
that holds what the key holds (``memplan.model.deepspeed_zero``, ``docs/deepspeed.md``). The
job runs with memplan's DeepSpeed preset (``--framework deepspeed``).

``"auto"`` is the transformers Trainer's placeholder (transformers/integrations/deepspeed.py
HfTrainerDeepSpeedConfig): ``trainer_config_finalize`` fills ``reduce_bucket_size`` with
hidden x hidden, ``stage3_prefetch_bucket_size`` with int(0.9 x hidden x hidden) and
``stage3_param_persistence_threshold`` with 10 x hidden (the model's ``hidden_size``);
``trainer_config_process`` fills the batch, accumulation and precision keys from the
TrainingArguments, which are the command line's options here. The mapping says which.
A key memplan does not model is refused by name; keys that hold no device memory (learning
rates, schedulers, logging) are read and left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memplan.config_import.imported import Imported
from memplan.inputs import MODEL_FILE_BYTES, read_json
from memplan.model.deepspeed_zero import REDUCE_BUCKET_SIZE, bucket_buffers
from memplan.spec import ModelSpec

_SRC = "deepspeed 0.19.8"
_HF = "transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig"
# top-level keys that hold no device memory memplan counts (deepspeed/runtime/config.py)
QUIET = frozenset({
    "train_batch_size", "gradient_accumulation_steps", "gradient_clipping", "steps_per_print",
    "wall_clock_breakdown", "scheduler", "prescale_gradients", "gradient_predivide_factor",
    "zero_allow_untested_optimizer", "dump_state", "memory_breakdown", "tensorboard", "wandb",
    "csv_monitor", "comet", "flops_profiler", "comms_logger", "checkpoint", "logging",
    "timers", "seed", "dataloader_drop_last", "sparse_gradients", "zero_force_ds_cpu_optimizer",
})
# zero_optimization keys that hold nothing at stage 2 (stage_1_and_2.py / stage3.py)
ZERO_QUIET = frozenset({
    "reduce_scatter",  # average_tensor reduces the same bucket either way
    "allgather_partitions", "round_robin_gradients", "ignore_unused_parameters",
    "load_from_fp32_weights", "elastic_checkpoint", "use_multi_rank_bucket_allreduce",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "memory_efficient_linear", "compute_grad_norm",
    "log_trace_cache_warnings", "cpu_offload_use_pin_memory",
})
# read by stage 3 only (DeepSpeedZeroOptimizer_Stage3 / DeepSpeedZeRoOffload)
STAGE3_ONLY = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
               "stage3_max_live_parameters", "stage3_max_reuse_distance",
               "stage3_model_persistence_threshold", "sub_group_size", "zero_hpz_partition_size",
               "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
               "stage3_allgather_sequential", "offload_param")
# zero_optimization keys whose true value changes what the rank holds, not modelled
ZERO_REFUSED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                "zero_quantized_gradients", "mics_shard_size", "zenflow", "cpu_offload",
                "cpu_offload_params", "pipeline_loading_checkpoint", "override_module_apply")


def read(path: str | Path, gpus: int, model: str | ModelSpec | None) -> Imported:
    """The inputs of the DeepSpeed config at ``path`` on ``gpus`` GPUs; ``model`` (the
    command line's ``--model``, a config names none) gives the hidden size "auto" reads."""
    data = read_json(path, "deepspeed config", MODEL_FILE_BYTES)
    imp = Imported(source=f"deepspeed config {path}", model=model)
    if not isinstance(data, dict):
        raise imp.refuse("(top level)", data, "expected a JSON object")
    imp.set("(deepspeed config)", str(path), "framework", "deepspeed",
            f"memplan's DeepSpeed preset ({_SRC})")
    hidden = _hidden(model)
    for key, value in data.items():
        if key == "zero_optimization":
            _zero(imp, _table(imp, key, value), hidden)
        elif key in ("bf16", "bfloat16", "fp16"):
            _precision(imp, key, _table(imp, key, value))
        elif key == "optimizer":
            _optimizer(imp, _table(imp, key, value))
        elif key == "train_micro_batch_size_per_gpu":
            _micro_batch(imp, value)
        elif key == "activation_checkpointing":
            _checkpointing(imp, _table(imp, key, value))
        elif key in ("data_types", "communication_data_type", "amp", "torch_autocast"):
            _dtypes(imp, key, value)
        elif key not in QUIET:
            raise imp.refuse(key, value, "not modelled by memplan's DeepSpeed preset")
    _accumulation(imp, data.get("gradient_accumulation_steps", 1), gpus)
    if "zero_optimization" not in data:
        raise imp.refuse("zero_optimization", None, "absent: stage 0 (no ZeRO) is not "
                         "modelled by memplan's DeepSpeed preset")
    return imp


def _on(value: Any) -> bool:
    """Whether a refused key's value turns its feature on (False, None, an empty table and
    mics_shard_size's -1/0/1 leave it off)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, dict):
        return bool(value)
    return not (type(value) is int and value in (-1, 0, 1))


def _table(imp: Imported, key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise imp.refuse(key, value, "expected an object")
    return value


def _hidden(model: str | ModelSpec | None) -> int | None:
    if model is None:
        return None
    if isinstance(model, ModelSpec):
        return model.hidden_size
    from memplan.spec import load_model

    return load_model(model).hidden_size


def _count(imp: Imported, key: str, value: Any) -> int:
    """An element count as DeepSpeed takes it: an int, or a float such as 5e8 that is whole."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise imp.refuse(key, value, "expected a number of elements")
    if value < 0 or value != int(value) or value > 10**12:
        raise imp.refuse(key, value, "expected a whole number of elements from 0 to 1e12")
    return int(value)


def _flag(imp: Imported, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise imp.refuse(key, value, "expected true or false")
    return value


def _auto_hidden(imp: Imported, key: str, hidden: int | None, factor: float) -> int:
    """An "auto" filled from the model's hidden size as the Trainer fills it."""
    if hidden is None:
        raise imp.refuse(key, "auto", "needs the model's hidden size: give --model")
    return int(factor * hidden * hidden) if factor != 10 else 10 * hidden


def _zero(imp: Imported, zero: dict[str, Any], hidden: int | None) -> None:
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise imp.refuse("zero_optimization.stage", stage, "expected 0, 1, 2 or 3")
    if stage == 0:
        raise imp.refuse("zero_optimization.stage", stage,
                         "memplan models DeepSpeed's ZeRO stages 1, 2 and 3 (stage 0's bf16 "
                         "optimizer is not modelled yet)")
    if stage == 3:
        _stage3(imp, zero, hidden)
        return
    imp.set("zero_optimization.stage", stage, "zero", stage,
            "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer(partition_grads="
            + ("True): fp32 partition, states and gradient partition 1/N, bf16/fp16 weights "
               "whole" if stage == 2 else
               "False): fp32 partition and states 1/N, the gradients whole through backward, "
               "reduced after it (reduce_gradients)"))
    for key, value in zero.items():
        name = f"zero_optimization.{key}"
        if key in ZERO_REFUSED and _on(value):
            raise imp.refuse(name, value, "not modelled by memplan's DeepSpeed preset")
        if key == "offload_optimizer":
            _offload(imp, name, value, stage)
        elif key in STAGE3_ONLY:
            shown_value = value
            if value == "auto" and key in ("stage3_prefetch_bucket_size",
                                           "stage3_param_persistence_threshold"):
                shown_value = _auto_hidden(imp, name, hidden, 0.9 if "prefetch" in key else 10)
            imp.notes.append(f"{name} = {shown_value}: read by ZeRO stage 3 only (stage3.py), "
                             f"holds nothing at stage {stage}")
        elif key not in ZERO_QUIET and key not in ZERO_REFUSED and key not in (
                "stage", "reduce_bucket_size", "contiguous_gradients", "overlap_comm",
                "allgather_bucket_size"):
            raise imp.refuse(name, value, "not modelled by memplan's DeepSpeed preset")
    _buckets(imp, zero, hidden)


# ZeRO-3's parameter coordinator (memplan.model.deepspeed_coordinator): the ds_config's keys,
# the workload fields memplan reads them into, DeepSpeedZeroConfig's defaults
# (runtime/zero/config.py, 0.19.8) and the Trainer's "auto" (hidden x hidden x factor; 10 x
# hidden for the persistence threshold: integrations/deepspeed.py trainer_config_finalize)
_COORDINATOR = {
    "stage3_prefetch_bucket_size": ("zero3_prefetch_numel", 50_000_000, 0.9,
                                    "fetch_sub_module: parameters gathered ahead of the trace"),
    "stage3_max_live_parameters": ("zero3_max_live_numel", 1_000_000_000, None,
                                   "fetch_sub_module: no prefetch beyond this many gathered"),
    "stage3_max_reuse_distance": ("zero3_reuse_distance_numel", 1_000_000_000, None,
                                  "__params_to_release: kept gathered when used again within "
                                  "this many elements of the trace"),
    "stage3_param_persistence_threshold": ("zero3_persistence_numel", 100_000, 10,
                                           "mark_persistent_parameters: parameters this small "
                                           "stay gathered"),
}
_PLAIN_KEYS = ("stage3_prefetch_bucket_size", "stage3_max_reuse_distance",
               "stage3_param_persistence_threshold")
# stage 3 keys that hold nothing memplan counts apart
_STAGE3_QUIET = ("stage3_allgather_sequential", "sub_group_size")


def _offloaded(value: Any) -> bool:
    device = value.get("device", "none") if isinstance(value, dict) else value
    return device not in (None, "none")


def _stage3(imp: Imported, zero: dict[str, Any], hidden: int | None) -> None:
    """ZeRO-3 (``memplan.model.deepspeed_zero.zero3_states``) and its parameter coordinator
    (``memplan.model.deepspeed_coordinator``)."""
    imp.set("zero_optimization.stage", 3, "zero", 3,
            "runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3: bf16/fp16 weights, gradient "
            "partition, fp32 partition and states 1/N; the reduce bucket and the gradient "
            "partition held from the wrap on (_setup_for_real_optimizer)")
    _stage3_offload(imp, zero)
    _coordinator(imp, zero, hidden)
    for key, value in zero.items():
        name = f"zero_optimization.{key}"
        if key in ZERO_REFUSED and _on(value):
            raise imp.refuse(name, value, "not modelled by memplan's DeepSpeed preset")
        if key in _STAGE3_QUIET:
            imp.notes.append(f"{name} = {value}: " + (
                "memplan steps the partition as one sub-group (stage3.py "
                "_create_fp16_sub_groups; with more the step's peak is lower)"
                if key == "sub_group_size" else "each parameter of a prefetch gathered into "
                "its own buffer: not modelled apart (memplan counts a coalesced gather's "
                "flat buffer)"))
        elif key == "stage3_model_persistence_threshold":
            raise imp.refuse(name, value, "a cap on the persistent parameters in all is not "
                             "read (memplan.model.deepspeed_coordinator.persistent takes it; "
                             "the workload does not carry it)")
        elif key == "zero_hpz_partition_size" and value not in (0, 1):
            raise imp.refuse(name, value, "the secondary partition (ds_secondary_tensor) is "
                             "not modelled")
        elif key not in ZERO_QUIET and key not in ZERO_REFUSED and key not in (
                "stage", "reduce_bucket_size", "contiguous_gradients", "overlap_comm",
                "allgather_bucket_size", "offload_param", "offload_optimizer",
                "zero_hpz_partition_size", *_COORDINATOR):
            raise imp.refuse(name, value, "not modelled by memplan's DeepSpeed preset")
    if "overlap_comm" in zero:
        imp.notes.append(f"zero_optimization.overlap_comm = {zero['overlap_comm']}: adds no "
                         "bucket at stage 3 (stage3.py _setup_for_real_optimizer: one per "
                         "communication dtype)")
    _buckets(imp, {k: v for k, v in zero.items() if k != "overlap_comm"}, hidden)


def _stage3_offload(imp: Imported, zero: dict[str, Any]) -> None:
    """ZeRO-3's offload to the CPU (``memplan.model.deepspeed_zero.zero3_offload``):
    ``offload_optimizer`` alone, or with ``offload_param``; NVMe and ``offload_param`` alone
    are refused by name (not traced)."""
    on = {key: zero[key] for key in ("offload_optimizer", "offload_param")
          if _offloaded(zero.get(key))}
    for key, value in on.items():
        device = value.get("device") if isinstance(value, dict) else value
        if device != "cpu":
            raise imp.refuse(f"zero_optimization.{key}", value, "ZeRO-3's offload is modelled "
                             "to the CPU (stage3.py offload_optimizer, parameter_offload.py "
                             "offload_param, traced); not to NVMe (the swappers' buffers)")
    if "offload_param" in on and "offload_optimizer" not in on:
        raise imp.refuse("zero_optimization.offload_param", on["offload_param"],
                         "offload_param without offload_optimizer is not modelled (traced "
                         "with both offloaded, ZeRO-Infinity on the CPU)")
    if not on:
        return
    imp.set("zero_optimization." + "/".join(on), "cpu", "offload",
            "optimizer,params" if "offload_param" in on else "optimizer",
            "stage3.py offload_optimizer: the fp32 partitions, their fp32 gradient, the "
            "gradient partitions (grad_partitions_flat_buffer) and the states on the host, "
            "the step there; on the GPU the reduce bucket and, at each reduce, a device copy "
            "and an fp64 norm copy of a gradient partition (partition_grads)"
            + ("; offload_param: the bf16/fp16 partitions on the host too "
               "(_create_param_groups_fp16_flat_cpu_memory), only gathered weights on the GPU"
               if "offload_param" in on else ""))


def _coordinator(imp: Imported, zero: dict[str, Any], hidden: int | None) -> None:
    """The coordinator's four settings, each as written, "auto" as the Trainer fills it, or
    DeepSpeed's default; all of prefetch, reuse and persistence 0 is the plain coordinator
    (``zero3_plain_gathers``: each module gathered for its own run)."""
    values = {}
    for key, (field, default, auto, what) in _COORDINATOR.items():
        name = f"zero_optimization.{key}"
        value, how = zero.get(key, default), what
        if key not in zero:
            how = f"absent: DeepSpeedZeroConfig's default {default:.0e}; {what}"
        elif value == "auto" and auto is not None:
            value = _auto_hidden(imp, name, hidden, auto)
            how = (f"auto: {'10 x hidden' if auto == 10 else '0.9 x hidden x hidden'} = "
                   f"{value} ({_HF}.trainer_config_finalize); {what}")
        value = _count(imp, name, value)
        values[key] = value
        imp.set(name, zero.get(key, f"{default:.0e}"), field, value,
                f"partitioned_param_coordinator.py {how}")
    if all(values[k] == 0 for k in _PLAIN_KEYS):
        imp.set("zero_optimization." + "/".join(_PLAIN_KEYS), "0/0/0", "zero3_plain_gathers",
                True, "partitioned_param_coordinator.py fetch_sub_module / "
                "release_sub_module: each module's own weights gathered while it runs, "
                "forward and backward, released after it; none prefetched, kept for reuse or "
                "persistent")


def _buckets(imp: Imported, zero: dict[str, Any], hidden: int | None) -> None:
    """reduce_bucket_size, contiguous_gradients, overlap_comm: the preallocated buckets."""
    size = zero.get("reduce_bucket_size", REDUCE_BUCKET_SIZE)
    how = f"stage_1_and_2.py setup_buckets: torch.empty(reduce_bucket_size) ({_SRC})"
    if size == "auto":
        size = _auto_hidden(imp, "zero_optimization.reduce_bucket_size", hidden, 1)
        how = f"auto: hidden x hidden = {hidden} x {hidden} ({_HF}.trainer_config_finalize)"
    elif "reduce_bucket_size" not in zero:
        how = "absent: DeepSpeedZeroConfig's default 5e8; " + how
    size = _count(imp, "zero_optimization.reduce_bucket_size", size)
    if size == 0:
        raise imp.refuse("zero_optimization.reduce_bucket_size", 0, "must be more than 0 "
                         "(DeepSpeedZeroConfig: gt=0)")
    contiguous = _flag(imp, "zero_optimization.contiguous_gradients",
                       zero.get("contiguous_gradients", True))
    overlap = _flag(imp, "zero_optimization.overlap_comm", zero.get("overlap_comm", False))
    if not contiguous:
        raise imp.refuse("zero_optimization.contiguous_gradients", False,
                         "gradients reduced from param.grad through flattened copies "
                         "(stage_1_and_2.py buffered_reduce_fallback) are not modelled")
    imp.set("zero_optimization.reduce_bucket_size", zero.get("reduce_bucket_size", "5e8"),
            "zero_bucket_numel", size, how)
    buffers = bucket_buffers(contiguous, overlap)
    imp.set("zero_optimization.contiguous_gradients/overlap_comm",
            f"{str(contiguous).lower()}/{str(overlap).lower()}", "zero_bucket_buffers", buffers,
            "reduce buckets a backward allocates: none without contiguous_gradients, a second "
            "with overlap_comm (setup_buckets buf_1); overlap_comm absent is false below "
            "stage 3 (config.py overlap_comm_valid)")
    if "allgather_bucket_size" in zero:
        imp.notes.append(f"zero_optimization.allgather_bucket_size = "
                         f"{zero['allgather_bucket_size']}: holds nothing "
                         "(runtime/utils.py all_gather_dp_groups gathers in place with "
                         "all_gather_into_tensor where the backend has it, as NCCL does)")


def _offload(imp: Imported, key: str, value: Any, stage: int = 2) -> None:
    device = value.get("device", "none") if isinstance(value, dict) else value
    if device in (None, "none"):
        return
    if device != "cpu" or stage not in (1, 2):
        raise imp.refuse(key, value, "ZeRO-Offload is modelled at stages 1 and 2 to the CPU "
                         "(stage_1_and_2.py cpu_offload, traced); not to NVMe")
    imp.set(key, device, "offload", "optimizer",
            "stage_1_and_2.py cpu_offload: the fp32 partition, its gradient, a bf16/fp16 copy "
            "and the states on the host (pinned unless pin_memory is false), the step there "
            "(DeepSpeedCPUAdam); on the GPU the weights, the reduce bucket, "
            "temp_grad_buffer_for_gpu_offload (the largest parameter) and per reduce an fp64 "
            "copy of a gradient slice (set_norm_for_param_grad_in_gpu)")


def _precision(imp: Imported, key: str, table: dict[str, Any]) -> None:
    enabled = table.get("enabled", False)
    if enabled == "auto":
        imp.notes.append(f"{key}.enabled = auto: the Trainer's --{'fp16' if key == 'fp16' else 'bf16'}"
                         f" ({_HF}.trainer_config_process); here --precision decides")
        return
    if not _flag(imp, f"{key}.enabled", enabled):
        return
    value = "fp16-mixed" if key == "fp16" else "bf16-mixed"
    imp.set(f"{key}.enabled", True, "precision", value,
            "bf16/fp16 weights and gradients, an fp32 partition and fp32 states "
            "(stage_1_and_2.py single_partition_of_fp32_groups)")


def _optimizer(imp: Imported, table: dict[str, Any]) -> None:
    kind = table.get("type", "")
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        raise imp.refuse("optimizer.type", kind, "memplan's DeepSpeed preset models Adam and "
                         "AdamW (FusedAdam) only")
    params = table.get("params", {})
    if isinstance(params, dict) and params.get("torch_adam") is True:
        raise imp.refuse("optimizer.params.torch_adam", True, "torch.optim.Adam instead of "
                         "FusedAdam is not modelled by the DeepSpeed preset")
    imp.set("optimizer.type", kind, "optimizer", "adamw",
            "engine.py _configure_basic_optimizer: FusedAdam on the device (exp_avg, exp_avg_sq)")


def _micro_batch(imp: Imported, value: Any) -> None:
    if value == "auto":
        imp.notes.append("train_micro_batch_size_per_gpu = auto: the Trainer's "
                         f"per_device_train_batch_size ({_HF}.trainer_config_process); "
                         "here --mbs decides")
        return
    imp.set("train_micro_batch_size_per_gpu", value, "micro_batch_size",
            _count(imp, "train_micro_batch_size_per_gpu", value))


def _accumulation(imp: Imported, steps: Any, gpus: int) -> None:
    """gradient_accumulation_steps with the micro-batch: the global batch (DeepSpeed's
    train_batch_size = micro-batch x accumulation x data-parallel ranks, runtime/config.py
    _batch_assertion)."""
    if steps == "auto":
        imp.notes.append("gradient_accumulation_steps = auto: the Trainer's "
                         f"gradient_accumulation_steps ({_HF}.trainer_config_process); "
                         "here --gbs decides")
        return
    steps = _count(imp, "gradient_accumulation_steps", steps)
    mbs = imp.inputs.get("micro_batch_size")
    if steps > 1 and mbs is None:
        raise imp.refuse("gradient_accumulation_steps", steps, "needs "
                         "train_micro_batch_size_per_gpu as a number to give the global batch")
    if steps >= 1 and mbs is not None:
        imp.set("gradient_accumulation_steps", steps, "global_batch_size", mbs * steps * gpus,
                f"train_micro_batch_size_per_gpu x {steps} x {gpus} GPUs")


def _checkpointing(imp: Imported, table: dict[str, Any]) -> None:
    on = [k for k, v in table.items() if v is True]
    if on:
        raise imp.refuse(f"activation_checkpointing.{on[0]}", True,
                         "DeepSpeed's activation checkpointing (runtime/activation_checkpointing/"
                         "checkpointing.py) acts only on a model calling deepspeed.checkpointing."
                         "checkpoint; not modelled (use --recompute full for the Trainer's "
                         "gradient_checkpointing)")
    imp.notes.append("activation_checkpointing: no option on; --recompute decides")


def _dtypes(imp: Imported, key: str, value: Any) -> None:
    if key == "data_types":
        table = _table(imp, key, value)
        accum = table.get("grad_accum_dtype")
        if accum not in (None, "bf16", "fp16", "bfloat16", "float16"):
            raise imp.refuse("data_types.grad_accum_dtype", accum,
                             "an fp32 gradient accumulation dtype (stage_1_and_2.py "
                             "_build_compact_grad_partition_buffer, or bf16_optimizer.py at "
                             "stage 1) is not modelled")
        return
    if key in ("amp", "torch_autocast") and not (isinstance(value, dict)
                                                 and not value.get("enabled", False)):
        raise imp.refuse(key, value, "autocast under DeepSpeed is not modelled")
    if key == "communication_data_type" and value is not None:
        raise imp.refuse(key, value, "a communication dtype other than the gradients' "
                         "(average_tensor's tensor.to(communication_data_type) copy) is not "
                         "modelled")
