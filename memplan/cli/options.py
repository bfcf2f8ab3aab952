"""Options shared by several commands, declared once.

Each shared option is one ``Annotated`` alias (its flags, help and panel) and one row of
``SHARED`` (its default, the model's own where the model has one); the ``memplan.api`` keyword
its value goes to is ``memplan.arguments.CLI_OPTIONS``'s. A command names
the options it takes with ``@uses(...)``: they are added to its signature, so ``--help``
lists them as if written there, and reach the command body as one ``Job``, whose
``kwargs()`` are the keyword arguments of ``memplan.api.resolve`` / ``estimate`` / ``plan``.
No command re-lists them.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, NamedTuple, Optional

import typer

from memplan import arguments
from memplan.errors import MemplanError
from memplan.hardware import DEFAULT_GPU
from memplan.model.pipeline import Schedule
from memplan.parallel import GradBuffers, Offload, ParallelConfig, TpStyle
from memplan.workload import (
    DEFAULT_SEQ_LEN,
    Attention,
    BackwardPrefetch,
    BaseQuant,
    DeltaNetKernel,
    MambaKernel,
    MlaCache,
    Float8Recipe,
    Framework,
    GradSync,
    LogitsHeld,
    LossImpl,
    MoeImpl,
    NormImpl,
    Optimizer,
    OptimizerImpl,
    Precision,
    Workload,
)


class RecomputeChoice(str, enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    OPS = "ops"
    AUTO = "auto"


class ZeroChoice(str, enum.Enum):
    Z0 = "0"
    Z1 = "1"
    Z2 = "2"
    Z3 = "3"


_LAYOUT = "Layout"
_WORKLOAD = "Workload"
_KERNELS = "Implementation"

Model = Annotated[str, typer.Option("--model", "-m", help="Catalog name (`memplan models`), a "
                                    "model TOML, or a Hugging Face config.json (or its folder).")]
Gpus = Annotated[int, typer.Option("--gpus", "-n", help="Total GPUs in the job.")]
Gpu = Annotated[str, typer.Option("--gpu", help="GPU name or alias (`memplan gpus`).")]
GpuMemory = Annotated[Optional[str], typer.Option(
    "--gpu-memory", help="Override capacity: 80GiB (2^30) or 80GB (10^9).")]
Tp = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.", rich_help_panel=_LAYOUT)]
Pp = Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree.", rich_help_panel=_LAYOUT)]
Vpp = Annotated[int, typer.Option("--vpp", help="Model chunks per pipeline rank (interleaved).",
                                  rich_help_panel=_LAYOUT)]
StageLayers = Annotated[Optional[str], typer.Option(
    "--stage-layers", help="Decoder layers on each pipeline stage in order, e.g. 15,16,16,15 "
    "(each virtual stage with --vpp > 1; they sum to the model's layers). Default: the "
    "framework's own split.", rich_help_panel=_LAYOUT)]
DpShard = Annotated[Optional[int], typer.Option(
    "--dp-shard", help="HSDP: data-parallel ranks of one ZeRO/FSDP shard group (dp = "
    "replicas x dp-shard; default: shard over all of dp).", rich_help_panel=_LAYOUT)]
Dp = Annotated[Optional[int], typer.Option(
    "--dp", help="Data-parallel degree (default: gpus / (tp*pp*cp)).", rich_help_panel=_LAYOUT)]
Cp = Annotated[int, typer.Option("--cp", help="Context-parallel degree.", rich_help_panel=_LAYOUT)]
Ep = Annotated[int, typer.Option("--ep", help="Expert-parallel degree (MoE).",
                                 rich_help_panel=_LAYOUT)]
VppGroup = Annotated[Optional[int], typer.Option(
    "--vpp-group", help="Interleaved pipeline: micro-batches per group run through each model "
    "chunk in turn (Megatron-LM's --microbatch-group-size-per-virtual-pipeline-stage; "
    "default: pp).", rich_help_panel=_LAYOUT)]
Etp = Annotated[Optional[int], typer.Option(
    "--etp", help="Expert tensor-parallel degree: the TP split of each routed expert's weights "
    "(Megatron-LM's --expert-tensor-parallel-size; default: tp).", rich_help_panel=_LAYOUT)]
Sp = Annotated[Optional[bool], typer.Option(
    "--sp/--no-sp", help="Sequence parallelism (default: on when tp > 1).",
    rich_help_panel=_LAYOUT)]
VocabParallel = Annotated[bool, typer.Option(
    "--vocab-parallel/--no-vocab-parallel",
    help="Embedding, head and loss split over the vocabulary by TP (Megatron-LM, torchtitan "
    "with loss_parallel), or replicated.", rich_help_panel=_LAYOUT)]
TpStyleOpt = Annotated[Optional[TpStyle], typer.Option(
    "--tp-style", help="With SP, what column-parallel linears save: megatron (sequence "
    "shard) or dtensor (gathered full sequence).", rich_help_panel=_LAYOUT)]
GradBuffersOpt = Annotated[Optional[GradBuffers], typer.Option(
    "--grad-buffers", help="ZeRO 0/1 data parallel: gradients as views of persistent buffers "
    "(Megatron-LM) or DDP's default copy into buckets.", rich_help_panel=_LAYOUT)]
OffloadOpt = Annotated[str, typer.Option(
    "--offload", help="Comma list of what lives in host memory: optimizer (states and step; "
    "ZeRO-Offload with --zero 1-3, torchao CPUOffloadOptimizer without), activations "
    "(save_on_cpu), params (FSDP2 CPUOffloadPolicy, --zero 3).", rich_help_panel=_LAYOUT)]
Zero = Annotated[ZeroChoice, typer.Option(
    "--zero", help="ZeRO stage: 1 optimizer states, 2 + gradients, 3 (FSDP) + parameters.",
    rich_help_panel=_LAYOUT)]
Mbs = Annotated[int, typer.Option("--mbs", help="Micro-batch size (sequences).",
                                  rich_help_panel=_WORKLOAD)]
Gbs = Annotated[Optional[int], typer.Option(
    "--gbs", help="Global batch size (default: mbs*dp*pp, filling the pipeline).",
    rich_help_panel=_WORKLOAD)]
Seq = Annotated[Optional[int], typer.Option(
    "--seq", help=f"Sequence length (default: {DEFAULT_SEQ_LEN}, capped at the model's maximum).",
    rich_help_panel=_WORKLOAD)]
RecomputeOpt = Annotated[RecomputeChoice, typer.Option(
    "--recompute", help="none; selective (attention core); full (layer inputs only); ops "
    "(each layer keeps its input and --recompute-save's ops); auto (none where that fits, "
    "else ops with the save set of least recompute that fits).",
    rich_help_panel=_WORKLOAD)]
RecomputeSave = Annotated[Optional[str], typer.Option(
    "--recompute-save", help="With --recompute ops: comma list of what each layer keeps "
    "(saved-term names such as attn.q, mlp.gate, attn.o_proj, or groups attention, mlp, "
    "norms); the rest is recomputed in backward. SCOPE:name keeps name only in layers of a "
    "kind (dense:, moe:) or on a pipeline stage (stage0:, stage1:, ...).",
    rich_help_panel=_WORKLOAD)]
RecomputeLayers = Annotated[Optional[int], typer.Option(
    "--recompute-layers", help="With --recompute full: recompute only this many layers per stage.",
    rich_help_panel=_WORKLOAD)]
RecomputeEvery = Annotated[Optional[int], typer.Option(
    "--recompute-every", help="With --recompute full: recompute only every n-th layer of a "
    "stage (torchtitan's selective_ac_option n).", rich_help_panel=_WORKLOAD)]
PrecisionOpt = Annotated[Precision, typer.Option(
    "--precision", help="Precision recipe (weights / grads / master copy).",
    rich_help_panel=_WORKLOAD)]
OptimizerOpt = Annotated[Optimizer, typer.Option(
    "--optimizer", help="adamw, sgd (momentum 0.9), adamw8bit / paged-adamw8bit / "
    "paged-adamw (bitsandbytes), adafactor, muon (Muon on 2-D weights, AdamW on the rest).",
    rich_help_panel=_WORKLOAD)]
OptimizerImplOpt = Annotated[Optional[OptimizerImpl], typer.Option(
    "--optimizer-impl", help="torch.optim implementation: step temporaries differ "
    "(default: the framework's; generic: foreach).",
    rich_help_panel=_KERNELS)]
AttentionOpt = Annotated[Attention, typer.Option(
    "--attention", help="flash (no score matrix) or eager (saves the s^2 softmax).",
    rich_help_panel=_KERNELS)]
NormOpt = Annotated[Optional[NormImpl], typer.Option(
    "--norm", help="upcast (HF-style fp32 norm) or fused kernel (default: the framework's; "
    "generic: upcast).", rich_help_panel=_KERNELS)]
LogitsFp32 = Annotated[Optional[bool], typer.Option(
    "--logits-fp32/--no-logits-fp32", help="Loss on fp32 logits (default: the framework's; "
    "generic: on).", rich_help_panel=_KERNELS)]
KeepGrads = Annotated[Optional[bool], typer.Option(
    "--keep-grads/--no-keep-grads", help="zero_grad(set_to_none=False): gradients stay "
    "allocated between steps (default: the framework's; torchtitan keeps them unless "
    "training.disable_cuda_graphs).", rich_help_panel=_KERNELS)]
GradSyncOpt = Annotated[Optional[GradSync], typer.Option(
    "--grad-sync", help="With gradient accumulation: every (reduce after each micro-batch, "
    "FSDP2's default) or last (only the last micro-batch syncs: FSDP2 "
    "set_requires_gradient_sync(False) keeps unsharded gradients in the reduce dtype across "
    "micro-batches; DDP no_sync() and ZeRO-1 hold the same bytes as every). Default: the "
    "framework's (hf: last; generic: every).",
    rich_help_panel=_WORKLOAD)]
FsdpVersion = Annotated[Optional[int], typer.Option(
    "--fsdp-version", min=1, max=2, help="Which FSDP shards under --zero 3: 2 (fully_shard, "
    "per-parameter) or 1 (FullyShardedDataParallel FULL_SHARD: one flat parameter per "
    "wrapped unit). Default: the framework's (hf: 1, Accelerate's default; generic: 2).",
    rich_help_panel=_LAYOUT)]
FsdpBackwardPrefetch = Annotated[Optional[BackwardPrefetch], typer.Option(
    "--fsdp-backward-prefetch", help="FSDP1's backward_prefetch: pre (BACKWARD_PRE, torch's "
    "default: two blocks gathered in backward), post (BACKWARD_POST) or none (Accelerate's and "
    "the Trainer's NO_PREFETCH). Default: the framework's (hf: none; generic: pre).",
    rich_help_panel=_LAYOUT)]
FsdpUseOrigParams = Annotated[Optional[bool], typer.Option(
    "--fsdp-use-orig-params/--no-fsdp-use-orig-params", help="FSDP1's use_orig_params: the "
    "sharded gradients live into the next step's forward. Default: the framework's (hf: on, "
    "the Trainer's default; generic: off).", rich_help_panel=_LAYOUT)]
FsdpReshardAfterForward = Annotated[Optional[bool], typer.Option(
    "--fsdp-reshard-after-forward/--no-fsdp-reshard-after-forward", help="FSDP1's sharding "
    "strategy at --zero 3: FULL_SHARD (on, the default) or SHARD_GRAD_OP (off: each unit kept "
    "gathered from its forward to its backward).", rich_help_panel=_LAYOUT)]
CompileOpt = Annotated[Optional[bool], typer.Option(
    "--compile/--no-compile", help="Each decoder layer under torch.compile (Inductor): "
    "AOTAutograd's min-cut partitioner saves matmul and attention outputs and recomputes the "
    "pointwise ops between them (torchtitan's compile.enable). Default: off.",
    rich_help_panel=_KERNELS)]
CompileLossOpt = Annotated[Optional[bool], typer.Option(
    "--compile-loss/--no-compile-loss", help="torchtune's chunked cross-entropy compiled "
    "(training.compile_loss, with torchtune's compile=True; --loss-impl torchtune-chunked), "
    "or torchtitan's loss compiled (--loss-impl torchtitan; unchunked, also under loss "
    "parallel, or each chunk of its ChunkedLossWrapper): each chunk saves its logits and "
    "two fp32 numbers per token instead of an fp32 log-softmax (under loss parallel the fp32 "
    "softmax less the targets). Default: off.", rich_help_panel=_KERNELS)]
CompileInCheckpointOpt = Annotated[Optional[bool], typer.Option(
    "--compile-in-checkpoint/--no-compile-in-checkpoint", help="With --compile and --recompute "
    "full: each compiled layer runs inside its activation checkpoint (torchtune's "
    "compile_model, transformers' gradient checkpointing), its forward the uncheckpointed "
    "compiled one; off: the checkpoint inside the compiled graph (torchtitan). Default: off.",
    rich_help_panel=_KERNELS)]
OptimizerInBackwardOpt = Annotated[Optional[bool], typer.Option(
    "--optimizer-in-backward/--no-optimizer-in-backward", help="Each parameter's optimizer "
    "step runs in backward, in a hook after its gradient is made, which it then frees "
    "(torchtune's optimizer_in_bwd): gradients never accumulate, no step follows backward; "
    "one device, no gradient accumulation. Default: off.", rich_help_panel=_KERNELS)]
Float8Opt = Annotated[Float8Recipe, typer.Option(
    "--float8", help="The decoder layers' linears as torchao's Float8Linear "
    "(torchtitan's float8 converter, the output head not converted): tensorwise or rowwise "
    "dynamic scaling (torchtitan 0.3 offers rowwise; tensorwise is torchao's and earlier "
    "torchtitan's). Default: none.", rich_help_panel=_KERNELS)]
Float8AllGatherOpt = Annotated[Optional[bool], typer.Option(
    "--float8-all-gather/--no-float8-all-gather", help="FSDP2 all-gathers the float8 "
    "linears' weights in float8 (torchao's enable_fsdp_float8_all_gather): one byte an "
    "element gathered, no weight cast in the linears; needs --float8 tensorwise and --zero 3. "
    "Default: off.", rich_help_panel=_KERNELS)]
AsyncTpOpt = Annotated[Optional[bool], typer.Option(
    "--async-tp/--no-async-tp", help="Tensor parallelism's sequence all-gathers and "
    "reduce-scatters micro-pipelined with their matmuls (torchtitan's "
    "enable_async_tensor_parallel); step time only; needs --compile. Default: off.",
    rich_help_panel=_KERNELS)]
UseCache = Annotated[Optional[bool], typer.Option(
    "--use-cache/--no-use-cache", help="The training forward fills a key/value cache "
    "(transformers' config use_cache, which Trainer leaves on: a DynamicCache holds each "
    "layer's K and V until the forward's output is dropped; off with gradient checkpointing) "
    "(default: the framework's; hf: the model config's use_cache, on unless it says false).",
    rich_help_panel=_KERNELS)]
FrameworkOpt = Annotated[Optional[Framework], typer.Option(
    "--framework", help="The framework that runs the job: its implementation defaults "
    "(norm kernel, optimizer implementation, who holds the logits, ...) apply to every "
    "option not given, each printed under assumptions with its source. generic: plain "
    "PyTorch as memplan's reference model runs it.", rich_help_panel=_KERNELS)]
LossChunks = Annotated[int, typer.Option(
    "--loss-chunks", help="Run the head and cross-entropy on N chunks of the tokens, each "
    "checkpointed (1: all tokens at once).", rich_help_panel=_KERNELS)]
LossImplOpt = Annotated[Optional[LossImpl], typer.Option(
    "--loss-impl", help="The cross-entropy implementation (default: the framework's); "
    "torchtune-chunked: torchtune's chunked output and CEWithChunkedOutputLoss on "
    "--loss-chunks chunks, none checkpointed.", rich_help_panel=_KERNELS)]
MoeImplOpt = Annotated[Optional[MoeImpl], typer.Option(
    "--moe-impl", help="How an MoE model's routed experts run (default: the framework's; hf: "
    "grouped, transformers' experts interface as 5.23 writes it, which runs Granite's MoE "
    "too): loop (one expert at a time), grouped, grouped-token (the same as transformers 5.3 "
    "wrote it: rows gathered by token, then a sorted copy), every (every token through every "
    "expert, Llama 4), parallel (transformers 5.3's GraniteMoeParallelExperts).",
    rich_help_panel=_KERNELS)]
LogitsHeldOpt = Annotated[Optional[LogitsHeld], typer.Option(
    "--logits-held", help="Who keeps the logits beyond what autograd saves (default: the "
    "framework's): none; loss (the model's output until backward, transformers); step (the "
    "fp32 logits the loss read, through backward and the step, litgpt); output (the model's "
    "output and its KV cache through backward and the step, peft's run.py).",
    rich_help_panel=_KERNELS)]
DeltaNetKernelOpt = Annotated[Optional[DeltaNetKernel], typer.Option(
    "--deltanet-kernel", help="Qwen3-Next's gated DeltaNet kernels: fla (default: "
    "flash-linear-attention and causal-conv1d installed, as transformers then runs them), "
    "torch (transformers' torch fallbacks, without them, as written up to transformers 5.16) "
    "or torch-solve (the same, as written from 5.17 on: torch.linalg.solve_triangular).", rich_help_panel=_KERNELS)]
MambaKernelOpt = Annotated[Optional[MambaKernel], typer.Option(
    "--mamba-kernel", help="Granite 4.0-H's and Falcon-H1's Mamba2 mixers on transformers' torch path (no "
    "mamba_ssm, no causal-conv1d): torch-einsum (default: as transformers 5.23 writes it, "
    "mamba2_chunk_scan's einsums) or torch (as transformers 5.3 wrote it: the naive chunked "
    "scan).", rich_help_panel=_KERNELS)]
MlaCacheOpt = Annotated[Optional[MlaCache], typer.Option(
    "--mla-cache", help="What a training forward's key/value cache holds of DeepSeek's "
    "latent attention (with --use-cache): latent (default: the latents, as transformers "
    "5.23 caches them, the value then a view of kv_b_proj's whole output) or expanded (the "
    "expanded key and value, as transformers 5.3 did).", rich_help_panel=_KERNELS)]
MtpLayers = Annotated[int, typer.Option(
    "--mtp-layers", help="Multi-token prediction depths on the last pipeline stage "
    "(Megatron-LM's --mtp-num-layers): per depth a layer, norms, a 2h -> h projection and "
    "its own logits and loss.", rich_help_panel=_WORKLOAD)]
_FINETUNE = "Fine-tuning (LoRA as peft builds it)"
LoraRank = Annotated[int, typer.Option(
    "--lora-rank", min=0, help="LoRA adapters of this rank on frozen base weights (0: none; "
    "fp32 adapters, the only parameters with gradients and optimizer states).",
    rich_help_panel=_FINETUNE)]
LoraTargets = Annotated[Optional[str], typer.Option(
    "--lora-targets", help="Projections to adapt, comma-separated: q,k,v,o,gate,up,down, "
    "output (the untied head; lm_head: the same), or all-linear (every one but the head) "
    "(default: peft's for the family: q,v, or a fused qkv).",
    rich_help_panel=_FINETUNE)]
LoraDropout = Annotated[float, typer.Option(
    "--lora-dropout", help="Dropout on the adapters' input (a mask and a copy saved per "
    "adapted projection).", rich_help_panel=_FINETUNE)]
BaseQuantOpt = Annotated[BaseQuant, typer.Option(
    "--base-quant", help="Frozen base linears stored as bitsandbytes NF4 with double "
    "quantization (QLoRA), int8 (LLM.int8), or torchao 0.1's NF4Tensor (torchtune's QLoRA "
    "while it pinned torchao 0.1).", rich_help_panel=_FINETUNE)]
ScheduleOpt = Annotated[Schedule, typer.Option(
    "--schedule", help="Pipeline schedule (1f1b is interleaved when --vpp > 1).",
    rich_help_panel=_KERNELS)]
Json = Annotated[bool, typer.Option("--json", help="Machine output: one JSON object, int bytes.")]
Html = Annotated[Optional[Path], typer.Option(
    "--html", help="Also write the report as one self-contained HTML page (charts and tables "
    "drawn from the --json object it carries; no network) to this .html file.")]
Calibration = Annotated[Optional[list[str]], typer.Option(
    "--calibration", help="A profile from `memplan calibrate` (JSON file), a folder to search "
    "for the GPU's profile, or `auto` for the committed one; its correction is its own line. "
    "Give it twice for a device and a model profile.")]
_CONFIGS = "Inputs from a job's own config"
TorchtitanConfig = Annotated[Optional[str], typer.Option(
    "--torchtitan-config", help="A torchtitan job TOML (torchtitan 0.2's train_configs), or a "
    "config registry entry as torchtitan 0.3's entry point takes it, quoted: '--module llama3 "
    "--config llama3_8b --training.local_batch_size 2' (or a config_registry.py path for "
    "--module), parsed, never run. Its model, parallelism, batch, sequence, activation "
    "checkpointing, loss and precision become these options, printed as a mapping; --gpus "
    "gives the world size.", rich_help_panel=_CONFIGS)]
DeepspeedConfig = Annotated[Optional[str], typer.Option(
    "--deepspeed-config", help="A DeepSpeed ds_config.json, read as written (the Trainer's "
    "\"auto\" filled from --model's hidden size and these options): ZeRO stage, precision, "
    "reduce bucket, contiguous_gradients and overlap_comm become these options under "
    "--framework deepspeed, printed as a mapping; --model and --gpus give the model and the "
    "world size.", rich_help_panel=_CONFIGS)]
AccelerateConfig = Annotated[Optional[str], typer.Option(
    "--accelerate-config", help="An Accelerate config YAML (as `accelerate config` writes "
    "it) of an FSDP job: its FSDP section (version, sharding strategy, backward prefetch, "
    "wrap policy, activation checkpointing), num_processes and mixed_precision become these "
    "options, printed as a mapping; --model names the model the script loads.",
    rich_help_panel=_CONFIGS)]
MegatronArgs = Annotated[Optional[str], typer.Option(
    "--megatron-args", help="Megatron-LM launch arguments, quoted, or a file of them (a "
    "launch script, or a test model_config.yaml): the model's shape, TP/PP/CP/EP, virtual "
    "stages, batch, sequence, recompute, distributed optimizer and precision become these "
    "options, printed as a mapping; --gpus gives the world size.", rich_help_panel=_CONFIGS)]


def _same(value: Any) -> Any:
    return value


def _value(choice: enum.Enum | None) -> Any:
    """An enum choice as the string the API takes (None stays None: searched or default)."""
    return None if choice is None else choice.value


def _offload(value: str | None) -> str | None:
    """``--offload``'s comma list, its names checked here so the error names the flag (None,
    plan's default: searched)."""
    names = {kind.value for kind in Offload}
    if value is not None and value != "none" and not set(value.split(",")) <= names:
        raise MemplanError("--offload must be none or a comma list of optimizer, activations, "
                           f"params, got {value!r}")
    return value


