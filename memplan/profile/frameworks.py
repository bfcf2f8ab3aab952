"""Ground truth from other people's code: Hugging Face transformers, torchtitan and litgpt.

``compare_framework(case)`` builds a real model with the library (``build_hf``,
``build_torchtitan``, ``build_litgpt``), runs two training steps the way the library's own loop
runs them (its loss, ``torch.optim.AdamW(fused=True)`` as all three use on CUDA,
``zero_grad(set_to_none=True)``, gradient clipping where the loop clips) under memplan's exact
tensor tracker, and returns a ``memplan.profile.compare.Comparison`` against
``memplan.model.estimate.estimate`` (no fixed overheads) of the matching ``ModelSpec`` and
workload: parameters, gradients, optimizer states, saved activations, and the phase peaks of
step 1 and of the steady state.

A precision recipe is a parameter (``RECIPES``): ``fp32`` (fp32 weights, no autocast),
``bf16-pure`` (the model in bf16, AdamW on the bf16 parameters), ``amp-bf16`` (fp32 weights
under ``torch.autocast``, with CUDA's autocast rules, ``memplan.profile.cuda_rules``) and, for
torchtitan's FSDP2, ``fsdp-bf16`` (its default ``MixedPrecisionPolicy``).

Kernels a CPU build runs differently from CUDA are swapped for the CUDA kernel while tracing
(``memplan.profile.cuda_rules.cuda_kernels``): ``F.rms_norm`` is ``_fused_rms_norm`` on CUDA
(input and an fp32 rstd saved) but a composite of upcast ops on CPU (the reference model's
``FusedRMSNorm`` saves what the CUDA kernel saves); ``F.dropout`` is ``native_dropout`` on CUDA
(a bool mask) but ``input * noise`` on CPU. The libraries' code is otherwise run as it is.

Buffers the model registers (RoPE tables) are device memory in every phase: they are counted
under their own category, ``buffers``, so the phase totals include them (memplan's
``StageMemory.buffers_bytes``). Tensors a loop keeps beyond the graph (litgpt's ``logits``)
are counted as ``held``, not as saved activations (memplan: the preset's ``logits_held``).

Fake tensors (``FakeTensorMode``) trace catalog widths without memory, but transformers takes
fake tensors for tracing (``transformers.utils.import_utils.is_tracing``): with ``use_cache``
off, ``masking_utils.find_packed_sequence_indices`` cannot say "not packed", so a 4-D mask is
built and SDPA repeats K/V for GQA, which a real unpacked batch never does.
``fake_real_check`` runs a case both ways; cases whose two runs differ run on real tensors at toy
width. MoE routing reads values, and torchtitan's ``trunc_normal_`` init too, so those run on
small real tensors; so does litgpt, set up by Lightning Fabric.

This module imports torch and the libraries; memplan's CLI never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memplan import api
from memplan.errors import MemplanError
from memplan.hardware import DEFAULT_GPU, load_gpu
from memplan.model.estimate import PHASES, estimate
from memplan.overheads import no_overheads
from memplan.parallel import ParallelConfig
from memplan.profile.compare import Comparison, Row, rows
from memplan.profile.offload import HostSaved, offload_layers
from memplan.profile.cuda_rules import autocast_rules, cuda_kernels
from memplan.profile.step import relabel_states
from memplan.profile.trace import StepMeasure, TraceResult
from memplan.profile.tracker import HostCategories, MemoryTracker, inductor_buffers_seen
from memplan.spec import ModelSpec, spec_from_hf_dict
from memplan.workload import Precision, Workload

BUFFERS = "buffers"  # registered buffers (RoPE tables): memplan's StageMemory.buffers_bytes
HELD = "held"  # tensors a training loop keeps beyond the graph (litgpt's `logits` variable)
LIBRARIES = ("transformers", "torchtitan", "litgpt")


# --- precision recipes ---------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """How a library holds and computes the model: the weights' dtype, autocast's dtype (None:
    no autocast) and the memplan precision that describes it."""

    name: str
    weights: torch.dtype
    autocast: torch.dtype | None = None

    @property
    def available(self) -> bool:
        """Whether memplan's workload has this precision."""
        return self.name in {p.value for p in Precision}


RECIPES = {
    "fp32": Recipe("fp32", torch.float32),
    "bf16-pure": Recipe("bf16-pure", torch.bfloat16),
    "amp-bf16": Recipe("amp-bf16", torch.float32, torch.bfloat16),
    # torchtitan's FSDP2 default: fp32 shards, MixedPrecisionPolicy(bf16 params, fp32 reduce)
    "fsdp-bf16": Recipe("fsdp-bf16", torch.float32),
}


def recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise MemplanError(f"recipe must be one of {', '.join(RECIPES)}, got {name!r}") from None


# --- what a traced library model is --------------------------------------------------------

Mark = Callable[[str], None]
StepFn = Callable[[int, Mark], None]


@dataclass
class Built:
    """A library model ready to step: its parameters, the step its loop runs, the ModelSpec
    and workload fields memplan describes it with, and the context the steps run in."""

    library: str
    model: torch.nn.Module
    spec: ModelSpec
    layout: ParallelConfig
    workload: dict[str, Any]  # memplan workload fields (kernels, recipe, batch)
    step: StepFn  # step(k, mark): one training step; mark(phase) at each phase change
    optimizer: torch.optim.Optimizer | None = None
    context: Callable[[MemoryTracker], contextlib.AbstractContextManager] | None = None
    host: Any = None  # what the step put in host memory (``memplan.profile.offload``)
    frozen: list[torch.Tensor] = field(default_factory=list)  # weights that do not train


@dataclass(frozen=True)
class FrameworkCase:
    """One library model and step: ``config`` is the library's own configuration (a
    ``config.json`` dict for transformers, keyword fields for torchtitan and litgpt), ``options``
    the library's loop choices (see each builder)."""

    library: str
    name: str
    config: dict[str, Any]
    recipe: str = "fp32"
    micro_batch_size: int = 1
    seq_len: int = 64
    fake: bool = False
    dp: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    tp: int = 1

    @property
    def id(self) -> str:
        extra = "-".join(f"{k}={v}" for k, v in self.options.items())
        return (f"{self.library}-{self.name}-{self.recipe}-b{self.micro_batch_size}"
                f"-s{self.seq_len}" + (f"-dp{self.dp}" if self.dp > 1 else "")
                + ("-fake" if self.fake else "-real") + (f"-{extra}" if extra else ""))


# --- tracing -------------------------------------------------------------------------------

class LibraryTracker(MemoryTracker):
    """The exact tracker with the parallel tracer's categories (FSDP2's gathered weights) and
    registered buffers."""

    def __init__(self) -> None:
        from memplan.profile.distributed import BUCKETS, GATHERED, ParallelTracker

        super().__init__()
        self.by_category.update({GATHERED: 0, BUCKETS: 0, BUFFERS: 0, HELD: 0})
        # ParallelTracker's resync follows FSDP2's storage resizes; borrow it.
        self.resync = ParallelTracker.resync.__get__(self)


