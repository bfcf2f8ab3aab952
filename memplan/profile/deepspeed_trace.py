"""DeepSpeed's own engine traced on CPU: a transformers model under ``deepspeed.initialize``
with ZeRO stage 2, stepped as the transformers Trainer steps it, under memplan's exact tensor
tracker, against ``memplan.model.estimate.estimate`` of the deepspeed preset.

How it runs without a GPU: DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``,
deepspeed/accelerator/cpu_accelerator.py: a synchronized device, no streams) and rank 0 of a
``dp``-rank fake process group (torch.testing's ``fake`` backend: collectives return at once,
every tensor has the shape and dtype it has on a real rank), as the other parallel traces do.
The client optimizer is ``torch.optim.AdamW(fused=True)``: what the Trainer hands DeepSpeed when
the ds_config has no ``optimizer`` table (its ``adamw_torch_fused`` default), so DeepSpeed's
FusedAdam op, which a CPU build would compile, is not needed. The step is the Trainer's
(trainer.py training_step / _inner_training_loop under DeepSpeed): ``engine(**inputs)``, its
loss alone kept (compute_loss), ``engine.backward(loss)`` (the gradient hooks fill the reduce
bucket; the epilogue reduces the last one), ``engine.step()`` (the ZeRO optimizer's step and
the weights' all-gather).

What is registered up front: the flat bf16 weights (the model's parameters are views of
``bit16_groups_flat``) as ``parameters``; the fp32 partition
(``single_partition_of_fp32_groups``) as ``optimizer``; the model's buffers. At the optimizer
phase the rank's gradient partition (the gradients of ``params_in_partition``, views of
``grads_in_partition``) is counted as ``gradients``. Categories only label; the phase totals
are every live storage.

Option ``lora_rank`` (and ``lora_targets``, default all-linear): peft's ``get_peft_model``
with ``LoraConfig(r, lora_alpha=2r)`` before ``deepspeed.initialize``, the client AdamW over the
Trainer's parameter groups (``requires_grad`` only); the frozen weights are registered as
``parameters`` (ZeRO-3: their ``ds_tensor`` partitions).

This module imports torch, transformers, peft and deepspeed; memplan's CLI never imports it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from memplan import api
from memplan.profile.cuda_rules import cuda_kernels
from memplan.profile.tracker import HostCategories
from memplan.profile.frameworks import (
    Built,
    FrameworkCase,
    LibraryTracker,
    Mark,
    compare_built,
    hf_spec,
    run_library_steps,
)
from memplan.profile.compare import Comparison
from memplan.profile.trace import TraceResult

# ZeRO-2 as the preset models it: bf16 weights and gradients, fp32 partition and states
PRECISIONS = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def _environment(dp: int, rank: int) -> None:
    """What DeepSpeed reads before it starts: the CPU accelerator, and the launcher's
    variables (engine.py _do_args_sanity_check asserts LOCAL_RANK)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(LOCAL_RANK="0", RANK=str(rank), WORLD_SIZE=str(dp))


# the ZeRO-3 coordinator memplan models (Workload.zero3_plain_gathers): these settings 0
_PLAIN_COORDINATOR = ("stage3_prefetch_bucket_size", "stage3_max_reuse_distance",
                      "stage3_param_persistence_threshold")


# the ds_config's coordinator keys and the workload fields memplan reads them into
_COORDINATOR_FIELDS = {"stage3_prefetch_bucket_size": "zero3_prefetch_numel",
                       "stage3_max_live_parameters": "zero3_max_live_numel",
                       "stage3_max_reuse_distance": "zero3_reuse_distance_numel",
                       "stage3_param_persistence_threshold": "zero3_persistence_numel"}


def _rank(case: FrameworkCase) -> int:
    """The traced rank: the last unless ``options["rank"]`` (stage 1's most loaded is the
    first, whose partition is made at the first reduce after backward)."""
    return int(case.options.get("rank", case.dp - 1))


