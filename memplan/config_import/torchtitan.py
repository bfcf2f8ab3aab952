"""A torchtitan job TOML (``--torchtitan-config job.toml``), or an entry of torchtitan 0.3's
config registry (``--torchtitan-config "--module llama3 --config llama3_8b"``, read as the same
tables by ``memplan.config_import.torchtitan_registry``), as memplan's inputs.

The keys and their defaults are those of torchtitan's ``JobConfig`` (torchtitan/config/
job_config.py at v0.2.2, the last release that reads job TOMLs: 0.3.0 replaced them with
Python config registries, whose TrainingConfig and ParallelismConfig keep the same key names,
torchtitan/config/configs.py); the semantics are torchtitan v0.2.2's, each read where it is
named below. The job runs with memplan's torchtitan preset (``--framework torchtitan``), with
v0.2.2's own choices where they differ from 0.3.0's (``keep_grads``, ``fused_qkv``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from memplan.config_import.imported import Imported
from memplan.errors import MemplanError, ValidationError, validation_message
from memplan.inputs import MODEL_FILE_BYTES, read_toml
from memplan.spec import ModelSpec

_SRC = "torchtitan v0.2.2"
# torchtitan's llama3 flavors (models/llama3/__init__.py llama3_configs) and the catalog
# entries of the same shape (the 8B flavor: dim 4096, 32 layers, 32 heads, 8 KV heads, ffn
# multiplier 1.3 / multiple_of 1024 -> 14336, vocabulary 128256)
MODELS = {("llama3", "8B"): "llama-3-8b", ("llama3", "70B"): "llama-3-70b",
          ("llama3", "405B"): "llama-3.1-405b"}
# llama3's debugmodel flavor: dim 256, 6 layers, 16 heads, vocabulary 2048; the MLP width of
# TransformerModelArgs' defaults (multiple_of 256: 4*256 -> 2/3 -> 682 -> 768)
DEBUGMODEL = dict(num_layers=6, hidden_size=256, ffn_hidden_size=768, num_attention_heads=16,
                  num_kv_heads=16, head_dim=16, vocab_size=2048, norm="rmsnorm", mlp="swiglu",
                  position="rope", tied_embeddings=False)
# sections that hold nothing memplan's memory model reads
QUIET = ("job", "profiling", "metrics", "lr_scheduler", "checkpoint", "validation", "comm",
         "fault_tolerance", "experimental", "memory_estimation", "float8", "quantize",
         "mx", "dataloader")
SCHEDULES = {"1F1B": ("1f1b", True), "GPipe": ("gpipe", True), "Interleaved1F1B": ("1f1b", False)}


class _Toml:
    """Typed access to the TOML's sections, refusing a wrong type by its key."""

    def __init__(self, data: dict[str, Any], imp: Imported) -> None:
        self.data, self.imp = data, imp

    def section(self, name: str) -> dict[str, Any]:
        value = self.data.get(name, {})
        if not isinstance(value, dict):
            raise self.imp.refuse(name, value, "expected a table")
        return value

    def get(self, section: str, key: str, kind: type, default: Any) -> Any:
        value = self.section(section).get(key, default)
        if getattr(value, "unevaluated", False):  # a registry's call or expression
            raise self.imp.refuse(f"{section}.{key}", value,
                                  "not a literal: memplan reads the config without running "
                                  "it; give the value as an override (--section.key value)")
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise self.imp.refuse(f"{section}.{key}", value, f"expected {kind.__name__}")
        return value


