"""Why a job ran out of memory: the estimate for its configuration next to what the error says.

Each finding holds its sizes as int bytes and a sentence with ``{name}`` placeholders for them;
the report layer (``memplan.report.diagnose``) turns the sizes into GiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.diagnose.oom import OomReport, request_matches
from memplan.diagnose.traceback import DiedIn
from memplan.model.estimate import Estimate, StageMemory
from memplan.overheads import NOTABLE_CACHE_FRACTION
from memplan.parallel import ZeroStage
from memplan.units import FP32_BYTES, ceil_div
from memplan.parallel import local_seq
from memplan.workload import OptimizerImpl

# A stage's phases in the order a training step reaches them: step 1 runs without optimizer
# moments, which the first optimizer step creates (memplan.model.estimate).
TIMELINE = (("first step", "forward"), ("first step", "backward"), ("first step", "optimizer"),
            ("steady", "forward"), ("steady", "backward"), ("steady", "optimizer"))

# A component is named as a cause when it is at least this share of the failing phase's
# bytes: a stated threshold for what is worth a sentence, not a measured one.
NOTABLE_SHARE = 0.10


@dataclass(frozen=True)
class Finding:
    """One observation. ``text`` has ``{name}`` placeholders for ``sizes`` (int bytes)."""

    kind: str
    text: str
    sizes: dict[str, int] = field(default_factory=dict)
    cause: bool = False  # named as a cause of the failure (else context)


@dataclass(frozen=True)
class Diagnosis:
    """The estimate of the rank that failed, where it fails, and why."""

    estimate: Estimate
    oom: OomReport | None
    stage: StageMemory
    capacity_bytes: int
    failing_step: str  # "first step" or "steady"
    failing_phase: str  # "forward", "backward" or "optimizer"
    components: dict[str, int]  # bytes of each component alive in the failing phase
    findings: tuple[Finding, ...]
    fails: bool  # an error was given, or the estimate does not fit: else "failing" is the peak
    died_in: DiedIn | None = None  # where the error's traceback says the job died

    @property
    def dominant(self) -> tuple[str, int]:
        return max(self.components.items(), key=lambda item: item[1])


def unexplained_bytes(d: Diagnosis) -> int:
    """Bytes the failed job held beyond the estimate: allocated + requested at the failure
    less the estimate's tensor peak of that rank (0 when the estimate covers it, or when the
    error gives no sizes)."""
    oom = d.oom
    if oom is None or oom.allocated_bytes is None or oom.requested_bytes is None:
        return 0
    return max(oom.allocated_bytes + oom.requested_bytes - d.stage.tensor_peak_bytes, 0)


def rank_bytes(est: Estimate, s: StageMemory, tensor_bytes: int) -> int:
    """A rank's bytes with ``tensor_bytes`` of tensors: the fixed overheads and the allocator's
    share on top, as ``peak_bytes`` is built (memplan.model.stage.rank_peak_bytes)."""
    ovh = est.overheads
    return (tensor_bytes + s.calibration_bytes + ovh.fixed_bytes
            + ovh.allocator_bytes(tensor_bytes))


def phase_components(est: Estimate, s: StageMemory, step: str, phase: str) -> dict[str, int]:
    """The components alive in one phase (the lists in memplan.model.estimate's docstring), each at
    its full size on this rank: which is largest, not an exact split of the phase's bytes."""
    parts = {"parameters": s.params_bytes, "registered buffers": s.buffers_bytes}
    if step == "steady" or phase == "optimizer":
        parts["optimizer states"] = s.optimizer_bytes
    if phase == "optimizer":
        parts["gradients"] = s.grads_bytes
        parts["optimizer step temporaries"] = s.optimizer_temp_bytes
        return parts
    if phase == "backward" or est.num_microbatches > 1:
        parts["gradients"] = s.grads_bytes
    parts["saved activations"] = s.activations_bytes
    parts["loss logits"] = s.loss_bytes
    parts["ZeRO / DDP buffers"] = s.sharding_buffers_bytes
    return {name: size for name, size in parts.items() if size > 0}


def failed_stage(est: Estimate, oom: OomReport | None) -> StageMemory:
    """The stage of the rank named in the log, else the most loaded stage."""
    return est.stage_of_rank(None if oom is None else oom.rank)


def _phase_bytes(s: StageMemory, step: str, phase: str) -> int:
    return getattr(s.first_step if step == "first step" else s.steady, phase)


# The step phase each phase a traceback names falls in: the gradient reduction runs in backward
STEP_PHASE = {"forward": "forward", "backward": "backward", "gradient communication": "backward",
              "optimizer step": "optimizer"}


def failing_point(est: Estimate, s: StageMemory, oom: OomReport | None,
                  capacity_bytes: int, died: DiedIn | None = None) -> tuple[str, str]:
    """(step, phase) where the job fails: the first phase whose predicted tensors reach what
    the job held when it failed (allocated + requested), else the first whose rank bytes
    exceed the capacity, else the predicted peak phase. A traceback that names a step's
    phase (``died``) keeps the search to that phase (step 1's, else the steady state's)."""
    timeline = TIMELINE
    if died is not None and died.phase in STEP_PHASE:
        timeline = tuple(w for w in TIMELINE if w[1] == STEP_PHASE[died.phase])
    if oom is not None and oom.allocated_bytes is not None and oom.requested_bytes is not None:
        demand = oom.allocated_bytes + oom.requested_bytes
        for step, phase in timeline:
            if _phase_bytes(s, step, phase) >= demand:
                return step, phase
    for step, phase in timeline:
        if rank_bytes(est, s, _phase_bytes(s, step, phase)) > capacity_bytes:
            return step, phase
    return max(timeline, key=lambda when: (_phase_bytes(s, *when), when[0] == "steady"))


def diagnose(est: Estimate, oom: OomReport | None = None,
             died: DiedIn | None = None) -> Diagnosis:
    """The estimate ``est`` of a configuration next to the error ``oom`` (either may be all
    there is: without ``oom`` the estimate alone says where and why it would fail) and
    where its traceback says the job died (``died``, ``memplan.diagnose.traceback``)."""
    capacity = est.capacity_bytes
    if oom is not None and oom.allowed_bytes is not None:
        capacity = min(capacity, oom.allowed_bytes)
    s = failed_stage(est, oom)
    step, phase = failing_point(est, s, oom, capacity, died)
    parts = phase_components(est, s, step, phase)
    findings: list[Finding] = []
    if died is not None:
        findings.append(died_finding(died))
    if oom is not None:
        term = request_term(est, s, oom)
        if term is not None:
            findings.append(term)
        findings += _comparison(est, s, oom, capacity)
    fails = oom is not None or s.peak_bytes > capacity
    # a job that died outside a training step (loading, a checkpoint save): the step's own
    # findings are context, not the cause
    in_step = fails and (died is None or died.phase in STEP_PHASE)
    findings.append(_dominant(s, step, phase, parts, in_step))
    for rule in (_first_step, _loss, _optimizer_temps, _imbalance):
        found = rule(est, s, step, phase, parts, oom, capacity if in_step else None)
        if found is not None:
            findings.append(found)
    if oom is not None:
        findings += _allocator(est, oom)
    return Diagnosis(est, oom, s, capacity, step, phase, parts, tuple(findings), fails, died)


# What shrinks what each phase allocates, in words (the fixes ``memplan.diagnose.fixes``
# re-estimates come first in the ranking when they do; these name what the estimate has no
# option for). Loading: transformers' from_pretrained makes fp32 weights unless torch_dtype is
# given (modeling_utils.py from_pretrained), low_cpu_mem_usage / device_map load shard by
# shard through accelerate's set_module_tensor_to_device; a model built on the meta device
# (torch.device("meta"), deepspeed.zero.Init) is sharded before its weights exist. Checkpoint
# save: FSDP's full state dict unshards onto each GPU unless FullStateDictConfig(offload_to_cpu,
# rank0_only) (torch/distributed/fsdp/_state_dict_utils.py _full_post_state_dict_hook);
# torch.distributed.checkpoint saves the shards; DeepSpeed gathers ZeRO-3's 16-bit weights only
# with stage3_gather_16bit_weights_on_model_save (engine.py save_16bit_model).
PHASE_ADVICE = {
    "optimizer step": "what shrinks it: a fused step (--optimizer-impl fused: no intermediate "
                      "lists), ZeRO-1 (states and step sharded over the data-parallel ranks), "
                      "8-bit states (bitsandbytes), the optimizer on the host",
    "gradient communication": "what shrinks it: smaller reduce buckets (DeepSpeed "
                              "reduce_bucket_size, overlap_comm off; DDP bucket_cap_mb), "
                              "ZeRO-2 (each rank keeps only its gradient partition)",
    "loading": "what shrinks it: load in the training dtype (torch_dtype=torch.bfloat16: "
               "without it from_pretrained makes fp32 weights), low_cpu_mem_usage=True or a "
               "device_map (weights placed shard by shard), or build the model on the meta "
               "device and shard it before its weights exist (FSDP2 fully_shard, "
               "deepspeed.zero.Init); then ZeRO-3, TP or PP hold fewer weights per GPU",
    "setup": "what shrinks it: the optimizer's states and fp32 partitions are made at setup: "
             "ZeRO stage, the optimizer on the host, 8-bit states",
    "checkpoint save": "what shrinks it: save the shards (torch.distributed.checkpoint, "
                       "SHARDED_STATE_DICT) or gather to the host "
                       "(FullStateDictConfig(offload_to_cpu=True, rank0_only=True)); "
                       "DeepSpeed: stage3_gather_16bit_weights_on_model_save false",
    "generation": "generation's KV cache and logits are not in the training estimate: fewer "
                  "or shorter generations per device, or a separate inference engine",
    "evaluation": "evaluation's logits and outputs are kept across batches "
                  "(eval_accumulation_steps moves them to the host)",
    "forward": "what shrinks it: recomputation, a smaller micro-batch, a chunked loss",
    "backward": "what shrinks it: recomputation, a smaller micro-batch, ZeRO-2 (gradients "
                "sharded)",
}


_WHEN = {"loading": "while loading", "setup": "during setup (before the first step)",
         "checkpoint save": "while saving a checkpoint", "evaluation": "in evaluation",
         "generation": "in generation"}


def died_finding(died: DiedIn) -> Finding:
    """The phase and operation the traceback names, and what shrinks it."""
    rank = "" if died.rank is None else f" (rank {died.rank})"
    advice = PHASE_ADVICE.get(died.phase)
    when = _WHEN.get(died.phase, f"in the {died.phase}")
    return Finding("traceback", f"the traceback{rank} says the job died {when}: "
                   f"{died.operation} ({died.frame}; read as {died.source})"
                   + (f"; {advice}" if advice else ""), {}, cause=True)


def request_term(est: Estimate, s: StageMemory, oom: OomReport) -> Finding | None:
    """The failed request matched against one tensor of the estimate's terms: the foreach
    step's intermediate over the rank's whole optimizer partition (one flat fp32 tensor where
    the optimizer sees a flat group, as DeepSpeed ZeRO-1/2 gives it), and one fp32 copy of the
    largest weight (vocabulary x hidden / TP: a foreach temporary or a state of it). The
    logits are matched by the loss rule."""
    wl, spec, par = est.workload, est.spec, est.parallel
    terms = []
    if s.optimizer_temp_bytes and wl.optimizer_impl is OptimizerImpl.FOREACH:
        shards = par.dp if par.zero >= ZeroStage.OPTIMIZER else 1
        terms.append(("one fp32 Adam temporary of the foreach step over the rank's whole "
                      "optimizer partition (parameters / data-parallel ranks under ZeRO: one "
                      "flat tensor where the optimizer sees a flat group, as DeepSpeed "
                      "ZeRO-1/2 builds it)", FP32_BYTES * ceil_div(s.num_params, shards)))
    largest = FP32_BYTES * est.parallel.vocab_shard(spec.vocab_size) * spec.hidden_size
    terms.append(("one fp32 copy of the largest weight (vocabulary x hidden / TP: a foreach "
                  "optimizer temporary, a state or an fp32 gradient of it)", largest))
    for what, size in terms:
        if request_matches(oom, size):
            return Finding("request", "the failed request ({requested_bytes}) is " + what
                           + " ({term_bytes} in the estimate)",
                           {"requested_bytes": oom.requested_bytes, "term_bytes": size},
                           cause=True)
    return None


def _comparison(est: Estimate, s: StageMemory, oom: OomReport,
                capacity: int) -> list[Finding]:
    if oom.kind == "nccl":
        return [_nccl(s, oom, capacity)]
    if oom.kind == "driver":
        return [Finding("driver", "the CUDA runtime itself ran out of memory (an allocation "
                        "outside PyTorch's caching allocator: NCCL, cuBLAS, the CUDA context), "
                        "so the message carries no sizes; the estimate leaves {headroom_bytes} "
                        "free for such allocations", {"headroom_bytes": capacity - s.peak_bytes},
                        cause=True)]
    out = []
    if oom.total_bytes is not None and abs(oom.total_bytes - est.gpu.memory_bytes) > max(
            oom.rounding_bytes, est.gpu.memory_bytes // 100):
        out.append(Finding("gpu", f"the GPU reports {{total_bytes}} total, the catalog's "
                           f"{est.gpu.name} {{catalog_bytes}}: check --gpu",
                           {"total_bytes": oom.total_bytes,
                            "catalog_bytes": est.gpu.memory_bytes}))
    if oom.allocated_bytes is None or oom.requested_bytes is None:
        return out
    demand = oom.allocated_bytes + oom.requested_bytes
    gap = s.tensor_peak_bytes - demand
    sizes = {"predicted_tensor_bytes": s.tensor_peak_bytes, "demand_bytes": demand,
             "allocated_bytes": oom.allocated_bytes, "requested_bytes": oom.requested_bytes,
             "gap_bytes": abs(gap), "rounding_bytes": oom.rounding_bytes,
             "predicted_peak_bytes": s.peak_bytes, "capacity_bytes": capacity}
    where = "above" if gap >= 0 else "below"
    text = ("the estimate's tensor peak on this rank is {predicted_tensor_bytes}; the job held "
            "{allocated_bytes} and asked for {requested_bytes} more ({demand_bytes}) when it "
            f"failed: the estimate's peak is {{gap_bytes}} {where} that point (sizes in the "
            "message within {rounding_bytes}; the requested size is the segment the caching "
            "allocator asked for: the tensor rounded up to 2 MiB when large)")
    if gap < 0:
        text += ("; the job needs more than the estimate at its peak, so this configuration "
                 "differs from the one given, or something the estimate does not count is "
                 "alive (a leak, tensors kept across steps, an unmodelled layer)")
        if oom.private_pool_bytes:
            sizes["private_pool_bytes"] = oom.private_pool_bytes
            text += ("; {private_pool_bytes} of the allocated memory sits in CUDA-graph private "
                     "pools, which the estimate does not model")
    out.append(Finding("comparison", text, sizes, cause=gap < 0))
    if s.peak_bytes <= capacity:
        out.append(Finding("prediction", "the estimate predicts this configuration fits "
                           "({predicted_peak_bytes} of {capacity_bytes}); the findings below "
                           "say what it leaves out", sizes, cause=False))
    return out


# What NCCL's buffers are and what shrinks them: the NCCL user guide, "Environment Variables"
# (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html: NCCL_BUFFSIZE, 4 MiB by default,
# the buffer per channel and peer; NCCL_NVLS_ENABLE, NVLink SHARP's buffers; NCCL_MAX_NCHANNELS)
# and PyTorch's torch.distributed.init_process_group (device_id= makes the communicator at once).
NCCL_DOCS = "docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"


def _nccl(s: StageMemory, oom: OomReport, capacity: int) -> Finding:
    room = capacity - s.peak_bytes
    sizes = {"headroom_bytes": room} if room >= 0 else {"over_bytes": -room}
    left = ("the estimate leaves {headroom_bytes} beside this rank's peak" if room >= 0 else
            "the estimate of this rank is itself {over_bytes} over the GPU, so the tensors "
            "leave NCCL nothing")
    failed = ""
    if oom.requested_bytes is not None:
        sizes["requested_bytes"] = oom.requested_bytes
        failed = " (it failed to allocate {requested_bytes})"
    return Finding("nccl", "NCCL itself ran out of memory" + failed + ": a communicator's "
                   "buffers or NCCL's own state, allocated with cudaMalloc (or cuMem*) outside "
                   "PyTorch's caching allocator, so memory PyTorch holds reserved, even unused, "
                   f"is not free for it; {left}. What helps: create the communicators before the model fills the GPU "
                   "(init_process_group(device_id=...) makes them at once), fewer communicators "
                   "(each process group, and each pair of ranks a send/recv joins, has its own "
                   "buffers), smaller ones (NCCL_BUFFSIZE below its 4 MiB per channel and peer, "
                   "NCCL_MAX_NCHANNELS, NCCL_NVLS_ENABLE=0 on NVSwitch systems), and more "
                   "headroom (a smaller micro-batch or recomputation, "
                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so cached blocks go back); "
                   f"NCCL user guide, Environment Variables ({NCCL_DOCS})", sizes, cause=True)


def _step_name(step: str) -> str:
    return "step 1" if step == "first step" else "the steady state"


def _dominant(s: StageMemory, step: str, phase: str, parts: dict[str, int],
              fails: bool) -> Finding:
    name, size = max(parts.items(), key=lambda item: item[1])
    total = _phase_bytes(s, step, phase)
    verb = "it fails in" if fails else "its peak is in"
    return Finding("dominant", f"{verb} the {phase} phase of {_step_name(step)} (stage {s.stage}): "
                   f"{{phase_bytes}} of tensors, of which {name} are the largest part "
                   "({component_bytes})", {"phase_bytes": total, "component_bytes": size},
                   cause=fails)


def _first_step(est, s, step, phase, parts, oom, capacity) -> Finding | None:
    """Step 1 against later steps; ``capacity`` None when nothing fails."""
    first, steady = s.first_step, s.steady
    if capacity is not None and step == "first step" and phase == "optimizer":
        return Finding("first_step", "step 1's forward and backward fit ({fb_bytes} of "
                       "tensors); its optimizer step, which creates the optimizer's states, "
                       "needs {opt_bytes}: the job fails right after its first backward",
                       {"fb_bytes": max(first.forward, first.backward),
                        "opt_bytes": first.optimizer}, cause=True)
    if (capacity is not None and step == "steady"
            and rank_bytes(est, s, first.peak) <= capacity):
        delta = getattr(steady, phase) - getattr(first, phase)
        return Finding("first_step", "step 1 fits ({first_bytes} of tensors at its peak); from "
                       f"step 2 on the optimizer's states are alive through the {phase} too "
                       "(+{delta_bytes}), so the job fails only after its first optimizer step",
                       {"first_bytes": first.peak, "delta_bytes": delta}, cause=True)
    if steady.peak > first.peak:
        return Finding("first_step", "later steps peak {delta_bytes} above step 1 (the "
                       "optimizer's states are alive from step 2 on): a job that passes step 1 "
                       "is not yet safe", {"delta_bytes": steady.peak - first.peak})
    if first.peak > steady.peak:
        return Finding("first_step", "step 1 peaks above the steady state by {delta_bytes}: a "
                       "job that survives step 1 keeps running",
                       {"delta_bytes": first.peak - steady.peak})
    return None


def _loss(est, s, step, phase, parts, oom, capacity) -> Finding | None:
    if phase == "optimizer" or s.loss_bytes == 0:
        return None
    logits = _logits_sizes(est)
    if oom is not None and oom.requested_bytes is not None:
        for dtype, size in logits.items():
            if request_matches(oom, size):
                return Finding("loss", f"the failed allocation is one {dtype} logits tensor "
                               "({logits_bytes}: micro-batch x sequence x vocabulary on this "
                               "rank): the loss's spike; chunked cross-entropy (--loss-chunks: "
                               "never all logits at once) or a smaller micro-batch removes it",
                               {"logits_bytes": size, "loss_bytes": s.loss_bytes}, cause=True)
    if s.loss_bytes >= NOTABLE_SHARE * _phase_bytes(s, step, phase):
        return Finding("loss", "the loss's logits-sized tensors add {loss_bytes} at the "
                       "boundary of forward and backward (a tenth or more of the phase)",
                       {"loss_bytes": s.loss_bytes}, cause=capacity is not None)
    return None


def _logits_sizes(est: Estimate) -> dict[str, int]:
    """One logits tensor on the last stage's rank (tokens / cp x vocabulary / TP when
    vocabulary-parallel) in fp32 and in the compute dtype."""
    wl, par = est.workload, est.parallel
    elems = (wl.micro_batch_size * local_seq(wl.seq_len, par.cp)
             * par.vocab_shard(est.spec.vocab_size))
    return {"fp32": 4 * elems, wl.compute_dtype.value: wl.compute_dtype.itemsize * elems}


def _optimizer_temps(est, s, step, phase, parts, oom, capacity) -> Finding | None:
    if phase != "optimizer" or s.optimizer_temp_bytes == 0:
        return None
    impl = est.workload.optimizer_impl
    hint = (" (--optimizer-impl fused has none)" if impl is not OptimizerImpl.FUSED else "")
    return Finding("optimizer_temporaries", f"the {impl.value} optimizer step allocates "
                   "{temp_bytes} of temporaries while weights, gradients and states are all "
                   f"alive{hint}", {"temp_bytes": s.optimizer_temp_bytes},
                   cause=capacity is not None)


def _imbalance(est, s, step, phase, parts, oom, capacity) -> Finding | None:
    if len(est.stages) < 2:
        return None
    low = min(est.stages, key=lambda x: x.peak_bytes)
    high = est.worst
    if high.peak_bytes == low.peak_bytes:
        return None
    return Finding("pipeline_imbalance", f"pipeline stages are uneven: stage {high.stage} "
                   f"peaks at {{high_bytes}}, stage {low.stage} at {{low_bytes}} "
                   "({spread_bytes} apart: micro-batches in flight, embedding and head)",
                   {"high_bytes": high.peak_bytes, "low_bytes": low.peak_bytes,
                    "spread_bytes": high.peak_bytes - low.peak_bytes},
                   cause=capacity is not None and high.peak_bytes > capacity >= low.peak_bytes)


def _allocator(est: Estimate, oom: OomReport) -> list[Finding]:
    """Fragmentation and memory outside PyTorch, from the message's own numbers."""
    out = []
    unallocated, requested = oom.unallocated_bytes, oom.requested_bytes
    if unallocated is not None and requested is not None and oom.reserved_bytes:
        sizes = {"unallocated_bytes": unallocated, "requested_bytes": requested,
                 "reserved_bytes": oom.reserved_bytes}
        # The allocator frees every cached block it can and retries before raising
        # (c10/cuda/CUDACachingAllocator.cpp, release_cached_blocks): what stays reserved but
        # unallocated lies in segments that still hold live blocks, i.e. fragmentation.
        if unallocated >= requested:
            largest = ""
            if oom.largest_free_block_bytes is not None:
                sizes["largest_free_bytes"] = oom.largest_free_block_bytes
                largest = " (the largest free cached block is {largest_free_bytes})"
            out.append(Finding("fragmentation", "fragmentation: {unallocated_bytes} is reserved "
                               "by PyTorch but unallocated, more than the {requested_bytes} "
                               f"asked for, yet split across segments that hold live tensors"
                               f"{largest}; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                               "lets segments grow instead", sizes, cause=True))
        elif unallocated > NOTABLE_CACHE_FRACTION * oom.reserved_bytes:
            out.append(Finding("fragmentation", "fragmentation adds to it: {unallocated_bytes} "
                               "of the {reserved_bytes} reserved is unallocated, above the "
                               f"{NOTABLE_CACHE_FRACTION:.0%} of the reserved bytes; "
                               "expandable_segments:True reduces it",
                               sizes))
    outside = oom.non_pytorch_bytes
    if outside is not None:
        context = est.overheads.cuda_context_bytes
        where = "this process" if oom.process_bytes is not None else "the device"
        out.append(Finding("outside_pytorch", f"memory outside PyTorch's allocator on {where}: "
                           "{outside_bytes}, against {context_bytes} the estimate assumes for "
                           "the CUDA context; the {extra_bytes} beyond it is NCCL buffers, "
                           "other libraries or CUDA graphs (not in the estimate)",
                           {"outside_bytes": outside, "context_bytes": context,
                            "extra_bytes": max(outside - context, 0)},
                           cause=outside - context > (oom.requested_bytes or 0)))
    if oom.other_processes_bytes:
        out.append(Finding("other_processes", "other processes hold {others_bytes} on this GPU",
                           {"others_bytes": oom.other_processes_bytes}, cause=True))
    return out