def ds_config(case: FrameworkCase) -> dict[str, Any]:
    """The ds_config of a case: its micro-batch, precision and ZeRO options (``options``:
    ``reduce_bucket_size``, ``overlap_comm``, ``contiguous_gradients``)."""
    zero = {"stage": 2, **{k: v for k, v in case.options.items()
                           if k in ("stage", "reduce_bucket_size", "overlap_comm",
                                    "contiguous_gradients", "offload_optimizer", "offload_param")
                           or k.startswith("stage3_") or k == "sub_group_size"}}
    # fp16 with a static loss scale (runtime/fp16/loss_scaler.py LossScaler): a dynamic one
    # skips the steps whose scaled gradients overflow, which a random toy's first steps do
    table = ({"enabled": True, "loss_scale": 128} if case.recipe == "fp16-mixed"
             else {"enabled": True})
    return {"train_micro_batch_size_per_gpu": case.micro_batch_size,
            "gradient_accumulation_steps": case.options.get("accumulation", 1),
            "fp16" if case.recipe == "fp16-mixed" else "bf16": table,
            "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True,
            # the Trainer's torch AdamW stepping the host partition (DeepSpeedCPUAdam would
            # need its C++ op built); the same states, on the host
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": zero}


def build_deepspeed(case: FrameworkCase) -> Built:
    """A transformers causal LM (``case.config``, SDPA attention) in the recipe's dtype,
    wrapped by ``deepspeed.initialize`` with ``ds_config(case)``."""
    _environment(case.dp, _rank(case))
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**case.config)
    model = AutoModelForCausalLM.from_config(config, dtype=PRECISIONS[case.recipe],
                                             attn_implementation="sdpa")
    recompute = case.options.get("recompute", "none")
    if recompute == "full":  # the Trainer's gradient_checkpointing=True, non-reentrant
        model.gradient_checkpointing_enable({"use_reentrant": False})
    spec = hf_spec(model.config, case.name)
    lora = case.options.get("lora_rank")
    if lora:
        model = _peft_lora(model, int(lora), case.options.get("lora_targets", "all-linear"))
    # without LoRA one group of every parameter (as traced so far); with it the Trainer's
    client = torch.optim.AdamW(_trainer_groups(model) if lora else model.parameters(),
                               lr=1e-4, weight_decay=0.1, fused=True)
    cfg = ds_config(case)
    if cfg["zero_optimization"]["stage"] == 3:
        _skip_rank_agreement()
    engine, zero_opt, _, _ = deepspeed.initialize(model=model, optimizer=client, config=cfg,
                                                  dist_init_required=False)
    b, s, vocab = case.micro_batch_size, case.seq_len, model.config.vocab_size

    m = cfg["gradient_accumulation_steps"]
    stage = cfg["zero_optimization"]["stage"]

    def step(k: int, mark: Mark) -> None:
        # accelerate's DeepSpeedEngineWrapper.backward: engine.backward, then engine.step,
        # which steps at the accumulation boundary only
        for j in range(m):
            if j:
                mark("forward")
            ids = torch.randint(0, vocab, (b, s))
            out = engine(input_ids=ids, labels=ids)
            loss = out.loss
            del out
            mark("backward")
            engine.backward(loss)
            del loss
            if j < m - 1:
                engine.step()
        if stage != 3:
            _label_partition(zero_opt, tracker_of[0])
        mark("optimizer")
        engine.step()

    tracker_of: list[Any] = [None]
    sizes: dict[str, Any] = {}

    @contextlib.contextmanager
    def registered(tracker: LibraryTracker) -> Iterator[None]:
        tracker_of[0] = tracker
        if stage == 3:  # stage3.py: the bit16 and fp32 partitions, per sub-group
            # with offload_param the bit16 partitions are host memory
            # (_create_param_groups_fp16_flat_cpu_memory), with offload_optimizer the fp32
            # partitions, their gradient (initialize_optimizer_states:
            # subgroup_gradient_buffer) and the gradient partitions (_setup_for_real_optimizer:
            # device=self.device, the CPU): OffloadTracker counts "optimizer" as the host
            tracker.register(list(zero_opt.fp16_partitioned_groups_flat),
                             "optimizer" if zero_opt.offload_param else "parameters")
            tracker.register(list(zero_opt.fp32_partitioned_groups_flat), "optimizer")
            if zero_opt.offload_optimizer:
                tracker.register([t.grad for t in zero_opt.fp32_partitioned_groups_flat],
                                 "optimizer")
            # _setup_for_real_optimizer: the reduce bucket and the gradient partitions, made
            # at __init__ and kept
            tracker.register([b.buffer for b in zero_opt.ipg_buckets.values()], "buckets")
            tracker.register(zero_opt.grad_partitions_flat_buffer,
                             "optimizer" if zero_opt.offload_optimizer else "gradients")
            sizes.update(
                weights=_nbytes(zero_opt.fp16_partitioned_groups_flat),
                master=_nbytes(zero_opt.fp32_partitioned_groups_flat),
                bucket=_nbytes([b.buffer for b in zero_opt.ipg_buckets.values()]),
                gradients=_nbytes([zero_opt.grad_partitions_flat_buffer]),
                sub_groups=[t.numel() for t in zero_opt.fp32_partitioned_groups_flat],
                persistent=sum(p.ds_numel for p in zero_opt.persistent_parameters))
            yield
            return
        tracker.register(list(zero_opt.single_partition_of_fp32_groups), "optimizer")
        if zero_opt.cpu_offload:  # ZeRO-Offload: what stage_1_and_2.py __init__ puts on the host
            tracker.register([p.grad for p in zero_opt.single_partition_of_fp32_groups]
                             + list(zero_opt.param_buffer_of_bit16_for_cpu_offload_groups)
                             + [zero_opt.temp_grad_buffer_for_cpu_offload], "optimizer")
            # ... and on the device: a buffer of the largest parameter's size
            tracker.register(zero_opt.temp_grad_buffer_for_gpu_offload, "buckets")
        yield

    zero = cfg["zero_optimization"]
    workload = dict(framework="deepspeed", micro_batch_size=b, seq_len=s,
                    global_batch_size=b * case.dp * m,
                    precision=case.recipe, attention="flash", optimizer_impl="fused",
                    **({"zero_bucket_numel": int(zero["reduce_bucket_size"])}
                       if "reduce_bucket_size" in zero else {}),
                    **({"zero_bucket_buffers": 2} if zero.get("overlap_comm") else {}),
                    **({"zero3_plain_gathers": True} if stage == 3 and all(
                        zero.get(k) == 0 for k in _PLAIN_COORDINATOR) else {}),
                    **{field: int(zero[key]) for key, field in _COORDINATOR_FIELDS.items()
                       if key in zero},
                    **({"recompute": "full"} if recompute == "full" else {}),
                    **({"lora_rank": int(lora),
                        "lora_targets": case.options.get("lora_targets", "all-linear")}
                       if lora else {}))
    offload = ",".join(kind for kind, key in (("optimizer", "offload_optimizer"),
                                               ("params", "offload_param")) if key in zero
                       ) or "none"
    # the frozen weights (LoRA's base): ZeRO-3 partitions them too (parameter_offload.py
    # _convert_to_zero_parameters converts every module parameter; each keeps its own ds_tensor,
    # outside the optimizer's flat lp_param_buffer), ZeRO-1/2 leaves them whole
    frozen = [p.ds_tensor if stage == 3 else p for p in model.parameters()
              if not p.requires_grad]
    if stage == 3:
        sizes["frozen"] = _nbytes(frozen)
    built = Built("deepspeed", model, spec, api.make_layout(case.dp, zero=stage, offload=offload),
                  workload, step, zero_opt.optimizer, frozen=frozen, context=registered)
    built.registered = sizes  # type: ignore[attr-defined]
    return built


