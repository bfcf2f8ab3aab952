"""An Accelerate config file (``--accelerate-config default_config.yaml``, as ``accelerate
config`` writes it) as memplan's inputs: its FSDP section, the process count and the mixed
precision, each key mapped to the input it becomes, printed as a mapping.

The keys are those accelerate 1.15.0 writes (commands/config/cluster.py ``get_cluster_input``,
``fsdp_config[...]``) and ``accelerate launch`` turns into the ``FSDP_*`` environment variables
(utils/launch.py ``prepare_multi_gpu_env``) that ``FullyShardedDataParallelPlugin.
__post_init__`` (utils/dataclasses.py) reads; a key left out takes the plugin's default, as
there. What FSDP1 is modelled with (``memplan.model.fsdp1``, docs/fsdp1.md) is mapped; the
rest is refused by name. The file is YAML as ``yaml.safe_dump`` writes a config (``key:
value`` lines, nested mappings by indentation, lists of scalars); memplan reads that subset
itself (no YAML library is a dependency).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memplan.config_import.imported import Imported
from memplan.errors import MemplanError
from memplan.inputs import MODEL_FILE_BYTES, read_text

_SRC = "accelerate 1.15.0"
# top-level keys that hold no training-step memory (launch, logging, cluster plumbing)
QUIET = frozenset({"compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity",
                   "machine_rank", "main_training_function", "rdzv_backend", "same_network",
                   "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "gpu_ids", "main_process_ip",
                   "main_process_port", "num_machines", "use_cpu", "dynamo_config",
                   "mixed_precision", "num_processes", "distributed_type", "fsdp_config"})
# fsdp_config keys that hold no training-step memory: checkpoint format, how weights are
# loaded and broadcast at wrap time (_init_utils.py _sync_module_params_and_buffers)
FSDP_QUIET = frozenset({"fsdp_state_dict_type", "fsdp_sync_module_states",
                        "fsdp_cpu_ram_efficient_loading", "fsdp_transformer_layer_cls_to_wrap",
                        "fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward",
                        "fsdp_backward_prefetch", "fsdp_forward_prefetch",
                        "fsdp_use_orig_params", "fsdp_offload_params", "fsdp_auto_wrap_policy",
                        "fsdp_activation_checkpointing"})
PREFETCH = {"BACKWARD_PRE": "pre", "BACKWARD_POST": "post", "NO_PREFETCH": "none"}
# ShardingStrategy names and their numbers (accelerate utils/constants.py FSDP_SHARDING_STRATEGY)
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
              "HYBRID_SHARD_ZERO2")


def read(path: str | Path, gpus: int) -> Imported:
    """The inputs of the Accelerate config at ``path`` (``gpus``: the command line's GPU count,
    which ``num_processes`` must agree with where both are given)."""
    text = read_text(path, "accelerate config", MODEL_FILE_BYTES)
    imp = Imported(source=f"accelerate config {path}")
    data = parse_yaml(text, imp)
    unknown = sorted(set(data) - QUIET)
    if unknown:
        raise imp.refuse(unknown[0], data[unknown[0]], "not an Accelerate config key memplan "
                         "knows (it reads accelerate 1.15.0's)")
    machines = data.get("num_machines", 1)
    if type(machines) is not int or machines < 1:
        raise imp.refuse("num_machines", machines, "expected a positive int")
    _top(data, imp)
    fsdp = data.get("fsdp_config", {})
    if not isinstance(fsdp, dict):
        raise imp.refuse("fsdp_config", fsdp, "expected a mapping")
    unknown = sorted(set(fsdp) - FSDP_QUIET - {"fsdp_min_num_params",
                                              "fsdp_activation_checkpointing_offload"})
    if unknown:
        raise imp.refuse(f"fsdp_config.{unknown[0]}", fsdp[unknown[0]],
                         "not an FSDP key memplan knows (it reads accelerate 1.15.0's)")
    _fsdp(fsdp, imp, machines)
    return imp


def _top(data: dict[str, Any], imp: Imported) -> None:
    kind = data.get("distributed_type", "NO")
    if kind != "FSDP":
        raise imp.refuse("distributed_type", kind, "memplan reads Accelerate's FSDP configs "
                         "(distributed_type: FSDP)")
    if data.get("use_cpu", False):
        raise imp.refuse("use_cpu", data["use_cpu"], "a CPU run: no GPU memory to plan")
    n = data.get("num_processes")
    if n is not None:
        if type(n) is not int or n < 1:
            raise imp.refuse("num_processes", n, "expected a positive int")
        imp.set("num_processes", n, "gpus", n, "processes across all machines")
    precision = data.get("mixed_precision", "no")
    if precision == "bf16":
        imp.set("mixed_precision", precision, "precision", "fsdp-bf16",
                "fp32 weights, bf16 gathered: MixedPrecision(param_dtype=bf16, "
                "reduce_dtype=bf16); memplan reduces in fp32, an fp32 copy of the largest "
                "unit's gradient at its reduce that Accelerate does not make")
    elif precision == "no":
        imp.set("mixed_precision", precision, "precision", "fp32", "no MixedPrecision")
    else:
        raise imp.refuse("mixed_precision", precision, "memplan models FSDP1 in bf16 or fp32 "
                         "(fp16's sharded grad scaler and fp8 are not modelled)")


def _fsdp(fsdp: dict[str, Any], imp: Imported, machines: int) -> None:
    """The FSDP section: the plugin's defaults where a key is left out (version 1, FULL_SHARD,
    NO_PREFETCH, use_orig_params and forward_prefetch False, NO_WRAP)."""
    version = fsdp.get("fsdp_version", 1)
    if version not in (1, 2):
        raise imp.refuse("fsdp_config.fsdp_version", version, "expected 1 or 2")
    imp.set("fsdp_config.fsdp_version", version, "fsdp_version", version,
            "FullyShardedDataParallel" if version == 1 else "fully_shard")
    _strategy(fsdp, version, imp, machines)
    for key, off in (("fsdp_offload_params", "CPUOffload(offload_params=True)"),
                     ("fsdp_forward_prefetch", "forward_prefetch"),
                     ("fsdp_activation_checkpointing_offload", "activations offloaded")):
        if fsdp.get(key, False) is not False:
            raise imp.refuse(f"fsdp_config.{key}", fsdp[key], f"{off} is not modelled for "
                             "FSDP1 (docs/fsdp1.md)")
    orig = fsdp.get("fsdp_use_orig_params", False)
    if type(orig) is not bool:
        raise imp.refuse("fsdp_config.fsdp_use_orig_params", orig, "expected true or false")
    imp.set("fsdp_config.fsdp_use_orig_params", orig, "use_orig_params", orig,
            "absent: the plugin's default" if "fsdp_use_orig_params" not in fsdp else "")
    policy = fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")
    if policy != "TRANSFORMER_BASED_WRAP":
        raise imp.refuse("fsdp_config.fsdp_auto_wrap_policy", policy, "memplan's units are the "
                         "decoder layers (TRANSFORMER_BASED_WRAP); NO_WRAP (one unit) and "
                         "SIZE_BASED_WRAP are not modelled")
    layer = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    imp.notes.append(f"FSDP units: each {layer or 'decoder layer (the model _no_split_modules)'}"
                     ", the root holding embedding, final norm and head")
    if version == 1:
        given = fsdp.get("fsdp_backward_prefetch", "NO_PREFETCH")
        if given not in PREFETCH:
            raise imp.refuse("fsdp_config.fsdp_backward_prefetch", given,
                             f"expected one of {', '.join(PREFETCH)}")
        imp.set("fsdp_config.fsdp_backward_prefetch", given, "backward_prefetch",
                PREFETCH[given], "absent: the plugin's default" if
                "fsdp_backward_prefetch" not in fsdp else "")
    if fsdp.get("fsdp_activation_checkpointing", False):
        imp.set("fsdp_config.fsdp_activation_checkpointing", True, "recompute", "full",
                "checkpoint_wrapper(NO_REENTRANT) on every unit (accelerator.py "
                "prepare_model, apply_activation_checkpointing)")


def _strategy(fsdp: dict[str, Any], version: int, imp: Imported, machines: int) -> None:
    """``fsdp_sharding_strategy`` (or, as newer configs write it, ``fsdp_reshard_after_forward``:
    a strategy name for version 1, a bool for 2); a number is the strategy's (1-based)."""
    key = ("fsdp_reshard_after_forward" if "fsdp_reshard_after_forward" in fsdp
           else "fsdp_sharding_strategy")
    given = fsdp.get(key, "FULL_SHARD" if version == 1 else True)
    name = given
    if type(given) is int and 1 <= given <= len(STRATEGIES):
        name = STRATEGIES[given - 1]
    if version == 2:
        if given is not True:
            raise imp.refuse(f"fsdp_config.{key}", given, "FSDP2 without resharding after "
                             "forward is not modelled for a data-parallel job")
    elif name not in ("FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP"):
        raise imp.refuse(f"fsdp_config.{key}", given, "memplan models FULL_SHARD, "
                         "SHARD_GRAD_OP and HYBRID_SHARD (NO_SHARD and HYBRID_SHARD_ZERO2 are "
                         "not modelled: docs/fsdp1.md)")
    imp.set(f"fsdp_config.{key}", given, "zero", 3, "parameters, gradients and optimizer "
            "states sharded")
    if name == "SHARD_GRAD_OP":
        imp.set(f"fsdp_config.{key}", given, "reshard_after_forward", False,
                "each unit kept gathered from its forward to its post-backward")
    if name == "HYBRID_SHARD":
        # FULL_SHARD within a machine, replicated across machines: torch's
        # _init_utils.py _init_intra_and_inter_node_groups shards over
        # torch.cuda.device_count() ranks, one machine's GPUs
        n = imp.inputs.get("gpus")
        if n is None or n % machines:
            raise imp.refuse(f"fsdp_config.{key}", given, "HYBRID_SHARD shards within a "
                             "machine: give num_processes, a multiple of num_machines")
        imp.set("num_machines", machines, "dp_shard", n // machines,
                "HYBRID_SHARD: one machine's processes shard, machines replicate")