def _zero(choice: ZeroChoice | None) -> int | None:
    return None if choice is None else int(choice.value)


# NamedTuples, not dataclasses: immutable too, and five times cheaper to define at start-up
class Shared(NamedTuple):
    """One shared option: its declaration and its default (the ``memplan.api`` keyword it
    sets: ``KEYWORDS``)."""

    annotation: Any
    default: Any
    convert: Callable[[Any], Any] = _same
    resolve: bool = True  # a keyword of ``memplan.api.resolve`` (else of estimate/plan only)


_REQUIRED = inspect.Parameter.empty
# option -> the ``memplan.api`` keyword it sets (the model, the API's first argument, aside:
# a command reads it from the ``Job`` itself)
KEYWORDS = {option: keyword for keyword, option in arguments.CLI_OPTIONS.items()}
_WL, _PAR = Workload.model_fields, ParallelConfig.model_fields  # the defaults, declared there

SHARED: dict[str, Shared] = {
    "model": Shared(Model, _REQUIRED),  # the first positional argument of the API
    "gpus": Shared(Gpus, 1),
    "gpu": Shared(Gpu, DEFAULT_GPU, resolve=False),
    "gpu_memory": Shared(GpuMemory, None, resolve=False),
    "tp": Shared(Tp, _PAR["tp"].default),
    "pp": Shared(Pp, _PAR["pp"].default),
    "vpp": Shared(Vpp, _PAR["vpp"].default),
    "dp": Shared(Dp, None),
    "stage_layers": Shared(StageLayers, None),
    "dp_shard": Shared(DpShard, None),
    "cp": Shared(Cp, _PAR["cp"].default),
    "ep": Shared(Ep, _PAR["ep"].default),
    "etp": Shared(Etp, None),
    "vpp_group": Shared(VppGroup, None),
    "sp": Shared(Sp, None),
    "vocab_parallel": Shared(VocabParallel, _PAR["vocab_parallel"].default),
    "tp_style": Shared(TpStyleOpt, None, _value),
    "grad_buffers": Shared(GradBuffersOpt, None, _value),
    "offload": Shared(OffloadOpt, "none", _offload),
    "zero": Shared(Zero, ZeroChoice.Z0, _zero),
    "mbs": Shared(Mbs, _WL["micro_batch_size"].default),
    "gbs": Shared(Gbs, None),
    "seq": Shared(Seq, None),
    "recompute": Shared(RecomputeOpt, RecomputeChoice.NONE, _value),
    "recompute_layers": Shared(RecomputeLayers, None),
    "recompute_save": Shared(RecomputeSave, None),
    "recompute_every": Shared(RecomputeEvery, None),
    "precision": Shared(PrecisionOpt, _WL["precision"].default),
    "optimizer": Shared(OptimizerOpt, _WL["optimizer"].default),
    "optimizer_impl": Shared(OptimizerImplOpt, None),
    "attention": Shared(AttentionOpt, _WL["attention"].default),
    "norm": Shared(NormOpt, None),
    "logits_fp32": Shared(LogitsFp32, None),
    "framework": Shared(FrameworkOpt, None, _value),
    "keep_grads": Shared(KeepGrads, None),
    "use_cache": Shared(UseCache, None),
    "compile": Shared(CompileOpt, False),
    "compile_loss": Shared(CompileLossOpt, False),
    "compile_in_checkpoint": Shared(CompileInCheckpointOpt, False),
    "optimizer_in_backward": Shared(OptimizerInBackwardOpt, False),
    "float8": Shared(Float8Opt, Float8Recipe.NONE, _value),
    "float8_all_gather": Shared(Float8AllGatherOpt, False),
    "async_tp": Shared(AsyncTpOpt, False),
    "grad_sync": Shared(GradSyncOpt, None),
    "fsdp_version": Shared(FsdpVersion, None),
    "fsdp_backward_prefetch": Shared(FsdpBackwardPrefetch, None, _value),
    "fsdp_use_orig_params": Shared(FsdpUseOrigParams, None),
    "fsdp_reshard_after_forward": Shared(FsdpReshardAfterForward, None),
    "loss_chunks": Shared(LossChunks, _WL["loss_chunks"].default),
    "mtp_layers": Shared(MtpLayers, _WL["mtp_layers"].default),
    "lora_rank": Shared(LoraRank, 0), "lora_targets": Shared(LoraTargets, None),
    "lora_dropout": Shared(LoraDropout, 0.0),
    "base_quant": Shared(BaseQuantOpt, BaseQuant.NONE, _value),
    "loss_impl": Shared(LossImplOpt, None),
    "moe_impl": Shared(MoeImplOpt, None, _value),
    "logits_held": Shared(LogitsHeldOpt, None, _value),
    "deltanet_kernel": Shared(DeltaNetKernelOpt, None, _value),
    "mamba_kernel": Shared(MambaKernelOpt, None, _value),
    "mla_cache": Shared(MlaCacheOpt, None, _value),
    "schedule": Shared(ScheduleOpt, Schedule.ONE_F_ONE_B, resolve=False),
    "calibration": Shared(Calibration, None, resolve=False),
}