def _peft_lora(model: Any, rank: int, targets: str) -> Any:
    """peft's ``get_peft_model`` with ``LoraConfig(r, lora_alpha=2r, target_modules)`` (peft's
    defaults otherwise: ``autocast_adapter_dtype=True`` makes the adapters fp32, which the
    engine then casts to the model's bf16/fp16, engine.py ``_cast_module_mixed_precision``);
    ``targets`` "all-linear" or memplan's names, comma-separated."""
    from peft import LoraConfig, get_peft_model

    from memplan.profile.finetune import LORA_NAMES

    modules: Any = (targets if targets == "all-linear"
                    else [LORA_NAMES[t] for t in targets.split(",")])
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                            target_modules=modules))


def _trainer_groups(model: Any) -> list[dict[str, Any]]:
    """The parameter groups ``transformers.Trainer.create_optimizer`` makes: the parameters
    that require grad, those in ``get_decay_parameter_names`` (weights of layers other than
    norms, no bias) with weight decay, the others without; a group may be empty (every
    adapter is a weight: the second group under LoRA)."""
    from transformers.trainer_pt_utils import get_parameter_names

    # trainer.py Trainer.get_decay_parameter_names (transformers 5.3)
    names = set(get_parameter_names(model, [torch.nn.LayerNorm],
                                    [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                     r"_norm(?:$|\.)"]))
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in names and p.requires_grad],
             "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in names and p.requires_grad],
             "weight_decay": 0.0}]


