"""A command line with ``--torchtitan-config``, ``--megatron-args``, ``--deepspeed-config`` or
``--accelerate-config``: the config's inputs in place of the options the command line left unset
(``memplan.config_import.imported.merge``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memplan.errors import MemplanError

if TYPE_CHECKING:
    from memplan.config_import.imported import Imported
    from memplan.spec import ModelSpec

# Workload fields a config sets that no command-line option exposes
_WORKLOAD_ONLY = frozenset({"fused_qkv", "rope_cache", "head_wgrad_deferral", "fsdp_units",
                            "loss_impl", "softmax_fp32", "te_grouped_gemm",
                            "zero_bucket_numel", "zero_bucket_buffers", "forward_prefetch",
                             "zero3_plain_gathers", "te_fp8", "te_fp8_param_gather",
                             "te_fp8_amax_history_len", "te_gemm_workspace",
                             "te_ub_workspace", "zero3_prefetch_numel",
                             "zero3_max_live_numel", "zero3_reuse_distance_numel",
                             "zero3_persistence_numel"})


def configure(model: str | None, given: dict[str, Any], defaults: dict[str, Any], *,
              torchtitan: Any = None, megatron: str | None = None,
              deepspeed: str | None = None, accelerate: str | None = None,
              ) -> tuple[str | ModelSpec, dict[str, Any], Imported | None]:
    """(model, API keyword arguments, the ``Imported`` or None) of a command line (``model``
    and its API keywords ``given``, ``defaults`` what its options give unset) with a job's
    config. Keywords a command does not take (``plan`` searches the micro-batch) are notes.
    ``model`` given replaces the config's (its shape for a model the config does not map)."""
    if sum(c is not None for c in (torchtitan, megatron, deepspeed, accelerate)) > 1:
        raise MemplanError("give one of --torchtitan-config, --megatron-args, "
                           "--deepspeed-config and --accelerate-config")
    if accelerate is not None:
        return _accelerate(model, given, defaults, accelerate)
    if torchtitan is None and megatron is None and deepspeed is None:
        if model is None:
            raise MemplanError("--model is required (or --torchtitan-config / "
                               "--megatron-args)")
        return model, given, None
    # the readers only when a config is given: a plain command line does not compile them
    from memplan.config_import.imported import merge
    from memplan.config_import import megatron as mega
    from memplan.config_import import torchtitan as titan

    gpus = given.get("gpus", 1)
    if deepspeed is not None:
        from memplan.config_import import deepspeed_config

        if model is None:
            raise MemplanError("--deepspeed-config names no model: give --model")
        imported = deepspeed_config.read(deepspeed, gpus, model)
    elif torchtitan is not None:
        imported = titan.read(torchtitan, gpus, model=model)
    else:
        imported = mega.read(megatron, gpus)
    takes = set(given) | {"recompute"}  # plan's --recompute is its own option
    for key in [k for k in imported.inputs if k not in takes and k not in _WORKLOAD_ONLY]:
        imported.notes.append(f"{key} = {imported.inputs.pop(key)}: not an input of this "
                              "command (searched)")
    merged = merge(imported, given, defaults)
    chosen = model if model is not None else imported.model
    if chosen is None:
        raise MemplanError(f"{imported.source}: names no model memplan maps; give --model")
    return chosen, merged, imported


def _accelerate(model: str | None, given: dict[str, Any], defaults: dict[str, Any],
                path: str) -> tuple[str | ModelSpec, dict[str, Any], Imported]:
    """An Accelerate config names no model (the training script loads it): ``--model`` gives
    it; the job runs with the hf preset (the Trainer's and Accelerate's loop) unless
    ``--framework`` says otherwise."""
    from memplan.config_import import accelerate
    from memplan.config_import.imported import merge

    if model is None:
        raise MemplanError(f"accelerate config {path}: names no model (the training script "
                           "loads it); give --model")
    imported = accelerate.read(path, given.get("gpus", 1))
    if given.get("framework") is None:
        imported.set("(the launcher)", "accelerate launch", "framework", "hf",
                     "Accelerate's and the Trainer's loop (memplan.presets)")
    return model, merge(imported, given, defaults), imported