def parse_yaml(text: str, imp: Imported) -> dict[str, Any]:
    """The subset of YAML ``yaml.safe_dump`` writes for a config: ``key: value`` mappings
    nested by indentation, scalars (true/false, null, numbers, plain or quoted strings), ``[]``
    and ``{}``, and block lists of scalars. Anything else is refused with its line."""
    root: dict[str, Any] = {}
    stack: list[tuple[int, Any]] = [(-1, root)]
    last_key: tuple[dict[str, Any], str] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip() or line.strip() == "---":
            continue
        indent = len(line) - len(line.lstrip(" "))
        body = line.strip()
        while stack and indent <= stack[-1][0]:
            stack.pop()
        if body.startswith("- "):
            if last_key is None:
                raise _bad(imp, number, raw)
            parent, key = last_key
            if not isinstance(parent[key], list):
                parent[key] = []
            parent[key].append(scalar(body[2:].strip()))
            continue
        key, sep, value = body.partition(":")
        container = stack[-1][1]
        if not sep or not isinstance(container, dict) or (value and not value.startswith(" ")):
            raise _bad(imp, number, raw)
        key, value = key.strip().strip("'\""), value.strip()
        if value == "":
            container[key] = {}
            stack.append((indent, container[key]))
            last_key = (container, key)
            continue
        container[key] = scalar(value)
        last_key = None
    return root


def _bad(imp: Imported, number: int, raw: str) -> MemplanError:
    return MemplanError(f"{imp.source}: line {number} ({raw.strip()!r}): not the YAML "
                        "`accelerate config` writes (key: value mappings)")


def scalar(text: str) -> Any:
    """A YAML scalar as ``yaml.safe_load`` reads it, for the forms a config holds."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text in ("[]", "{}"):
        return [] if text == "[]" else {}
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "~"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