def read(path: str | Path, gpus: int, model: str | None = None) -> Imported:
    """The inputs of the job at ``path`` run on ``gpus`` GPUs (the job names no world size;
    data_parallel_shard_degree = -1 takes the ranks left); ``model``: the model given instead
    of the job's (``--model``). ``path``: a job TOML (torchtitan 0.2), or a config registry
    entry as torchtitan 0.3's entry point takes it (``--module llama3 --config llama3_8b``
    and overrides: ``memplan.config_import.torchtitan_registry``)."""
    if not str(path).endswith(".toml"):
        return _read_registry(str(path), gpus, model)
    data = read_toml(path, "torchtitan config", MODEL_FILE_BYTES)
    imp = Imported(source=f"torchtitan config {path}")
    if not data or (model is None and "model" not in data):  # not a job file: say what lacks
        raise MemplanError(f"torchtitan config {path}: "
                           + ("the file is empty" if not data else "it has no [model] table")
                           + ": a torchtitan job TOML names at least [model] name and flavor "
                           "(torchtitan's train_configs/*.toml); or give --model")
    _read_tables(_Toml(data, imp), imp, gpus, model)
    imp.set("(train loop)", "optimizers.zero_grad()", "keep_grads", False,
            f"{_SRC} train.py train_step: zero_grad() sets gradients to None")
    imp.set("(model code)", "wq, wk, wv", "fused_qkv", False,
            f"{_SRC} models/llama3/model/model.py Attention: three projections")
    imp.set("(model code)", "freqs_cis", "rope_cache", "model-complex",
            f"{_SRC} models/llama3/model/model.py Transformer: one RoPE buffer on the model "
            f"(complex64)")
    for name in data:
        if name not in _READ and name not in QUIET:
            imp.unread.append(f"[{name}]")
    return imp


def _read_tables(toml: _Toml, imp: Imported, gpus: int, model: str | None,
                 always_fsdp: bool = False) -> None:
    """The mapping of a job's tables (a TOML's, or those of a registry entry). ``always_fsdp``:
    torchtitan 0.3's parallelize functions, which shard with FSDP2 whatever the shard degree
    (``_layout``)."""
    imp.set("(framework)", "torchtitan", "framework", "torchtitan",
            "the job runs torchtitan: its implementation defaults")
    if model is None:
        _model(toml, imp)
    else:
        imp.model = model
        imp.set("model.name/flavor", f"{toml.get('model', 'name', str, 'llama3')} "
                f"{toml.get('model', 'flavor', str, 'debugmodel')}", "model", model,
                "replaced by --model")
    degrees = _layout(toml, imp, gpus, always_fsdp)
    _batch(toml, imp, degrees)
    _precision(toml, imp, degrees)
    _recompute(toml, imp)
    _optimizer(toml, imp)
    _notes(toml, imp)


def _read_registry(text: str, gpus: int, model: str | None) -> Imported:
    """A registry entry: its ``Trainer.Config`` read as the job tables (torchtitan 0.3 keeps
    the TOMLs' section and key names, config/configs.py), then the loss, which 0.3 names in
    the config, and the loop's gradients."""
    from memplan.config_import import torchtitan_registry as reg

    command = reg.parse_command(text)
    imp = Imported(source=f"torchtitan config {command.file} {command.config}"
                          + "".join(f" --{k} {v}" for k, v in command.overrides))
    trainer = reg.evaluate(command)
    data, notes = reg.tables(trainer, command.module, imp.refuse)
    if model is None and "model" not in data:
        raise imp.refuse("model_spec", None, "the config names no model_registry(...) "
                                             "flavor: give --model")
    imp.notes.extend(notes)
    _read_tables(_Toml(data, imp), imp, gpus, model, always_fsdp=True)
    loss = trainer.kwargs.get("loss")
    if isinstance(loss, reg.Call) and loss.name.endswith("ChunkedLossWrapper.Config"):
        chunks = loss.kwargs.get("num_chunks", 8)
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise imp.refuse("loss.num_chunks", chunks, "expected a positive int")
        imp.set("loss", f"ChunkedLossWrapper(num_chunks={chunks})", "loss_chunks", chunks,
                "components/loss.py ChunkedLossWrapper: the head and loss per chunk of the "
                "sequence, each chunk's backward run inside the loss call: lm_head kept "
                "gathered, its gradient summed whole over the chunks (sync at the last "
                "chunk), the chunks' copies and their fp32 input-gradient sum "
                "(loss_chunk_backward in-loss, the torchtitan preset's)")
    elif loss is not None and not (isinstance(loss, reg.Call)
                                   and loss.name.endswith("CrossEntropyLoss.Config")):
        raise imp.refuse("loss", loss, "read are CrossEntropyLoss.Config() and "
                                       "ChunkedLossWrapper.Config(...)")
    if toml_flag(data, "training", "disable_cuda_graphs"):
        imp.set("training.disable_cuda_graphs", True, "keep_grads", False,
                "0.3 trainer.py train_step: zero_grad(set_to_none=training.disable_cuda_graphs)")
    imp.unread.extend(data.get("(unread)", []))
    aliases = data.get("training", {}).get("(aliases)", {})
    imp.mapping = [replace(m, key=aliases[m.key][0], given=aliases[m.key][1])
                   if m.key in aliases else m for m in imp.mapping]  # the file's own names
    return imp