def _nbytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _skip_rank_agreement() -> None:
    """ZeRO-3's coordinator checks at each step start that every rank recorded the same module
    trace (partitioned_param_coordinator.py reset_step -> zero/utils.py
    assert_ints_same_as_other_ranks: an all-reduce of the lengths and ids). On the fake
    process group the collectives return at once with nothing in them, so the check fails;
    it allocates only a few integers, and is skipped."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    coordinator.assert_ints_same_as_other_ranks = lambda ints: None


def _label_partition(zero_opt: Any, tracker: LibraryTracker) -> None:
    """Count the rank's gradient partition as gradients: the epilogue leaves it in
    ``averaged_gradients`` (views of ``grads_in_partition``), the parameters' ``.grad``
    cleared (``_clear_param_grad_only``)."""
    for group in zero_opt.averaged_gradients.values():
        for g in group or ():
            tracker.relabel(g, "gradients")


@contextlib.contextmanager
def _last_rank(dp: int, rank: int | None = None) -> Iterator[None]:
    """The last of ``dp`` ranks (or ``rank``) on torch's fake process group: the last is the
    rank whose partition is the flat buffer's tail, the head's and the last layers'
    gradients, made first in backward (``memplan.model.deepspeed_zero.first_reduce``)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=dp - 1 if rank is None else rank,
                            world_size=dp)
    try:
        yield
    finally:
        dist.destroy_process_group()


class OffloadTracker(HostCategories, LibraryTracker):
    """``LibraryTracker`` for ZeRO-Offload on a CPU-only build: the totals count the device
    alone; host memory is the ``optimizer`` category (the fp32 partition, its gradient, the
    bit16 copy, the host gradient buffer, the states, and whatever the step makes: it runs
    on the host)."""

    HOST = ("optimizer",)


class Zero3OffloadTracker(OffloadTracker):
    """``OffloadTracker`` for ZeRO-3 with offload_optimizer: what the step makes is the host's,
    except the persistent parameters' gather after it (stage3.py ``_post_step`` ->
    ``all_gather``), device memory kept into the next forward, counted apart while
    ``device_side`` is set."""

    device_side = False

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        if self.device_side:
            LibraryTracker._add(self, st, "gathered")
            return
        super()._add(st, category)


@contextlib.contextmanager
def _post_step_on_device(tracker: Zero3OffloadTracker) -> Iterator[None]:
    """Mark what ``_post_step`` allocates (the persistent parameters' gather) as the device's."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    post = Stage3._post_step

    def marked(self: Any, timer_names: Any) -> None:
        tracker.device_side = True
        try:
            post(self, timer_names)
        finally:
            tracker.device_side = False

    Stage3._post_step = marked
    try:
        yield
    finally:
        Stage3._post_step = post


def trace_deepspeed(case: FrameworkCase, steps: int = 2) -> tuple[Built, TraceResult]:
    """Build and trace ``case`` on the last of ``case.dp`` fake ranks, CUDA's kernels."""
    with _last_rank(case.dp, _rank(case)), cuda_kernels():
        torch.manual_seed(0)
        built = build_deepspeed(case)
        offload = "offload_optimizer" in case.options or "offload_param" in case.options
        if offload and int(case.options.get("stage", 2)) == 3:
            tracker = Zero3OffloadTracker()
            with _post_step_on_device(tracker):
                return built, run_library_steps(built, tracker, steps=steps)
        tracker = OffloadTracker() if offload else LibraryTracker()
        return built, run_library_steps(built, tracker, steps=steps)