LAYOUT = ("tp", "pp", "vpp", "vpp_group", "dp", "cp", "ep", "etp", "sp", "vocab_parallel",
          "tp_style",
          "grad_buffers", "offload", "zero", "stage_layers", "dp_shard")
WORKLOAD = ("mbs", "gbs", "seq", "recompute", "recompute_layers", "recompute_every",
            "precision", "optimizer", "optimizer_impl", "attention", "norm", "logits_fp32",
            "loss_chunks", "framework", "keep_grads", "use_cache", "grad_sync", "compile",
            "float8", "optimizer_in_backward",
            "fsdp_version", "fsdp_backward_prefetch", "fsdp_use_orig_params",
            "fsdp_reshard_after_forward", "mtp_layers", "loss_impl", "moe_impl",
            "logits_held", "lora_rank", "lora_targets", "lora_dropout", "base_quant",
            "deltanet_kernel", "mamba_kernel", "mla_cache",
            "float8_all_gather", "compile_loss", "compile_in_checkpoint",
            "recompute_save", "async_tp")
# what a framework's own loop decides, beyond memplan's reference model (which trace and
# profile run)
FRAMEWORK_ONLY = ("framework", "keep_grads", "use_cache", "loss_impl", "moe_impl",
                  "logits_held", "compile", "float8", "float8_all_gather", "compile_loss",
                  "compile_in_checkpoint", "async_tp")  # the reference model runs eagerly, plain linears