def toml_flag(data: dict[str, Any], section: str, key: str) -> bool:
    return data.get(section, {}).get(key) is True


_READ = ("model", "training", "parallelism", "activation_checkpoint", "optimizer", "compile")


def _model(toml: _Toml, imp: Imported) -> None:
    name = toml.get("model", "name", str, "llama3")
    flavor = toml.get("model", "flavor", str, "debugmodel")
    key = "model.name/flavor"
    if (name, flavor) in MODELS:
        imp.model = MODELS[(name, flavor)]
        imp.set(key, f"{name} {flavor}", "model", imp.model, "the catalog entry of its shape")
        return
    if (name, flavor) == ("llama3", "debugmodel"):
        seq = toml.get("training", "seq_len", int, 2048)
        try:
            imp.model = ModelSpec(name="torchtitan-llama3-debugmodel", max_seq_len=seq,
                                  source=f"{_SRC} models/llama3/__init__.py llama3_configs"
                                         "['debugmodel']", **DEBUGMODEL)
        except ValidationError as err:  # the model's context is the job's seq_len
            raise imp.refuse("training.seq_len", seq, validation_message(err)) from None
        imp.set(key, f"{name} {flavor}", "model", imp.model.name,
                "dim 256, 6 layers, 16 heads, vocabulary 2048")
        return
    known = ", ".join(f"{n} {f}" for n, f in [*MODELS, ("llama3", "debugmodel")])
    raise imp.refuse(key, f"{name} {flavor}", f"not a torchtitan model memplan maps ({known}); "
                                              "give its shape with --model")


def _degree(toml: _Toml, key: str, default: int = 1) -> int:
    value = toml.get("parallelism", key, int, default)
    if value < 1 and not (key == "data_parallel_shard_degree" and value == -1):
        raise toml.imp.refuse(f"parallelism.{key}", value, "expected a degree of 1 or more")
    return value