class CompiledLibraryTracker(LibraryTracker):
    """``LibraryTracker`` for a library model with torch.compile'd modules (real tensors):
    on while the compiled code runs, off while it compiles, as ``memplan.profile.tracker.
    CompiledTracker``."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def unreachable_freed(self) -> None:
        """Free the forward's unreachable reference cycles before the saved bytes are read:
        with the layers compiled, transformers 5.23's position ids (``torch.arange(...) +
        past_seen_tokens``: MixtralModel.forward, Qwen3MoeModel.forward; 512 B at the MoE
        toys) are at times left in a cycle the collector has not yet run on when backward
        starts (traced: in 7 of 8 steps, gone after ``gc.collect()``), which no backward
        reads: the saved bytes would vary from run to run."""
        gc.collect()


@contextlib.contextmanager
def _compiled_step(compiled: bool) -> Iterator[None]:
    """A compiled case's trace: Dynamo's caches reset around it, no on-disk cache (whose hit
    would skip the rerouting of Inductor's buffers), Inductor's buffers made through aten."""
    if not compiled:
        yield
        return
    torch._dynamo.reset()
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False), inductor_buffers_seen():
            yield
    finally:
        torch._dynamo.reset()


class HostLibraryTracker(HostCategories, LibraryTracker):
    """``LibraryTracker`` for FSDP2's ``CPUOffloadPolicy`` on a CPU-only build: the totals
    count the device alone, as ``memplan.profile.distributed.HostOffloadTracker`` does (the
    sharded weights, their gradients and the optimizer's states and step are host memory)."""


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def run_library_steps(built: Built, tracker: LibraryTracker, *, steps: int = 2) -> TraceResult:
    """Run ``steps`` of the library's step under ``tracker``: the same quantities as
    ``memplan.profile.trace.run_steps`` (gradients at the optimizer step's start, optimizer
    states after it, what forward left alive for backward, phase peaks)."""
    model = built.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    handles = []
    with tracker, (built.context(tracker) if built.context else contextlib.nullcontext()):
        tracker.register(params + built.frozen, "parameters")
        tracker.register(list(model.buffers()), BUFFERS)
        handles = [p.register_post_accumulate_grad_hook(
            lambda q: tracker.relabel(q.grad, "gradients")) for p in params]
        result = TraceResult(spec=built.spec, params_bytes=tracker.bytes_in("parameters"))
        for k in range(1, steps + 1):
            seen: dict[str, int] = {}

            def mark(phase: str, seen: dict[str, int] = seen) -> None:
                tracker.set_phase(phase)
                if phase == "backward":
                    if isinstance(tracker, CompiledLibraryTracker):
                        tracker.unreachable_freed()
                    seen["saved"] = tracker.bytes_in("activations")
                elif phase == "optimizer":
                    seen["grads"] = tracker.bytes_in("gradients")

            tracker.set_phase("forward", step=k)
            built.step(k, mark)
            if built.optimizer is not None:
                relabel_states(tracker, built.optimizer)
            tracker.set_phase("optimizer")
            result.steps.append(StepMeasure(
                step=k, phases={ph: tracker.peak(k, ph) for ph in PHASES},
                saved_activations_bytes=seen["saved"], grads_bytes=seen["grads"],
                optimizer_bytes=tracker.bytes_in("optimizer")))
    for h in handles:
        h.remove()
    return result


def make_workload(built: Built) -> Workload:
    """The memplan workload a built library model is estimated with: its framework's preset
    (``memplan.presets``) and the knobs the case sets."""
    fields = dict(built.workload)
    if (built.library == "transformers" and fields.get("compile")
            and fields.get("recompute") == "full"):
        # ``build_hf`` compiles each decoder layer (``layer.compile``) and turns on
        # transformers' gradient checkpointing, whose GradientCheckpointingLayer.__call__
        # checkpoints ``nn.Module.__call__`` (transformers/modeling_layers.py), which runs the
        # layer's compiled call: the checkpoint around the compiled layer
        fields.setdefault("compile_in_checkpoint", True)
    return api.resolve(built.spec, gpus=built.layout.world_size, zero=int(built.layout.zero),
                       **fields)[2]


def compare_built(built: Built, trace: TraceResult) -> Comparison:
    """The library's trace next to ``estimate`` of its spec, layout and workload."""
    wl = make_workload(built)
    est = estimate(built.spec, load_gpu(DEFAULT_GPU), built.layout, wl, overheads=no_overheads())
    return Comparison(built.spec, built.layout, wl, rows(trace, est.stages[0]), trace, est)


BUILDERS: dict[str, Callable[[FrameworkCase], Built]] = {}


def trace_case(case: FrameworkCase, *, fake: bool | None = None,
               steps: int = 2) -> tuple[Built, TraceResult]:
    """Build ``case`` with its library (on fake tensors when ``fake``, default the case's) and
    trace ``steps`` training steps."""
    fake = case.fake if fake is None else fake
    builder = BUILDERS[case.library]
    group = (_process_group(case.dp * case.tp)
             if case.dp > 1 or case.library == "torchtitan" else contextlib.nullcontext())
    rules = autocast_rules() if recipe(case.recipe).autocast else cuda_kernels()
    compiled = bool(case.options.get("compile") or case.options.get("compile_loss"))
    if compiled and fake:
        raise MemplanError(f"{case.id}: a compiled case runs Inductor's code on real tensors")
    with group, _fake_mode() if fake else contextlib.nullcontext(), rules, \
            _compiled_step(compiled):
        torch.manual_seed(0)
        built = builder(case)
        from memplan.parallel import Offload

        host = Offload.PARAMS in built.layout.offload
        tracker = (HostLibraryTracker() if host else CompiledLibraryTracker() if compiled
                   else LibraryTracker())
        return built, run_library_steps(built, tracker, steps=steps)


TraceFn = Callable[..., tuple[Any, TraceResult]]


def compare_framework(case: FrameworkCase, *, fake: bool | None = None,
                      steps: int = 2, trace: TraceFn | None = None) -> Comparison:
    """Trace ``case`` and compare it with memplan's estimate. Raises ``MemplanError`` when the
    recipe is not a memplan precision. ``trace`` stands in for ``trace_case`` (the same
    arguments; its first value needs only the ``Built`` fields ``compare_built`` reads: a
    kept trace, tests/traced/recorded.py)."""
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (first step and steady state), got {steps}")
    rec = recipe(case.recipe)
    if not rec.available:
        raise MemplanError(f"precision {rec.name!r} is not in memplan's workload yet")
    built, result = (trace or trace_case)(case, fake=fake, steps=steps)
    return compare_built(built, result)


def fake_real_check(case: FrameworkCase, steps: int = 2,
                    trace: TraceFn | None = None) -> list[Row]:
    """The same case on fake and on real tensors: one row per traced quantity (measured: real,
    estimated: fake). Every diff zero means fake tensors trace this library faithfully.
    ``trace``: as ``compare_framework``'s."""
    _, real = (trace or trace_case)(case, fake=False, steps=steps)
    _, fake = (trace or trace_case)(case, fake=True, steps=steps)
    out = [Row("params_bytes", real.params_bytes, fake.params_bytes)]
    for label, r, f in (("first_step", real.first, fake.first),
                        ("steady", real.steady, fake.steady)):
        out += [Row(f"{label}.grads_bytes", r.grads_bytes, f.grads_bytes),
                Row(f"{label}.optimizer_bytes", r.optimizer_bytes, f.optimizer_bytes),
                Row(f"{label}.activations_bytes", r.saved_activations_bytes,
                    f.saved_activations_bytes)]
        out += [Row(f"{label}.{ph}_bytes", r.phases[ph].total_bytes, f.phases[ph].total_bytes)
                for ph in PHASES]
    return out


@contextlib.contextmanager
def _process_group(dp: int) -> Iterator[None]:
    """Rank 0 of ``dp`` ranks on torch's fake process group (collectives return at once, every
    tensor has the shape and dtype it has on a real rank), as memplan's parallel tracer does."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise MemplanError("a process group is already initialised")
    # DTensor's C++ sharding-propagation cache keeps output specs with their mesh: an earlier
    # case's mesh (its group destroyed) would be handed to this one's, which Dynamo meets in
    # a compiled loss (graph break in from_local, "Group ... is not registered")
    torch._C._clear_DTensor_sharding_propagator_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _autocast(rec: Recipe):
    """Autocast as the recipe asks, around what the library runs under it. CUDA's op lists
    apply through ``autocast_rules``, which ``trace_case`` keeps on for the whole step (a
    checkpointed region's rerun in backward autocasts again)."""
    if rec.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=rec.autocast)


def _fused_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)


# --- Hugging Face transformers -------------------------------------------------------------

def hf_spec(config, name: str) -> ModelSpec:
    """memplan's spec of a transformers model, from its ``config.to_dict()``."""
    return spec_from_hf_dict(config.to_dict(), f"transformers {name}", name)


def build_hf(case: FrameworkCase) -> Built:
    """``AutoModelForCausalLM.from_config`` of a ``config.json`` dict with SDPA attention, in
    the recipe's dtype, stepped as ``transformers.Trainer.training_step`` does: the model's own
    loss (``labels=input_ids``: ``ForCausalLMLoss`` shifts them and upcasts the logits to
    fp32), the output dropped before backward (``compute_loss`` returns the loss alone), then
    ``clip_grad_norm_(max_norm=1.0)``, ``optimizer.step()`` and ``zero_grad(set_to_none=True)``.

    options: ``attn`` (``"sdpa"``, default, or ``"eager"``), ``keep_output`` (True: the loop
    holds the model's output, logits included, through backward), ``offload``
    (``"activations"``: the decoder layers' saved tensors packed to the host as
    ``save_on_cpu`` does, ``memplan.profile.offload``; estimated with ``offload``),
    ``recompute`` (``"full"``: ``gradient_checkpointing_enable``, non-reentrant), ``fsdp1``
    (with ``dp`` > 1: ``FullyShardedDataParallel`` as Accelerate's FSDP1 plugin wraps it,
    ``_fsdp1_wrap``; the dict's keys are workload fields, e.g. ``backward_prefetch``),
    ``moe_impl`` (a ``Workload.moe_impl`` the estimate takes in place of the preset's default:
    the experts' implementation the installed transformers runs where it is not the
    current one's, e.g. ``"parallel"`` for transformers 5.3's Granite MoE),
    ``compile`` (True: each decoder layer compiled on its own with Inductor, as
    ``memplan.profile.finetune`` compiles them; no key/value cache)."""
    from transformers import AutoModelForCausalLM

    from memplan.profile.hf_meta import config_for_model

    rec = recipe(case.recipe)
    config = config_for_model(case.config)
    attn = case.options.get("attn", _default_attention(AutoModelForCausalLM, config))
    model = AutoModelForCausalLM.from_config(config, dtype=rec.weights, attn_implementation=attn)
    spec = _router_dtype(model, hf_spec(model.config, case.name))
    fsdp1 = case.options.get("fsdp1")
    if fsdp1 is not None:
        model = _fsdp1_wrap(model, case, fsdp1)
    opt = _fused_adamw([p for p in model.parameters() if p.requires_grad])
    b, s, vocab = case.micro_batch_size, case.seq_len, model.config.vocab_size
    keep = case.options.get("keep_output", False)
    offload = case.options.get("offload", "none")
    recompute = case.options.get("recompute", "none")
    if recompute == "full":  # Trainer's gradient_checkpointing=True, non-reentrant
        model.gradient_checkpointing_enable({"use_reentrant": False})
    compiled = bool(case.options.get("compile"))
    if compiled:  # each layer on its own (torchtitan's apply_compile; finetune.build_peft)
        model.config.use_cache = False
        for layer in model.model.layers:
            layer.compile(backend="inductor")
    save = case.options.get("recompute_save", "")
    experts = ({"moe_impl": case.options["moe_impl"]} if "moe_impl" in case.options
               else _grouped_gather(spec))
    if recompute == "ops":  # the emitted torch policy, as gradient_checkpointing_kwargs
        _emitted_checkpointing(model, spec, rec.name, b, s, save,
                               {**experts, "attention": "flash" if attn == "sdpa" else "eager",
                                **_mamba_kernel(model)})
    host = HostSaved()
    def offloading() -> contextlib.AbstractContextManager:
        if "activations" not in offload:
            return contextlib.nullcontext()
        base = model.base_model  # the decoder layers: ``layers`` (Llama, Qwen, ...), ``h`` (GPT-2)
        return offload_layers(getattr(base, "layers", None) or base.h, host)

    def step(k: int, mark: Mark) -> None:
        ids = torch.randint(0, vocab, (b, s))
        host.host_bytes = 0
        with _autocast(rec), offloading():
            out = model(input_ids=ids, labels=ids)
        loss = out.loss
        if not keep:
            del out
        mark("backward")
        loss.backward()
        del loss
        mark("optimizer")
        if fsdp1 is not None:  # Accelerator.clip_grad_norm_ on FSDP1: the module's own
            model.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    # described by the framework and the knobs a user sets: the recipe, the batch, the
    # attention implementation (memplan.presets has what transformers runs)
    workload = dict(framework="hf", micro_batch_size=b, seq_len=s, precision=rec.name,
                    attention="flash" if attn == "sdpa" else "eager",
                    **({"recompute": recompute} if recompute != "none" else {}),
                    **({"recompute_save": save} if recompute == "ops" else {}),
                    **({"fsdp_version": 1, **fsdp1} if fsdp1 is not None else {}),
                    **experts,
                    **({"compile": True, "kv_cache": False} if compiled else {}),
                    **_deltanet_kernel(model), **_mamba_kernel(model), **_mla_cache(model))
    # the config's use_cache reaches the estimate through the spec (the hf preset's kv_cache)
    layout = (api.make_layout(case.dp, zero=3) if fsdp1 is not None
              else api.make_layout(1, offload=offload))
    context = None
    if fsdp1 is not None:
        from memplan.profile.fsdp1 import follow_flat_storage

        context = follow_flat_storage
    return Built("transformers", model, spec, layout, workload, step, opt, host=host,
                 context=context)


def _default_attention(auto: Any, config: Any) -> str:
    """SDPA, but eager for a model class that declares it does not support SDPA
    (``_supports_sdpa = False``: transformers 5.25's Gemma2PreTrainedModel, for its attention
    soft-capping), which transformers then refuses; 5.3 ran Gemma 2 on SDPA."""
    cls = auto._model_mapping.get(type(config), None)
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"


def _deltanet_kernel(model: torch.nn.Module) -> dict[str, str]:
    """The kernels the model's gated DeltaNet layers run (Qwen3NextGatedDeltaNet.
    chunk_gated_delta_rule: fla's when installed, else transformers' torch fallback, which
    every CPU trace runs); nothing for a model without them. transformers' torch fallback
    is "torch" as written up to 5.16 (a forward substitution loop), "torch-solve" as
    rewritten from 5.17 on (``torch.linalg.solve_triangular``), told apart by its source."""
    for module in model.modules():
        rule = getattr(module, "chunk_gated_delta_rule", None)
        if rule is not None:
            torch_path = getattr(rule, "__name__", "") == "torch_chunk_gated_delta_rule"
            return {"deltanet_kernel": _torch_rule(rule) if torch_path else "fla"}
        if type(module).__name__.endswith("GatedDeltaNet"):
            # from 5.15 on the layer calls the module-level ``torch_chunk_gated_delta_rule``,
            # which ``use_kernel_func_from_hub_with_fallback`` swaps for fla's kernel only
            # where fla supports the tensors' device: on CPU (every trace) the torch path runs
            on_cpu = all(p.device.type in ("cpu", "meta") for p in module.parameters())
            rule = getattr(sys.modules[type(module).__module__],
                           "torch_chunk_gated_delta_rule", None)
            return {"deltanet_kernel": _torch_rule(rule) if on_cpu else "fla"}
    return {}


def _grouped_gather(spec: ModelSpec) -> dict[str, str]:
    """How the installed transformers' grouped experts gather the routed rows, for a model
    the hf preset runs on them (``presets``: all MoE but Llama 4's every-expert block):
    "grouped-token" where ``grouped_mm_experts_forward`` gathers by token and then copies
    the rows sorted (transformers 5.3), nothing where it sorts first and gathers once (5.23,
    the preset's ``grouped``)."""
    if spec.moe is None or spec.moe.every_expert:
        return {}
    return {"moe_impl": "grouped-token"} if gathers_by_token() else {}


def gathers_by_token() -> bool:
    """Whether the installed transformers' grouped experts (``integrations/moe.py
    grouped_mm_experts_forward``) gather the routed rows by token before a sorted copy
    (``token_idx`` in its source: 5.3, memplan's ``grouped-token``), not once in sorted
    order (5.23, ``grouped``)."""
    from transformers.integrations import moe

    forward = getattr(moe, "grouped_mm_experts_forward", None)
    return forward is not None and "token_idx" in inspect.getsource(forward)


def _router_dtype(model: torch.nn.Module, spec: ModelSpec) -> ModelSpec:
    """``spec`` with the installed router's top-k weight dtype: transformers 5.23's Qwen-style
    TopKRouter casts them to ``router_logits.dtype``, the linear's output (the readers'
    ``router_weights_cast``), where 5.3's rebound ``router_logits`` to the fp32 softmax
    first, leaving them fp32."""
    if spec.moe is None or not spec.moe.router_weights_cast:
        return spec
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            source = inspect.getsource(type(module).forward)
            if ("router_top_value.to(router_logits.dtype)" in source
                    and "router_logits = torch.nn.functional.softmax" in source):
                moe = spec.moe.model_copy(update={"router_weights_cast": False})
                return spec.model_copy(update={"moe": moe})
            break
    return spec


def _mla_cache(model: torch.nn.Module) -> dict[str, str]:
    """What the model's latent attention caches in a training forward: "expanded" where
    DeepseekV3Attention hands the cache its expanded key and value (transformers 5.3),
    nothing (the default, "latent") where it caches the latents and rebuilds them
    (``expand_kv``, 5.23); nothing for a model without it."""
    for module in model.modules():
        if type(module).__name__ == "DeepseekV3Attention":
            return {} if hasattr(module, "expand_kv") else {"mla_cache": "expanded"}
    return {}


def _mamba_kernel(model: torch.nn.Module) -> dict[str, str]:
    """How the model's Mamba2 layers (Granite 4.0-H's, Falcon-H1's mixers) run without
    mamba_ssm (every CPU trace): "torch" where the layer's ``torch_forward`` is transformers
    5.3's naive scan, "torch-einsum" where its module scans through ``mamba2_chunk_scan``
    (5.23); nothing for a model without them."""
    for module in model.modules():
        if type(module).__name__.endswith("MambaLayer") or \
                type(module).__name__ == "FalconH1Mixer":
            source = sys.modules[type(module).__module__]
            return {"mamba_kernel": "torch-einsum" if hasattr(source, "mamba2_chunk_scan")
                    else "torch"}
    return {}


def _torch_rule(rule: Any) -> str:
    """"torch-solve" where transformers' ``torch_chunk_gated_delta_rule`` solves the chunks'
    triangular systems with ``torch.linalg.solve_triangular`` (5.17 on), else "torch"."""
    try:
        source = inspect.getsource(inspect.unwrap(rule))
    except (TypeError, OSError):
        return "torch"
    return "torch-solve" if "solve_triangular" in source else "torch"


def _emitted_checkpointing(model, spec: ModelSpec, precision: str, b: int, s: int,
                           save: str, experts: dict[str, str]) -> None:
    """``gradient_checkpointing_enable`` with the policy ``memplan estimate --emit-policy
    torch`` prints for ``save`` (``memplan.profile.sac_policy``), for the experts'
    implementation and attention the estimate takes (``experts``: by default the installed
    transformers' grouped experts, ``_grouped_gather``, whose gathers are ops the policy
    counts; ``attention``: eager's core ops are counted, SDPA's kernel is one): each
    decoder layer's checkpoint gets a fresh policy (``make_policy_fn``), its counters its
    own."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from memplan.profile.sac_policy import emitted_module

    wl = api.resolve(spec, framework="hf", micro_batch_size=b, seq_len=s, precision=precision,
                     recompute="ops", recompute_save=save, **experts)[2]
    module = emitted_module(spec, wl)
    make = module["make_policy_fn"]
    model.gradient_checkpointing_enable({
        "use_reentrant": False,
        "context_fn": lambda: create_selective_checkpoint_contexts(make())})
    if module["LAYER_COUNTS"] or module["LAYER_SAVE"]:
        # layers that differ (dense and MoE layers): each decoder layer its own policy,
        # by index (the emitted layer_policy_fn), for its checkpoint function
        from torch.utils.checkpoint import checkpoint

        # (Llama4ForCausalLM's base_model_prefix, language_model, names no attribute: its
        # base_model is the model itself, its decoder in ``model``)
        base = model.base_model if hasattr(model.base_model, "layers") else model.model
        for i, layer in enumerate(base.layers):
            layer._gradient_checkpointing_func = functools.partial(
                checkpoint, use_reentrant=False, context_fn=lambda i=i: (
                    create_selective_checkpoint_contexts(module["layer_policy_fn"](i))))


def _fsdp1_wrap(model, case: FrameworkCase, fields: dict[str, Any]) -> torch.nn.Module:
    """``FullyShardedDataParallel`` as accelerate 1.15.0's ``Accelerator.prepare_model`` builds
    it for FSDP1 with the hf preset's defaults (``memplan.presets``): every decoder layer a unit
    (``transformer_cls_names_to_wrap`` from ``_no_split_modules``), FULL_SHARD, no backward
    prefetch, ``use_orig_params`` (the Trainer's), ``limit_all_gathers``; ``fields`` override
    (workload fields: ``backward_prefetch``, ``use_orig_params``); ``fsdp-bf16``:
    ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``."""
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    base = model.base_model
    layers = getattr(base, "layers", None) or base.h
    prefetch = {"pre": "BACKWARD_PRE", "post": "BACKWARD_POST", "none": None}[
        fields.get("backward_prefetch", "none")]
    mp = (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if case.recipe == "fsdp-bf16" else None)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}),
        device_id=torch.device("cpu"), mixed_precision=mp,
        backward_prefetch=BackwardPrefetch[prefetch] if prefetch else None,
        use_orig_params=fields.get("use_orig_params", True), limit_all_gathers=True)


BUILDERS["transformers"] = build_hf


# --- torchtitan ------------------------------------------------------------------------------

def torchtitan_config(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                      vocab_size: int, seq_len: int, multiple_of: int = 256,
                      ffn_dim_multiplier: float | None = None, fuse_qkv: bool = True):
    """A ``Llama3Model.Config`` built the way ``torchtitan.models.llama3`` builds its flavors
    (``_build_llama3_layers``, ``compute_ffn_hidden_dim``, llama-scaled ComplexRoPE), with the
    SDPA attention backend (flex attention needs compile) and RoPE's cache cut to the training
    sequence, as ``Decoder.Config.update_from_config`` does from ``training.seq_len``."""
    from torchtitan.models import llama3
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention

    init = llama3._EMBEDDING_INIT
    cfg = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init=init),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size,
                              param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=fuse_qkv, n_layers=n_layers, dim=dim, n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=multiple_of,
                                              ffn_dim_multiplier=ffn_dim_multiplier),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=seq_len, theta=500000,
                                    scaling="llama"),
            attn_backend="flex"))
    # 0.3.0's get_attention_config refuses "sdpa" for language models; its SDPA module is
    # still there and is what runs without compile (flex attention needs it).
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def torchtitan_spec(cfg, name: str) -> ModelSpec:
    """memplan's spec of a torchtitan Llama3 config (Llama's field names)."""
    attn = cfg.layers[0].attention
    ffn = cfg.layers[0].feed_forward
    hidden = ffn.w1.out_features if hasattr(ffn, "w1") else _ffn_hidden(ffn)
    data = {"model_type": "llama", "hidden_size": cfg.dim, "num_hidden_layers": len(cfg.layers),
            "num_attention_heads": attn.n_heads, "num_key_value_heads": attn.n_kv_heads,
            "intermediate_size": hidden, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": attn.rope.max_seq_len, "hidden_act": "silu",
            "tie_word_embeddings": cfg.enable_weight_tying}
    # FusedQKVLinear (models/common/attention.py): one wqkv parameter; QKVLinear: wq, wk, wv
    qkv = getattr(attn, "qkv_linear", None)
    fused = qkv is None or type(qkv).__qualname__.startswith("FusedQKVLinear")
    return spec_from_hf_dict(data, f"torchtitan {name}", name).model_copy(
        update={"fused_qkv": fused})


def _ffn_hidden(ffn) -> int:
    for f in dataclasses.fields(ffn):
        value = getattr(ffn, f.name)
        if hasattr(value, "out_features"):
            return value.out_features
    raise MemplanError("torchtitan feed-forward config: no hidden width found")


def torchtitan_moe_config(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                          head_dim: int, vocab_size: int, seq_len: int, moe_hidden_dim: int,
                          num_experts: int, top_k: int, shared_hidden_dim: int = 0):
    """A ``Qwen3Model.Config`` of MoE blocks built the way ``torchtitan.models.qwen3`` builds
    its MoE flavors (``_build_qwen3_moe_layers``: softmax router with route_norm, GroupedExperts,
    the local token dispatcher, CosSinRoPE) with the SDPA attention, RoPE's cache cut to the
    training sequence, routing held balanced by the router's own ``_debug_force_load_balance``
    (round-robin expert ids, ``_debug_force_load_balance_routing``: every expert T k / E rows,
    a deterministic trace). ``shared_hidden_dim``: a shared expert (torchtitan's
    ``FeedForward`` of that width, ``make_ffn_config``, as DeepSeek-V3's flavors add it),
    which ``MoE.forward`` runs after the routed experts."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config

    cfg = qwen3.Qwen3Model.Config(
        vocab_size=vocab_size, dim=dim, norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size,
                              param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, moe_hidden_dim=moe_hidden_dim, num_experts=num_experts,
            top_k=top_k, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=1000000.0)))
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.moe.router._debug_force_load_balance = True
        if shared_hidden_dim:
            layer.moe.shared_experts = make_ffn_config(
                dim=dim, hidden_dim=shared_hidden_dim, w1_param_init=qwen3._LINEAR_INIT,
                w2w3_param_init=qwen3._LINEAR_INIT)
    return cfg