def trace_gathers(case: FrameworkCase, steps: int = 3) -> list[list[int]]:
    """Bytes the ZeRO-3 coordinator holds gathered at each fetch of a module with parameters of
    its own, per step: every parameter's storage (whole copies and the buffers of parameters
    gathered alone) and the flat buffers of the coalesced all-gathers its registry still holds
    (``AllGatherCoalescedHandle.partitions``), each storage once; read right after
    ``fetch_sub_module`` returns (the module's own fetch and its prefetch done)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import (
        PartitionedParameterCoordinator as Coordinator)

    out: list[list[int]] = []
    with _last_rank(case.dp, _rank(case)), cuda_kernels():
        torch.manual_seed(0)
        built = build_deepspeed(case)
        params = list(built.model.parameters())
        fetch = Coordinator.fetch_sub_module

        def held(coordinator: Any) -> int:
            seen: set[int] = set()
            registry = coordinator._PartitionedParameterCoordinator__inflight_param_registry
            storages = [p.data.untyped_storage() for p in params]
            for handle in set(registry.values()):
                for h in getattr(handle, "handles", [handle]):
                    if getattr(h, "partitions", None):
                        storages.append(h.partitions[0].untyped_storage())
            total = 0
            for s in storages:
                if s.nbytes() and s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
            return total

        def recorded(coordinator: Any, module: Any, forward: bool) -> None:
            fetch(coordinator, module, forward)
            if any(True for _ in module.parameters(recurse=False)):
                out[-1].append(held(coordinator))

        Coordinator.fetch_sub_module = recorded
        try:
            for k in range(steps):
                out.append([])
                built.step(k, lambda phase: None)
        finally:
            Coordinator.fetch_sub_module = fetch
    return out


def trace_json(built: Built, result: TraceResult) -> dict[str, Any]:
    """Each step's phase peaks (total and by category) and the bytes of what the ZeRO
    optimizer registered, as JSON: ``{"steps": [{"forward": {"total": n, "parameters": ...},
    ...}], "registered": {...}}``."""
    steps = [{phase: {"total": peak.total_bytes, **peak.by_category}
              for phase, peak in s.phases.items()} for s in result.steps]
    return {"steps": steps, "registered": dict(getattr(built, "registered", {}) or {})}


def compare_deepspeed(case: FrameworkCase, steps: int = 2) -> Comparison:
    """The trace of ``case`` next to memplan's estimate of the deepspeed preset."""
    built, result = trace_deepspeed(case, steps)
    return compare_built(built, result)


def main(argv: list[str] | None = None) -> None:
    """``python -m memplan.profile.deepspeed_trace CASE_JSON``: one case (the fields of
    ``FrameworkCase``) traced in this process, its rows printed as JSON. DeepSpeed keeps its
    process groups in module globals (deepspeed/utils/groups.py), so each case runs in a
    process of its own."""
    import json
    import sys

    from memplan.profile.compare import comparison_json

    args = argv if argv is not None else sys.argv[1:]
    fields = json.loads(args[0])
    if "--gathers" in args:  # the coordinator's gathered bytes at each module's fetch
        print(json.dumps(trace_gathers(FrameworkCase(**fields))))
        return
    if "--trace" in args:  # the trace alone, for what memplan's preset does not model yet
        print(json.dumps(trace_json(*trace_deepspeed(FrameworkCase(**fields)))))
        return
    c = compare_deepspeed(FrameworkCase(**fields))
    print(json.dumps(comparison_json(c)))


if __name__ == "__main__":
    main()