def _layout(toml: _Toml, imp: Imported, gpus: int, always_fsdp: bool = False
            ) -> dict[str, int]:
    """The parallel degrees, as ParallelDims._validate resolves them (distributed/
    parallel_dims.py): the shard degree -1 is the ranks left after the others. v0.2.2 shards
    with FSDP2 only when the shard degree or cp is above 1 (ParallelDims.fsdp_enabled), else
    DDP or one rank; 0.3's (``always_fsdp``) parallelize functions call
    ``apply_fsdp_to_decoder`` whatever the degrees (models/llama3/parallelize.py
    parallelize_llama: "with shard_degree=1 it is a no-op for the all-gather but still installs
    the MixedPrecisionPolicy"; qwen3's and deepseek_v3's alike), over the replicate and shard
    mesh: FSDP2 units on a shard group of one rank, replicated (HSDP) where replicate > 1."""
    p = "parallelism"
    rep = _degree(toml, "data_parallel_replicate_degree")
    shard = _degree(toml, "data_parallel_shard_degree", -1)
    tp, pp = _degree(toml, "tensor_parallel_degree"), _degree(toml, "pipeline_parallel_degree")
    cp, ep = _degree(toml, "context_parallel_degree"), _degree(toml, "expert_parallel_degree")
    others = rep * cp * tp * pp
    if shard == -1:
        if gpus % others or gpus < others:
            raise imp.refuse(f"{p}.data_parallel_shard_degree", -1,
                             f"takes the ranks left of --gpus ({gpus}) after replicate * cp * "
                             f"tp * pp ({others}): give --gpus, a multiple of {others}")
        shard = gpus // others
        how = f"-1: the ranks left of --gpus {gpus}"
    else:
        how = ""
        if gpus != 1 and gpus != others * shard:
            raise imp.refuse(f"{p}.*_degree", others * shard,
                             f"the degrees multiply to {others * shard} ranks, --gpus is {gpus}")
        imp.set("(world size)", others * shard, "gpus", others * shard,
                "the degrees' product")
    for key, value, target in (("tensor_parallel_degree", tp, "tp"),
                               ("pipeline_parallel_degree", pp, "pp"),
                               ("context_parallel_degree", cp, "cp")):
        if value != 1 or key in toml.section(p):
            imp.set(f"{p}.{key}", value, target, value)
    if ep != 1:
        imp.set(f"{p}.expert_parallel_degree", ep, "ep", ep)
    fsdp = shard > 1 or cp > 1 or always_fsdp  # ParallelDims.fsdp_enabled (v0.2.2)
    imp.set(f"{p}.data_parallel_shard_degree", toml.section(p).get(
        "data_parallel_shard_degree", -1), "dp", rep * shard,
        how or "dp = replicate * shard")
    imp.set(f"{p}.data_parallel_shard_degree", shard, "zero", 3 if fsdp else 0,
            "FSDP2 (fully_shard) always: 0.3's apply_fsdp_to_decoder, a shard group of one "
            "rank too" if always_fsdp else
            "FSDP2 (fully_shard) when the shard degree or cp > 1; else DDP or one rank")
    if rep > 1 and (shard > 1 or always_fsdp):
        imp.set(f"{p}.data_parallel_replicate_degree", rep, "dp_shard", shard,
                "HSDP: replicas of shard groups")
    if tp > 1:
        imp.set(f"{p}.tensor_parallel_degree", tp, "sequence_parallel", True,
                "its TP plans shard the norms' sequence (SequenceParallel)")
        if toml.get(p, "disable_loss_parallel", bool, False):
            raise imp.refuse(f"{p}.disable_loss_parallel", True,
                             "the head's output gathered to the whole vocabulary on every TP "
                             "rank (loss parallel off) is not modelled")
    reshard = toml.get(p, "fsdp_reshard_after_forward", str, "default")
    if reshard != "default":
        raise imp.refuse(f"{p}.fsdp_reshard_after_forward", reshard,
                         "memplan models torchtitan's default resharding only")
    if toml.section(p).get("module_fqns_per_model_part") is not None:
        raise imp.refuse(f"{p}.module_fqns_per_model_part", "...",
                         "a hand-made split into stages: give it as --stage-layers")
    if pp > 1:
        _pipeline(toml, imp, pp)
    return {"dp": rep * shard, "pp": pp, "tp": tp, "fsdp": int(fsdp)}


def _pipeline(toml: _Toml, imp: Imported, pp: int) -> None:
    """The schedule and stages per rank (distributed/pipeline_parallel.py pipeline_llm: a
    multi-stage schedule without layers_per_stage has 2 stages per rank)."""
    p = "parallelism"
    name = toml.get(p, "pipeline_parallel_schedule", str, "1F1B")
    if name not in SCHEDULES:
        raise imp.refuse(f"{p}.pipeline_parallel_schedule", name,
                         f"modelled are {', '.join(SCHEDULES)}")
    schedule, single = SCHEDULES[name]
    imp.set(f"{p}.pipeline_parallel_schedule", name, "schedule", schedule)
    per_stage = toml.section(p).get("pipeline_parallel_layers_per_stage")
    if per_stage is None:
        stages = 1 if single else 2
        how = "one stage per rank" if single else "a multi-stage schedule's default: 2 per rank"
    else:
        per_stage = toml.get(p, "pipeline_parallel_layers_per_stage", int, 1)
        first = toml.get(p, "pipeline_parallel_first_stage_less_layers", int, 1)
        last = toml.get(p, "pipeline_parallel_last_stage_less_layers", int, 1)
        layers = _num_layers(imp)
        total = math.ceil((layers + first + last) / per_stage)
        if total % pp:
            raise imp.refuse(f"{p}.pipeline_parallel_layers_per_stage", per_stage,
                             f"{total} stages do not divide over {pp} ranks")
        stages = total // pp
        how = f"ceil(({layers} + {first} + {last}) / {per_stage}) stages over {pp} ranks"
    imp.set(f"{p}.pipeline_parallel_layers_per_stage", per_stage, "vpp", stages, how)