def torchtitan_moe_spec(cfg, name: str) -> ModelSpec:
    """memplan's spec of a torchtitan Qwen3 MoE config (``torchtitan_moe_config``; Qwen3-MoE's
    field names): its stacked GroupedExperts, a shared expert run after them
    (``MoE.forward``: ``out_BLD + shared_out_BLD``) where the config has one, and the top-k
    weights left in the router's fp32 (``TokenChoiceTopKRouter.forward`` casts nothing)."""
    attn, moe = cfg.layers[0].attention, cfg.layers[0].moe
    experts = moe.routed_experts.inner_experts
    data = {"model_type": "qwen3_moe", "hidden_size": cfg.dim,
            "num_hidden_layers": len(cfg.layers), "num_attention_heads": attn.n_heads,
            "num_key_value_heads": attn.n_kv_heads, "head_dim": attn.head_dim,
            "moe_intermediate_size": experts.hidden_dim, "intermediate_size": experts.hidden_dim,
            "num_experts": experts.num_experts, "num_experts_per_tok": moe.router.top_k,
            "norm_topk_prob": moe.router.route_norm, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": attn.rope.max_seq_len, "hidden_act": "silu",
            "tie_word_embeddings": cfg.enable_weight_tying}
    spec = spec_from_hf_dict(data, f"torchtitan {name}", name)
    update: dict[str, Any] = {"router_weights_cast": False, "split_gate_up": True}
    if moe.shared_experts is not None:
        update |= {"num_shared_experts": 1, "shared_experts_last": True,
                   "shared_expert_ffn_hidden_size": moe.shared_experts.w1.out_features}
    # FusedQKVLinear (models/common/attention.py; make_gqa_config's fuse_qkv): one wqkv
    qkv = getattr(attn, "qkv_linear", None)
    fused = qkv is None or type(qkv).__qualname__.startswith("FusedQKVLinear")
    return spec.model_copy(update={"moe": spec.moe.model_copy(update=update),
                                   "fused_qkv": fused})