# everything ``memplan estimate`` takes: diagnose takes the same configuration
ESTIMATE = ("model", "gpus", "gpu", "gpu_memory", *LAYOUT, *WORKLOAD, "schedule", "calibration")


class Job(NamedTuple):
    """The shared options one command line gave, by option name (``job.tp``)."""

    values: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def kwargs(self, *, resolve_only: bool = False) -> dict[str, Any]:
        """The ``memplan.api`` keyword arguments of these options (only those ``resolve``
        takes with ``resolve_only``): the one place parsed values become API values."""
        return {KEYWORDS[name]: opt.convert(self.values[name])
                for name, opt in ((n, SHARED[n]) for n in self.values)
                if name in KEYWORDS and (opt.resolve or not resolve_only)}


def defaults_of(job: Job, command: Callable[..., Any]) -> dict[str, Any]:
    """The API keywords ``command``'s options give when left unset (its ``uses`` defaults),
    to tell what a command line set from what it left."""
    params = inspect.signature(command).parameters
    return Job({n: params[n].default for n in job.values if n in params}).kwargs()


def uses(*names: str, **defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the shared options ``names`` (``SHARED``; ``defaults`` overrides theirs) before a
    command's own parameters; the command receives them as its first argument, a ``Job``."""
    unknown = [n for n in (*names, *defaults) if n not in SHARED]
    if unknown:
        raise KeyError(f"not shared options: {unknown}")
    shared = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY,
                                annotation=SHARED[n].annotation,
                                default=defaults.get(n, SHARED[n].default)) for n in names]

    def wrap(body: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(body, eval_str=True).parameters.values())[1:]  # not the job
        params = shared + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]

        @functools.wraps(body)
        def command(**values: Any) -> Any:
            job = Job({n: values.pop(n) for n in names})
            return body(job, **values)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.shared = names  # type: ignore[attr-defined]
        return command

    return wrap


def check_html(path: Path | None) -> Path | None:
    """``--html``'s page path checked (``memplan.report.html.check_path``: one line naming
    ``--html``, exit 2) before the command reads or estimates anything."""
    if path is None:
        return None
    from memplan.report.html import check_path

    return check_path(path)


def rich_text(*items: Any) -> str:
    """What ``rich`` prints for ``items`` (strings as they are, or renderables), as plain
    text: a command's text report, kept in its ``--html`` page."""
    import io

    from rich.console import Console
    from rich.text import Text

    console = Console(record=True, file=io.StringIO(), width=140, color_system=None)
    for item in items:
        console.print(Text(item) if isinstance(item, str) else item)
    return console.export_text()


def write_html(path: Path, command: str, out: dict[str, Any], text: str = "") -> Path:
    """``--html``: the page of ``out`` exactly as ``command``'s ``--json`` prints it (the
    ``versioned`` object), with ``text``, written to ``path`` whole."""
    import json

    from memplan.report.html import write_html as write_page
    from memplan.report.versioned import dumps

    return write_page(path, json.loads(dumps(command, out)), text)