def _num_layers(imp: Imported) -> int:
    from memplan.spec import load_model

    model = imp.model
    return (model if isinstance(model, ModelSpec) else load_model(str(model))).num_layers


def _batch(toml: _Toml, imp: Imported, degrees: dict[str, int]) -> None:
    """local_batch_size is per data-parallel rank per step; with PP it is split into
    micro-batches of pipeline_parallel_microbatch_size (torchtitan/train.py)."""
    t = "training"
    key = "local_batch_size" if "local_batch_size" in toml.section(t) or \
        "batch_size" not in toml.section(t) else "batch_size"  # the name before 0.2
    local = toml.get(t, key, int, 8)
    if local < 1:
        raise imp.refuse(f"{t}.{key}", local, "expected 1 or more")
    global_ = toml.get(t, "global_batch_size", int, -1)
    if degrees["pp"] > 1:
        mbs = toml.get("parallelism", "pipeline_parallel_microbatch_size", int, 1)
        imp.set("parallelism.pipeline_parallel_microbatch_size", mbs, "micro_batch_size", mbs)
        imp.set(f"{t}.{key}", local, "global_batch_size",
                global_ if global_ > 0 else local * degrees["dp"],
                f"local batch * dp ({degrees['dp']}), split into micro-batches of {mbs}")
    else:
        imp.set(f"{t}.{key}", local, "micro_batch_size", local)
        if global_ > 0:
            imp.set(f"{t}.global_batch_size", global_, "global_batch_size", global_,
                    "gradient accumulation")
        else:
            imp.set(f"{t}.{key}", local, "global_batch_size", local * degrees["dp"],
                    f"local batch * dp ({degrees['dp']})")
    seq = toml.get(t, "seq_len", int, 2048)
    imp.set(f"{t}.seq_len", seq, "seq_len", seq)


def _precision(toml: _Toml, imp: Imported, degrees: dict[str, int]) -> None:
    """training.dtype bfloat16: everything in bf16; else fp32 weights with FSDP2's
    MixedPrecisionPolicy(param_dtype=mixed_precision_param) when FSDP is on
    (models/llama3/infra/parallelize.py apply_fsdp), torch.autocast for DDP or one rank, and
    no mixed precision under TP or PP without FSDP (distributed/utils.py maybe_enable_amp,
    v0.2.2). 0.3 has no autocast: its MixedPrecisionPolicy applies on every layout, FSDP2
    being always on (``_layout``'s ``always_fsdp``)."""
    t = "training"
    dtype = toml.get(t, "dtype", str, "float32")
    param = toml.get(t, "mixed_precision_param", str, "bfloat16")
    if dtype not in ("float32", "bfloat16") or param not in ("float32", "bfloat16"):
        raise imp.refuse(f"{t}.dtype/mixed_precision_param", f"{dtype}/{param}",
                         "expected float32 or bfloat16")
    if dtype == "bfloat16":
        imp.set(f"{t}.dtype", dtype, "precision", "bf16-pure",
                "parameters, gradients and optimizer states in bf16")
    elif param == "float32":
        imp.set(f"{t}.mixed_precision_param", param, "precision", "fp32")
    elif degrees["fsdp"]:
        imp.set(f"{t}.mixed_precision_param", param, "precision", "fsdp-bf16",
                "fully_shard's MixedPrecisionPolicy: bf16 compute copies of fp32 shards")
    elif degrees["tp"] > 1 or degrees["pp"] > 1:
        imp.set(f"{t}.mixed_precision_param", param, "precision", "fp32",
                "maybe_enable_amp: no mixed precision with TP or PP without FSDP")
    else:
        imp.set(f"{t}.mixed_precision_param", param, "precision", "amp-bf16",
                "maybe_enable_amp: torch.autocast for DDP or one rank")
    if toml.get(t, "enable_cpu_offload", bool, False):
        if not degrees["fsdp"]:
            raise imp.refuse(f"{t}.enable_cpu_offload", True,
                             "CPU offload without FSDP is not modelled")
        imp.set(f"{t}.enable_cpu_offload", True, "offload", "params",
                "fully_shard(offload_policy=CPUOffloadPolicy()): sharded weights, gradients "
                "and the optimizer step on the host")