def _titan_router_fp32(model) -> None:
    """Each MoE router's gate as CUDA runs it: ``TokenChoiceTopKRouter.forward`` calls it
    under ``torch.autocast(dtype=torch.float32)``, which CUDA's autocast honours (linear
    casts its input and weight to fp32, both saved) and CPU's disables with a warning
    (bf16 or fp16 only), so on CPU the gate runs as CUDA's autocast would run it."""
    import torch.nn.functional as F

    for name, module in model.named_modules():
        if name.endswith("router.gate"):
            gate = module

            def forward(x, gate=gate):
                bias = None if gate.bias is None else gate.bias.float()
                return F.linear(x.float(), gate.weight.float(), bias)

            gate.forward = forward


def build_torchtitan(case: FrameworkCase) -> Built:
    """torchtitan's Llama3 (``Llama3Model``), parallelised by its own ``parallelize_llama``
    (FSDP2 through ``apply_fsdp_to_decoder``: the embedding, [final norm, head] and each block a
    unit, its default ``MixedPrecisionPolicy``) on ``dp`` ranks of the fake process group
    (torchtitan's ``ParallelDims`` meshes, on device cpu), stepped as ``Trainer.train_step``
    does: ``pred = model(inputs)``, its ``cross_entropy_loss`` (``pred.float()``, sum reduction)
    divided by the token count, ``del pred``, ``loss.backward()``, its ``clip_grad_norm_``,
    ``optimizers.step()``; ``zero_grad`` before the next step with ``set_to_none`` (option
    ``set_to_none``: True, as with ``training.disable_cuda_graphs``; torchtitan's default keeps
    the zeroed gradients).

    options: ``set_to_none`` (default True), ``ac`` (``"none"``, default; ``"full"`` or
    ``"selective"``: torchtitan's own activation checkpointing, estimated as memplan's full or
    selective recompute, the latter as its per-op SAC under the torchtitan preset; a number n:
    v0.2.2's every-n-th-block AC, ``_layer_sac``, estimated as full recompute of every n-th
    layer). Its save
    list lacks CPU's SDPA kernel, which joins it while tracing (``_sac_saves_cpu_flash``), as
    a GPU's SDPA kernel is in it.

    Real tensors only: ``torch.nn.init.trunc_normal_`` (its parameter init) reads values.
    ``dp`` 1 runs on a one-rank fake process group: ``apply_fsdp_to_decoder`` shards even
    one rank (its gathered units and unsharded gradients exist at shard degree 1)."""
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.components.loss import CrossEntropyLoss, cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.qwen3 import parallelize_qwen3

    rec = recipe(case.recipe)
    if rec.name not in ("fp32", "fsdp-bf16"):
        raise MemplanError("torchtitan: recipe fp32 or fsdp-bf16 (fp32 shards, its default)")
    moe = "num_experts" in case.config  # torchtitan's Qwen3 MoE flavour
    if moe:
        cfg = torchtitan_moe_config(**case.config, seq_len=case.seq_len)
        spec = torchtitan_moe_spec(cfg, case.name)
    else:
        cfg = torchtitan_config(**case.config, seq_len=case.seq_len)
        spec = torchtitan_spec(cfg, case.name)
    sp = case.options.get("sp", True)
    float8 = case.options.get("float8", "none")
    if case.tp > 1 and float8 == "rowwise":
        _float8_configs(cfg, float8)
    if case.tp > 1 and float8 == "tensorwise":  # the root's configs only (_float8_tp_plan)
        from torchtitan.models.common.decoder_sharding import set_decoder_sharding_config

        set_decoder_sharding_config(cfg, enable_sp=sp)
    elif case.tp > 1:  # Llama3Model.Config.update_from_config, as the Trainer calls it
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(cfg, enable_sp=sp)
    if case.tp > 1:  # the Trainer's: the loss reads it for the vocabulary-parallel logits
        dist_utils.set_spmd_backend("partial_dtensor")
    with torch.device("cpu"):
        model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    if moe:
        _titan_router_fp32(model)
    if float8 != "none" and not (case.tp > 1 and float8 == "rowwise"):
        _float8(model, float8, case.options.get("float8_all_gather", False))
    if case.tp > 1 and float8 == "tensorwise":
        _float8_tp_plan(model, sp)
    ac = case.options.get("ac", "none")
    every = int(ac) if ac.isdigit() else None
    if every is not None:  # before parallelize_llama: its AC would come before FSDP too
        _layer_sac(model, every)
    save = case.options.get("recompute_save", "")
    if ac == "ops":  # the emitted torch policy on each block, before FSDP as torchtitan's AC
        _emitted_block_sac(model, spec, rec.name, case.micro_batch_size, case.seq_len, save)
    ac_config = _torchtitan_ac("none" if every is not None or ac == "ops" else ac)
    precision = "bfloat16" if rec.name == "fsdp-bf16" else "float32"
    # option ``compile``: compile.components "model", each block compiled whole
    # (distributed/compile.py apply_compile, fullgraph, capture_scalar_outputs)
    model_compile = (CompileConfig(enable=True, components=["model"])
                     if case.options.get("compile") else CompileConfig())
    training = TrainingConfig(local_batch_size=case.micro_batch_size, seq_len=case.seq_len,
                              mixed_precision_param=precision)
    # "partial_dtensor": DTensor for model-parallel axes only, FSDP2 on plain modules (the
    # default "spmd_types" path expects the Trainer to have distributed every module first)
    parallelism = ParallelismConfig(data_parallel_shard_degree=case.dp,
                                    tensor_parallel_degree=case.tp,
                                    enable_sequence_parallel=sp,
                                    spmd_backend="partial_dtensor")
    device_type = pd.device_type
    pd.device_type = "cpu"  # torchtitan falls back to "cuda" when no accelerator is found
    try:
        dims = ParallelDims.from_config(parallelism, world_size=case.dp * case.tp)
        dims.build_mesh()
        sac = _sac_saves_cpu_flash() if ac == "selective" else contextlib.nullcontext()
        with sac:
            model = (parallelize_qwen3 if moe else parallelize_llama)(
                model, parallel_dims=dims, training=training, parallelism=parallelism,
                compile_config=model_compile, ac_config=ac_config, dump_folder="/tmp")
    finally:
        pd.device_type = device_type
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _fused_adamw(params)
    b, s = case.micro_batch_size, case.seq_len
    set_to_none = case.options.get("set_to_none", True)

    chunks = case.options.get("loss_chunks", 1)
    # compile.components "loss": BaseLoss._maybe_compile wraps cross_entropy_loss in
    # torch.compile (the chunked wrapper's inner loss: each chunk's call compiled)
    compiled = (CompileConfig(enable=True, components=["loss"])
                if case.options.get("compile_loss") else None)
    chunked = _chunked_loss(model, chunks, compiled) if chunks > 1 else None
    whole = (CrossEntropyLoss.Config().build(compile_config=compiled)
             if compiled is not None and chunked is None else None)

    def step(k: int, mark: Mark) -> None:
        inputs = torch.randint(0, cfg.vocab_size, (b, s))
        labels = torch.randint(0, cfg.vocab_size, (b, s))
        pred = model(inputs)
        if whole is not None:  # Trainer._forward_backward_body with the compiled loss
            loss, _ = whole(pred, labels, torch.tensor(b * s))
        elif chunked is None:
            loss = cross_entropy_loss(pred, labels) / (b * s)
        else:  # Trainer._forward_backward_body with the registry's ChunkedLossWrapper
            loss, _ = chunked(pred, labels, torch.tensor(b * s))
            _relabel_held_reduce(model, state["tracker"])
        del pred
        mark("backward")
        loss.backward()
        del loss
        mark("optimizer")
        dist_utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        # train_step zeroes at its start; nothing runs between a step's optimizer and the
        # next step's zero_grad, so here it closes the step: the next forward phase starts
        # as memplan's does, with the gradients freed (or zeroed)
        opt.zero_grad(set_to_none=set_to_none)

    # nn.RMSNorm runs CUDA's fused kernel (cuda_kernels); the loss upcasts the logits
    # training.disable_cuda_graphs (set_to_none), a knob of the user's config
    workload = dict(framework="torchtitan", micro_batch_size=b, seq_len=s, precision=rec.name,
                    recompute="full" if every is not None else ac, keep_grads=not set_to_none)
    if every is not None:
        workload["recompute_every"] = every
    if moe:  # the qwen3 flavors' CosSinRoPE (models/qwen3/__init__.py)
        workload["rope_cache"] = "layer-cossin"
    if float8 != "none":
        workload["float8"] = float8
    if case.options.get("float8_all_gather", False):
        workload["float8_all_gather"] = True
    if ac == "ops":
        workload["recompute_save"] = save
    if chunks > 1:
        workload["loss_chunks"] = chunks
    if compiled is not None:
        workload["compile_loss"] = True
    if case.options.get("compile"):
        workload["compile"] = True
    from memplan.profile.distributed import _follow_fsdp_storage

    state: dict[str, Any] = {}

    @contextlib.contextmanager
    def follow(tracker: MemoryTracker) -> Iterator[None]:
        state["tracker"] = tracker
        with _follow_fsdp_storage(tracker):
            yield

    # FSDP2 frees and re-allocates its unsharded buffers with storage resizes no dispatch
    # mode sees; memplan's parallel tracer follows them (category "gathered")
    layout = api.make_layout(case.dp * case.tp, tp=case.tp, dp=case.dp, zero=3,
                             sequence_parallel=sp if case.tp > 1 else None,
                             tp_style="dtensor" if case.tp > 1 else None)
    return Built("torchtitan", model, spec, layout, workload, step, opt, context=follow)