# selective_ac_option n: a process-wide count of the blocks wrapped, each rank's model parts
# in turn; a block is wrapped in full AC when the count is a multiple of n (0: every block)
_AC = f"{_SRC} distributed/activation_checkpoint.py _apply_layer_sac"


def _recompute(toml: _Toml, imp: Imported) -> None:
    a = "activation_checkpoint"
    mode = toml.get(a, "mode", str, "selective")
    option = str(toml.section(a).get("selective_ac_option", "2"))
    if mode == "none":
        imp.set(f"{a}.mode", mode, "recompute", "none")
    elif mode == "full":
        imp.set(f"{a}.mode", mode, "recompute", "full")
    elif mode == "selective" and option == "op":
        imp.set(f"{a}.mode/selective_ac_option", "selective/op", "recompute", "selective",
                "per-op SAC (the torchtitan preset's selective_impl op)")
    elif mode == "selective" and _digits(option) and int(option) <= 1:
        imp.set(f"{a}.mode/selective_ac_option", f"selective/{option}", "recompute", "full",
                f"{_AC}: every layer checkpointed")
    elif mode == "selective" and _digits(option):
        every = int(option)
        given = "" if "selective_ac_option" in toml.section(a) else "its default; "
        imp.set(f"{a}.mode/selective_ac_option", f"selective/{option}", "recompute", "full",
                f"{given}whole layers checkpointed")
        imp.set(f"{a}.selective_ac_option", option, "recompute_every", every,
                f"{_AC}: blocks {every}, {2 * every}, ... of each rank, counted from 1 over "
                "its model parts in order")
    elif mode == "selective":
        raise imp.refuse(f"{a}.selective_ac_option", option,
                         "expected op or a number of layers (v0.2.2 "
                         "_apply_ac_to_transformer_block)")
    else:
        raise imp.refuse(f"{a}.mode", mode, "modelled are none, selective and full")


def _digits(option: str) -> bool:
    """v0.2.2's test of a layer count (``str.isdigit``), ASCII digits only."""
    return option.isascii() and option.isdigit()


def _optimizer(toml: _Toml, imp: Imported) -> None:
    o = "optimizer"
    name = toml.get(o, "name", str, "AdamW")
    if name not in ("AdamW", "Adam"):
        raise imp.refuse(f"{o}.name", name, "modelled are AdamW and Adam (two states)")
    imp.set(f"{o}.name", name, "optimizer", "adamw")
    impl = toml.get(o, "implementation", str, "fused")
    impls = {"fused": "fused", "foreach": "foreach", "for-loop": "forloop"}
    if impl not in impls:
        raise imp.refuse(f"{o}.implementation", impl, f"expected {', '.join(impls)}")
    imp.set(f"{o}.implementation", impl, "optimizer_impl", impls[impl])
    if toml.get(o, "early_step_in_backward", bool, False):
        raise imp.refuse(f"{o}.early_step_in_backward", True,
                         "the optimizer step inside backward is not modelled")


def _compile(toml: _Toml, imp: Imported) -> None:
    """compile.enable: with "model" in compile.components (torchtitan's default: model and
    loss) and the inductor backend, each decoder layer is compiled (distributed/compile.py
    apply_compile), its saved set decided by Inductor's min-cut partitioner (``--compile``).
    With "loss", ``BaseLoss._maybe_compile`` (components/loss.py) compiles the loss function
    (``--compile-loss``): unchunked, on whole logits or under TP on logits split over the
    vocabulary (``_LossParallelCrossEntropy`` in the graph, ``memplan.model.head``); as a
    ``ChunkedLossWrapper``'s inner loss, each chunk's (``read_registry``; ``memplan.model.
    loss_in_call``)."""
    components = toml.get("compile", "components", list, ["model", "loss"])
    backend = toml.get("compile", "backend", str, "inductor")
    if "model" in components and backend == "inductor":
        imp.set("compile.enable", True, "compile", True,
                "distributed/compile.py apply_compile: each TransformerBlock compiled")
    elif "model" in components:
        imp.notes.append(f"compile.backend {backend!r}: only Inductor's partitioner is "
                         "modelled; the layers estimated as eager PyTorch runs them")
    if "loss" in components and backend == "inductor":
        imp.set("compile.components", components, "compile_loss", True,
                "components/loss.py BaseLoss._maybe_compile (build_cross_entropy_loss before "
                "0.3): cross_entropy_loss under torch.compile, the upcast and cross-entropy "
                "one graph (under TP _LossParallelCrossEntropy's forward and backward; in a "
                "ChunkedLossWrapper each chunk's)")
    elif "loss" in components:
        imp.notes.append(f"compile.components 'loss': the loss compiled with backend "
                         f"{backend!r} is estimated as eager (only Inductor's partition is "
                         "modelled)")