def _float8_configs(cfg, recipe_name: str) -> None:
    """torchtitan 0.3.0's ``Float8LinearConverter.convert`` (components/quantization/
    float8.py) on the model config, before its sharding config is set (the registry's
    converters run when the model spec is made, ``update_from_config`` later): every block
    ``Linear.Config`` whose widths are multiples of 16 becomes a ``Float8Linear.Config``
    with ``Float8LinearConfig.from_recipe_name``, the head filtered (its llama3 float8
    configs' ``filter_fqns``). Its constructor refuses a CPU without ``emulate``, which would
    replace the recipe: the conversion is made here as it makes it."""
    from torchao.float8 import Float8LinearConfig
    from torchtitan.components.quantization.float8 import Float8Linear
    from torchtitan.models.common.linear import Linear

    config = Float8LinearConfig.from_recipe_name(recipe_name)
    for fqn, lin, parent, attr in list(cfg.traverse(Linear.Config)):
        if (lin.in_features % 16 or lin.out_features % 16 or "lm_head" in fqn
                or fqn == "output"):
            continue
        new = Float8Linear.Config(in_features=lin.in_features, out_features=lin.out_features,
                                  bias=lin.bias, param_init=lin.param_init,
                                  _torchao_config=config)
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)


def _float8_tp_plan(model, sp: bool) -> None:
    """torchtitan's tensor parallelism with float8 tensorwise linears, as its llama3
    ``apply_tp`` made it before 0.3.0 moved to dtype-agnostic sharding configs (commit
    bd6aec6, torchtitan/models/llama3/parallelize.py ``apply_tp`` with
    ``enable_float8_tensorwise_tp``; the December 2024 runs used the same styles with
    sequence parallelism always on, torchtitan/parallelisms/parallelize_llama.py): in each
    block torchao's ``PrepareFloat8ModuleInput`` on attention and feed-forward (the input
    cast to float8 before its all-gather), ``Float8ColwiseParallel`` on wq, wk, wv, w1, w3
    and ``Float8RowwiseParallel`` to the sequence layout on wo and w2 (torchao
    float8/float8_tensor_parallel.py); the norms ``SequenceParallel`` (``NoParallel``
    without SP). The colwise outputs are local tensors as in December 2024 (0.3.0's RoPE
    reads its cache as a plain tensor), the rowwise outputs DTensors as in bd6aec6 (the
    residual stream is one, from 0.3.0's embedding): a DTensor holds no storage of its own,
    so the bytes are the same either way. The embedding, final norm and
    head take 0.3.0's own sharding configs (``set_decoder_sharding_config``: the same
    layouts as that ``apply_tp``'s). It runs in place of the blocks' sharding configs, when
    ``parallelize_llama`` calls the model's ``parallelize``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )
    from torchtitan.distributed.tensor_parallel import NoParallel

    layout = Shard(1) if sp else Replicate()
    own = model.parallelize

    def norm():
        return SequenceParallel(use_local_output=False) if sp else NoParallel()

    def parallelize(parallel_dims) -> None:
        mesh = parallel_dims.get_mesh("tp")
        for block in model.layers.values():
            parallelize_module(block, mesh, {
                "attention_norm": norm(),
                "attention": PrepareFloat8ModuleInput(
                    input_layouts=(layout, None, None),
                    desired_input_layouts=(Replicate(), None, None)),
                "attention.qkv_linear.wq": Float8ColwiseParallel(),
                "attention.qkv_linear.wk": Float8ColwiseParallel(),
                "attention.qkv_linear.wv": Float8ColwiseParallel(),
                "attention.wo": Float8RowwiseParallel(output_layouts=layout,
                                                      use_local_output=False),
                "ffn_norm": norm(),
                "feed_forward": PrepareFloat8ModuleInput(
                    input_layouts=(layout,), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": Float8ColwiseParallel(),
                "feed_forward.w2": Float8RowwiseParallel(output_layouts=layout,
                                                         use_local_output=False),
                "feed_forward.w3": Float8ColwiseParallel()})
        own(parallel_dims)  # the root's configs; the blocks have none

    model.parallelize = parallelize


def _float8(model, recipe_name: str, all_gather: bool) -> None:
    """torchao's ``convert_to_float8_training`` on the model's linears as torchtitan's float8
    converter selects them (``components/quantization/utils.py`` ``module_filter_fn``: both
    widths multiples of 16, and not the output head, which its llama3 float8 configs filter:
    ``filter_fqns=["lm_head"]``), with ``Float8LinearConfig.from_recipe_name``; the FSDP2
    float8 all-gather (``enable_fsdp_float8_all_gather``, tensorwise only) when asked."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe_name)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)

    def keep(mod: torch.nn.Module, fqn: str) -> bool:
        return (mod.in_features % 16 == 0 and mod.out_features % 16 == 0
                and "lm_head" not in fqn and fqn != "output")

    convert_to_float8_training(model, config=config, module_filter_fn=keep)