def _float8_section(toml: _Toml) -> tuple[str, dict[str, Any]]:
    """The float8 converter's settings: a job TOML's [quantize.linear.float8] (or the older
    [float8]), or what a registry's ``Float8LinearConverter.Config(...)`` gave."""
    registry = toml.section("model").get("float8_options")
    if isinstance(registry, dict):
        return "model_spec Float8LinearConverter.Config", registry
    nested = toml.section("quantize").get("linear", {})
    table = nested.get("float8") if isinstance(nested, dict) else None
    if isinstance(table, dict):
        return "quantize.linear.float8", table
    return "float8", toml.section("float8")


def _float8(toml: _Toml, imp: Imported, conv: str) -> None:
    """The float8 converter (``components/quantization/float8.py``): every linear whose
    widths are multiples of 16 but those ``filter_fqns`` names becomes torchao's
    ``Float8Linear`` (``--float8``). Its recipe: ``recipe_name``, else the converter's
    default: a job TOML's converter (before 0.3) builds ``Float8LinearConfig(
    enable_fsdp_float8_all_gather=...)``, torchao's default tensorwise scaling; 0.3's
    ``Float8LinearConverter.Config`` defaults to "rowwise". ``enable_fsdp_float8_all_gather``
    is ``--float8-all-gather``; ``precompute_float8_dynamic_scale_for_fsdp`` makes the
    weights' scales in one all-reduce after the step (torchao ``float8/fsdp_utils.py``
    ``precompute_float8_dynamic_scale_for_fsdp``: one fp32 scalar per weight, nothing else
    held). The output head must be filtered: a float8 head is not modelled."""
    where, table = _float8_section(toml)
    default = "rowwise" if where.startswith("model_spec") else "tensorwise"
    recipe = table.get("recipe_name") or default
    if recipe not in ("tensorwise", "rowwise"):
        raise imp.refuse(f"{where}.recipe_name", recipe, "modelled are tensorwise and rowwise")
    filters = table.get("filter_fqns", [])
    if not any(name in ("output", "lm_head") for name in filters or []):
        raise imp.refuse(f"{where}.filter_fqns", filters, "the output head converted to "
                         "float8 is not modelled (filter 'output' or 'lm_head')")
    imp.set(f"model.converters {conv!r}", recipe, "float8", recipe,
            "components/quantization/float8.py: the layers' linears as Float8Linear")
    if table.get("enable_fsdp_float8_all_gather", False):
        imp.set(f"{where}.enable_fsdp_float8_all_gather", True, "float8_all_gather", True,
                "torchao float8/fsdp_utils.py WeightWithDynamicFloat8CastTensor")


def _notes(toml: _Toml, imp: Imported) -> None:
    converters = toml.section("model").get("converters", [])
    if isinstance(converters, str):
        converters = [converters]
    for conv in converters:
        if conv in ("float8", "quantize.linear.float8"):
            _float8(toml, imp, conv)
        elif conv in ("mx", "quantize.linear.mx"):
            imp.notes.append(f"model.converters {conv!r}: MX linears are not modelled; "
                             "estimated with bf16 matmuls (and bf16 FSDP gathers)")
        else:
            raise imp.refuse("model.converters", conv, "not a converter memplan knows")
    if toml.get("compile", "enable", bool, False):
        _compile(toml, imp)
    if toml.get("parallelism", "enable_async_tensor_parallel", bool, False):
        imp.notes.append("parallelism.enable_async_tensor_parallel: timing, no bytes modelled")