def _relabel_held_reduce(model, tracker: MemoryTracker) -> None:
    """The reduce-scatter inputs FSDP2 holds until the next unit's reduce-scatter (here the
    chunked loss's last chunk's): a gradient buffer of the data-parallel mechanism, not an
    activation the graph saved (memplan: ``HeadBlock.loss_held``). Nothing of them is kept
    referenced here, so they are freed when FSDP2 drops them."""
    from memplan.profile.distributed import BUCKETS

    for rs_state in model._get_fsdp_state()._comm_ctx.reduce_scatter_states:
        tracker.relabel(rs_state.reduce_scatter_input, BUCKETS)


def _torchtitan_ac(mode: str):
    if mode == "none":
        return None
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return FullAC.Config() if mode == "full" else SelectiveAC.Config()


def _chunked_loss(model, chunks: int, compile_config=None):
    """torchtitan's ``ChunkedLossWrapper`` (components/loss.py; the llama3 registry's loss)
    of ``chunks`` pieces, wired as ``Trainer.__init__`` wires it: the model returns the final
    norm's output (``_skip_lm_head``) and the wrapper runs ``lm_head`` and the loss per chunk,
    each chunk's backward at once. With ``compile_config`` (compile.components "loss") its
    inner ``CrossEntropyLoss`` is built compiled, as the Trainer builds it."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    loss = ChunkedLossWrapper.Config(num_chunks=chunks, loss_fn=CrossEntropyLoss.Config()
                                     ).build(compile_config=compile_config)
    loss.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    return loss


def _emitted_block_sac(model, spec: ModelSpec, precision: str, b: int, s: int,
                       save: str) -> None:
    """Each of torchtitan's blocks in ``checkpoint_wrapper`` with the policy ``memplan
    estimate --emit-policy torch`` prints for ``save`` (a fresh one per checkpoint call),
    with torch's default early stop."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from memplan.profile.sac_policy import emitted_module

    wl = api.resolve(spec, framework="torchtitan", micro_batch_size=b, seq_len=s,
                     precision=precision, recompute="ops", recompute_save=save)[2]
    make = emitted_module(spec, wl)["make_policy_fn"]
    layers = model.get_submodule("layers")
    for layer_id, block in list(layers.named_children()):
        layers.register_module(layer_id, checkpoint_wrapper(
            block, context_fn=lambda: create_selective_checkpoint_contexts(make())))


def _layer_sac(model, every: int) -> None:
    """torchtitan v0.2.2's ``selective_ac_option = every`` (distributed/activation_checkpoint.py
    ``apply_ac`` -> ``_apply_ac_to_transformer_block`` -> ``_apply_layer_sac``), which 0.3.0
    dropped: the blocks counted from 1 in ``layers`` order, a block wrapped in
    ``checkpoint_wrapper`` with v0.2.2's defaults (preserve_rng_state True, determinism_check
    "default", early_stop False, debug False) when the count is a multiple of ``every`` (0:
    every block). One model here, so v0.2.2's process-wide count starts at 0."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    layers = model.get_submodule("layers")
    for count, (layer_id, block) in enumerate(list(layers.named_children()), start=1):
        if not every or count % every == 0:
            block = checkpoint_wrapper(block, preserve_rng_state=True,
                                       determinism_check="default", early_stop=False,
                                       debug=False)
            layers.register_module(layer_id, block)


@contextlib.contextmanager
def _sac_saves_cpu_flash() -> Iterator[None]:
    """torchtitan's SAC save list as a GPU run has it: on CUDA the SDPA kernel it runs (flash,
    cuDNN) is in the list (PyTorch's compute-intensive ops, ``_get_default_save_ops``); on CPU
    SDPA dispatches to ``_scaled_dot_product_flash_attention_for_cpu``, which the list lacks,
    so a CPU trace would recompute the attention. The CPU kernel joins the list here."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    orig = SelectiveAC.get_save_ops

    def get_save_ops(self) -> set:
        return orig(self) | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    SelectiveAC.get_save_ops = get_save_ops
    try:
        yield
    finally:
        SelectiveAC.get_save_ops = orig


BUILDERS["torchtitan"] = build_torchtitan


# --- litgpt ----------------------------------------------------------------------------------

def litgpt_spec(config, name: str) -> ModelSpec:
    """memplan's spec of a litgpt ``Config`` (Llama family: RMSNorm, LLaMAMLP, RoPE)."""
    if config.mlp_class_name != "LLaMAMLP" or config.norm_class_name != "RMSNorm":
        raise MemplanError(f"litgpt {name}: only Llama-style configs are described here")
    data = {"model_type": "llama", "hidden_size": config.n_embd,
            "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
            "num_key_value_heads": config.n_query_groups, "head_dim": config.head_size,
            "intermediate_size": config.intermediate_size,
            "vocab_size": config.padded_vocab_size, "max_position_embeddings": config.block_size,
            "hidden_act": "silu", "attention_bias": config.bias, "mlp_bias": config.bias,
            "tie_word_embeddings": False}
    # CausalSelfAttention's one qkv linear (litgpt/model.py)
    return spec_from_hf_dict(data, f"litgpt {name}", name).model_copy(update={"fused_qkv": True})


_FABRIC_PRECISION = {"fp32": "32-true", "bf16-pure": "bf16-true", "amp-bf16": "bf16-mixed"}


def build_litgpt(case: FrameworkCase) -> Built:
    """litgpt's ``GPT`` from ``Config.from_name(name, **config)`` set up by Lightning Fabric
    (CPU, one device, the recipe's Fabric precision: ``32-true``, ``bf16-true``,
    ``bf16-mixed``), stepped as ``litgpt/pretrain.py``'s ``fit`` does: ``logits =
    model(input_ids)`` (a loop variable, alive until the next step's forward returns),
    ``chunked_cross_entropy(logits, targets)``, ``fabric.backward(loss)``,
    ``fabric.clip_gradients(max_norm=1.0)``, ``optimizer.step()``, ``optimizer.zero_grad()``."""
    import lightning as L
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy

    rec = recipe(case.recipe)
    config = Config.from_name(case.name, **case.config)
    spec = litgpt_spec(config, case.name)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=_FABRIC_PRECISION[rec.name])
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    model.max_seq_length = case.seq_len  # pretrain.py: train.max_seq_length (RoPE buffers)
    model = fabric.setup(model)
    opt = fabric.setup_optimizers(_fused_adamw(model.parameters()))
    b, s, vocab = case.micro_batch_size, case.seq_len, config.padded_vocab_size
    state: dict[str, Any] = {}

    @contextlib.contextmanager
    def held(tracker: MemoryTracker) -> Iterator[None]:
        state["tracker"] = tracker
        yield

    def step(k: int, mark: Mark) -> None:
        ids = torch.randint(0, vocab, (b, s + 1))
        input_ids, targets = ids[:, :s], ids[:, 1:]
        state["logits"] = model(input_ids)  # pretrain.py's loop variable
        # held by the loop, not saved by the graph (memplan: the preset's logits_held)
        state["tracker"].relabel(state["logits"], HELD)
        loss = chunked_cross_entropy(state["logits"], targets)
        mark("backward")
        fabric.backward(loss)
        del loss
        mark("optimizer")
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()

    workload = dict(framework="lightning", micro_batch_size=b, seq_len=s, precision=rec.name)
    # the optimizer Fabric wraps is the one whose states the tracker reads
    inner = getattr(opt, "optimizer", opt)
    return Built("litgpt", model, spec, api.make_layout(1), workload, step, inner,
                 context=held)


BUILDERS["litgpt"] = build_litgpt


def available(library: str) -> bool:
    import importlib.util

    module = {"transformers": "transformers", "torchtitan": "torchtitan",
              "litgpt": "litgpt"}[library]
    return importlib.util.find_spec(module) is not None


__all__ = ["BUFFERS", "BUILDERS", "HELD", "LIBRARIES", "RECIPES", "Built", "FrameworkCase",
           "LibraryTracker", "Recipe", "build_hf", "build_litgpt", "build_torchtitan",
           "compare_built", "compare_framework", "cuda_kernels", "fake_real_check",
           "hf_spec", "litgpt_spec", "recipe", "run_library_steps", "torchtitan_config",
           "torchtitan_spec", "trace_case"]
