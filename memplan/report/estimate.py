"""``memplan estimate``: the estimate as JSON (int bytes) and as text tables (GiB, labelled):
``estimate_parts`` laid out by ``memplan.report.text``, or by rich (``render_estimate``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memplan.errors import MemplanError
from memplan.model.estimate import PHASES, Estimate, PhasePeaks, StageMemory
from memplan.parallel import offload_names, virtual_stage_layers
from memplan.report.explain import explanations
from memplan.planning.timing import DEFAULT_MFU, StepTime, estimate_step_time
from memplan.report.sizes import format_gib, gib

if TYPE_CHECKING:  # the replay loads only with --reserved (memplan.cli.estimate)
    from memplan.model.reserved import Reserved
    from memplan.report.text import Part

_COMPONENTS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")


def _phases(p: PhasePeaks) -> dict[str, int]:
    return {f"{name}_bytes": getattr(p, name) for name in PHASES}


def reserved_stage_json(r: Reserved) -> dict[str, Any]:
    """A stage's reserved memory from the caching-allocator model (``memplan.model.reserved``)."""
    return {"reserved_peak_bytes": r.reserved_peak_bytes,
            "fragmentation_bytes": r.fragmentation_bytes,
            "expandable_reserved_peak_bytes": r.expandable_reserved_peak_bytes,
            "reserved_by_step": dict(zip(("setup_bytes", "step_1_bytes", "step_2_bytes",
                                          "step_3_bytes"), r.reserved_by_step)),
            "allocator_oom_step": r.oom_step}


def reserved_json(est: Estimate, reserved: tuple[Reserved, ...],
                  alloc_conf: str) -> dict[str, Any]:
    """The most loaded rank's reserved memory (the stage whose reserved peak is largest)."""
    i = max(range(len(reserved)), key=lambda k: reserved[k].reserved_peak_bytes)
    r = reserved[i]
    return {"alloc_conf": alloc_conf, "stage": est.stages[i].stage,
            **reserved_stage_json(r), "step_note": r.step_note,
            "counted_in_peak": False}


def stage_json(s: StageMemory, reserved: Reserved | None = None) -> dict[str, Any]:
    return {
        "stage": s.stage,
        "num_layers": s.num_layers,
        "num_params_on_rank": s.num_params,
        **{name: getattr(s, name) for name in _COMPONENTS},
        "microbatches_in_flight": s.microbatches_in_flight,
        "loss_bytes": s.loss_bytes,
        "sharding_buffers_bytes": s.sharding_buffers_bytes,
        "optimizer_temp_bytes": s.optimizer_temp_bytes,
        "buffers_bytes": s.buffers_bytes,
        "tensor_peak_bytes": s.tensor_peak_bytes,
        "cuda_context_bytes": s.cuda_context_bytes,
        "workspace_bytes": s.workspace_bytes,
        "allocator_bytes": s.allocator_bytes,
        "calibration_bytes": s.calibration_bytes,
        "peak_bytes": s.peak_bytes,
        "host_bytes": s.host_bytes,
        **({"paged_bytes": s.paged_bytes} if s.paged_bytes else {}),
        **({"host_activations_bytes": s.host_activations_bytes}
           if s.host_activations_bytes else {}),
        **({"load_bytes": s.load_bytes} if s.load_bytes else {}),
        **({"pipeline_buffers_bytes": s.pipeline_buffers_bytes}
           if s.pipeline_buffers_bytes else {}),
        "peak_phase": s.peak_phase,
        # calibrated when a profile was applied (their largest: tensor peak + calibration),
        # with the analytic ones beside them; analytic otherwise (analytic_phases null)
        "phases": {"steady": _phases(s.steady), "first_step": _phases(s.first_step)},
        "analytic_phases": (None if s.analytic_phases is None else
                            {"steady": _phases(s.analytic_phases[0]),
                             "first_step": _phases(s.analytic_phases[1])}),
        "activation_terms_per_microbatch": {t.name: t.size_bytes for t in s.activation_terms},
        **(reserved_stage_json(reserved) if reserved is not None else {}),
    }


def estimate_json(est: Estimate, reserved: tuple[Reserved, ...] | None = None,
                  alloc_conf: str = "") -> dict[str, Any]:
    """One JSON object; top-level byte fields describe the most loaded rank. ``reserved``:
    every stage's reserved memory (``memplan.model.reserved.estimate_reserved``), shown per
    stage and, for the stage that reserves most, under ``reserved``."""
    worst = est.worst
    par, wl = est.parallel, est.workload
    return {
        "model": est.spec.name,
        "num_params": est.spec.num_params,
        # an unknown model type read as its nearest known block (memplan.hf.fallback)
        **({"approximate": est.spec.approximate, "exact_num_params": est.spec.exact_num_params}
           if est.spec.approximate else {}),
        "gpu": est.gpu.name,
        "num_gpus": par.world_size,
        "framework": wl.framework.value,
        "layout": {"tp": par.tp, "pp": par.pp, "vpp": par.vpp, "dp": par.dp, "cp": par.cp,
                   "ep": par.ep, "zero": int(par.zero), "sp": par.sequence_parallel,
                   "vocab_parallel": par.vocab_parallel, "tp_style": par.tp_style.value,
                   "grad_buffers": par.grad_buffers.value, "offload": offload_names(par.offload),
                   "stage_layers": list(virtual_stage_layers(est.spec.num_layers, par)),
                   "dp_shard": par.shard_group, "replicas": par.replicas,
                   # only when given: the experts split by tp otherwise
                   **({"etp": par.etp} if par.etp is not None else {}),
                   **({"vpp_group": par.vpp_group} if par.vpp_group is not None else {})},
        "workload": {
            "mbs": wl.micro_batch_size, "gbs": est.global_batch_size,
            "num_microbatches": est.num_microbatches, "seq": wl.seq_len,
            "precision": wl.precision.value, "optimizer": wl.optimizer.value,
            "optimizer_impl": wl.optimizer_impl.value, "recompute": wl.recompute.name.lower(),
            "recompute_layers": wl.recompute_layers, "recompute_every": wl.recompute_every,
            "compile": wl.compile, "float8": wl.float8.value,
            # recompute ops: what each layer keeps (``memplan.model.sac_ops``)
            **({"recompute_save": list(wl.recompute_save)}
               if wl.recompute.name.lower() == "ops" else {}),
            "attention": wl.attention.value,
            "norm_impl": wl.norm_impl.value, "logits_fp32": wl.logits_fp32,
            "loss_chunks": wl.loss_chunks, "logits_held": wl.logits_held.value,
            "softmax_fp32": wl.softmax_fp32, "kv_cache": wl.kv_cache,
            # zero_grad(set_to_none=False): gradients alive in every phase from step 2 on
            "keep_grads": wl.keep_grads,
            **({"lora_rank": wl.lora_rank, "lora_targets": wl.lora_targets,
                "lora_dropout": wl.lora_dropout, "base_quant": wl.base_quant.value}
               if wl.lora_rank else {}),
            # Transformer Engine fp8 (memplan.model.te_fp8), where on
            **({"te_fp8": wl.te_fp8.value, "te_fp8_param_gather": wl.te_fp8_param_gather}
               if wl.te_fp8.value != "none" else {}),
        },
        "most_loaded_stage": worst.stage,
        **{name: getattr(worst, name) for name in _COMPONENTS},
        "calibration_bytes": worst.calibration_bytes,
        "host_bytes": worst.host_bytes,
        # only for a paged optimizer: its states in unified memory (``paged_line``)
        **({"paged_bytes": worst.paged_bytes} if worst.paged_bytes else {}),
        "peak_bytes": est.peak_bytes,
        "capacity_bytes": est.capacity_bytes,
        "headroom_bytes": est.headroom_bytes,
        "fits": est.fits,
        "peak_phase": worst.peak_phase,
        **time_json(estimate_step_time(est), par.world_size),
        "stages": [stage_json(s, reserved[i] if reserved else None)
                   for i, s in enumerate(est.stages)],
        **({"reserved": reserved_json(est, reserved, alloc_conf)} if reserved else {}),
        # the calibrated figures next to the analytic ones above (None: no profile applied)
        "calibration": (est.calibration.json(est.stages.index(worst))
                        if est.calibration is not None else None),
        "assumptions": list(est.assumptions),
        "caveats": list(est.caveats),
        # the large or surprising terms: why, and one setting that changes them, re-estimated
        "explanations": [e.json() for e in explanations(est)],
    }


def time_json(t: StepTime, world_size: int) -> dict[str, float]:
    """The step-time model's figures for one GPU: ``flops_per_step`` is the hardware FLOPs
    (recomputation included) of one optimizer step of the whole job over the world size."""
    return {"step_time_s": t.step_s, "flops_per_step": t.hardware_flops / world_size,
            "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "mfu": t.mfu}


def _time_line(est: Estimate) -> str:
    t = time_json(estimate_step_time(est), est.parallel.world_size)
    from memplan.planning.kernels import gemm_best_rate
    from memplan.workload import StepModel

    measured = est.calibration.mfu if est.calibration is not None else None
    rate = (f"the measured {measured:.0%}" if measured
            else f"an assumed {DEFAULT_MFU:.0%}") + " of peak FLOP/s"
    if (not measured and est.workload.step_model is not StepModel.MFU
            and gemm_best_rate(est.gpu) is not None):
        rate = "the measured GEMM rates, the memory-bound kernels by their bytes"
    return (f"step {t['step_time_s']:.3g} s, {t['flops_per_step']:.4g} FLOPs per GPU "
            f"(recompute included), {t['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
            f"MFU {t['mfu']:.2f} (step-time model; compute at {rate})")


def reserved_line(est: Estimate, reserved: tuple[Reserved, ...], alloc_conf: str) -> str:
    """What the caching allocator would reserve on the rank that reserves most: its reserved
    peak and what of it is not tensors, step 1 against step 2, and with expandable segments."""
    i = max(range(len(reserved)), key=lambda k: reserved[k].reserved_peak_bytes)
    r, s = reserved[i], est.stages[i]
    _, first, second, _ = r.reserved_by_step
    conf = f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf}" if alloc_conf else "the allocator's defaults"
    per_gpu = (r.reserved_peak_bytes + s.calibration_bytes + s.cuda_context_bytes
               + s.workspace_bytes + s.allocator_bytes)
    return (f"reserved by PyTorch's caching allocator (model; {conf}), stage {s.stage}: "
            f"{format_gib(r.reserved_peak_bytes)} at its peak, "
            f"{format_gib(r.fragmentation_bytes)} of it beyond the tensor peak (rounding, "
            f"split blocks, cached free blocks); replayed reserve after step 1 "
            f"{format_gib(first)}, after step 2 {format_gib(second)}: {r.step_note}; with "
            f"expandable_segments:True {format_gib(r.expandable_reserved_peak_bytes)}. With "
            "the calibration, CUDA context and workspace: "
            f"{format_gib(per_gpu)} per GPU, what plan fits (the peak per GPU above counts no "
            "allocator bytes)")


def render_estimate(est: Estimate, reserved: tuple[Reserved, ...] | None = None,
                    alloc_conf: str = "") -> Any:
    """A rich renderable: components by stage, phases, capacity, verdict, assumptions; with
    ``reserved`` (``memplan.model.reserved.estimate_reserved``), the reserved line."""
    from memplan.report.text import to_rich

    return to_rich(estimate_parts(est, reserved, alloc_conf))


def estimate_text(est: Estimate, reserved: tuple[Reserved, ...] | None = None,
                  alloc_conf: str = "", *, width: int, mode: str = "plain") -> str | None:
    """``render_estimate`` as rich prints it ``width`` columns wide, to output that is no
    terminal or to a terminal (``mode``: ``memplan.report.text.console_layout``), without
    importing rich; None where only rich lays it out."""
    from memplan.report.text import render

    return render(estimate_parts(est, reserved, alloc_conf), width, mode)


def estimate_parts(est: Estimate, reserved: tuple[Reserved, ...] | None = None,
                   alloc_conf: str = "") -> list[Part]:
    """The text report's paragraphs and tables (``memplan.report.text``, loaded here: the
    JSON needs none of it)."""
    from memplan.report.text import Paragraph, TextTable

    par, wl = est.parallel, est.workload
    header = Paragraph(
        f"{est.spec.name} ({est.spec.num_params / 1e9:.2f}B params) on {par.world_size} x "
        f"{est.gpu.name}: tp={par.tp} pp={par.pp} vpp={par.vpp} dp={par.dp} cp={par.cp} "
        f"ep={par.ep}" + (f" etp={par.etp}" if par.etp is not None else "")
        + f" zero={int(par.zero)} sp={'on' if par.sequence_parallel else 'off'}"
        + (f" dp_shard={par.shard_group} (x{par.replicas} replicas)" if par.replicas > 1
           else "")
        + (f"\nstage layers {','.join(map(str, par.stage_layers))}" if par.stage_layers
           else "") + "\n"
        f"mbs={wl.micro_batch_size} gbs={est.global_batch_size} "
        f"(micro-batches per step {est.num_microbatches}) seq={wl.seq_len} "
        f"precision={wl.precision.value} optimizer={wl.optimizer.value}/"
        f"{wl.optimizer_impl.value} recompute={wl.recompute.name.lower()}"
        + (f" ({wl.recompute_layers} layers)" if wl.recompute_layers is not None else "")
        + (f" (every {wl.recompute_every}-th layer)" if wl.recompute_every is not None else "")
        + (f"\nLoRA rank {wl.lora_rank} on "
           f"{','.join(wl.lora_targets) if wl.lora_targets else 'the default targets'}, "
           f"dropout {wl.lora_dropout:g}, base weights frozen ({wl.base_quant.value})"
           if wl.lora_rank else "")
        + (f"\nAPPROXIMATE: {est.spec.approximate}" if est.spec.approximate else ""))

    stages = TextTable("Per-GPU memory by pipeline stage, GiB (2^30 bytes)")
    for col in ("stage", "layers", "parameters", "gradients", "optimizer states",
                "activations", "micro-batches in flight", "peak"):
        stages.add_column(col, justify="right", overflow="fold")
    stages.add_column("peak phase", overflow="fold")
    for s in est.stages:
        stages.add_row(f"{s.stage}{' *' if s is est.worst else ''}", str(s.num_layers),
                       *(gib(getattr(s, a)) for a in _COMPONENTS),
                       str(s.microbatches_in_flight), gib(s.peak_bytes), _short_phase(s))

    worst = est.worst
    table = TextTable(f"Most loaded rank: stage {worst.stage}")
    table.add_column("component", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    rows = [
        ("parameters", "params_bytes"), ("gradients", "grads_bytes"),
        ("optimizer states", "optimizer_bytes"), ("activations (saved)", "activations_bytes"),
        ("loss logits (transient)", "loss_bytes"),
        ("ZeRO / DDP gradient and gather buffers", "sharding_buffers_bytes"),
        ("optimizer step temporaries", "optimizer_temp_bytes"),
        *([(_buffers_label(est.workload), "buffers_bytes")] if worst.buffers_bytes else []),
        *([("pipeline receive buffers (torch's PipelineStage)", "pipeline_buffers_bytes")]
          if worst.pipeline_buffers_bytes else []),
        ("tensor peak", "tensor_peak_bytes"),
        *([("calibration correction", "calibration_bytes")] if est.calibration else []),
        ("CUDA context", "cuda_context_bytes"),
        ("cuBLAS workspace", "workspace_bytes"),
        # a calibration's measured residual beyond the allocator model (none uncalibrated)
        *([("allocator residual (calibrated)", "allocator_bytes")] if worst.allocator_bytes
          else []),
        ("peak per GPU", "peak_bytes"),
        *([("host memory (offloaded)", "host_bytes")] if worst.host_bytes else []),
        *([("... of it, saved activations", "host_activations_bytes")]
          if worst.host_activations_bytes else []),
        *([("unified memory (paged optimizer states)", "paged_bytes")] if worst.paged_bytes
          else []),
    ]
    for label, attr in rows:
        value = getattr(worst, attr)
        table.add_row(label, gib(value), f"{value:,}")

    analytic = est.worst.analytic_phases
    phases = TextTable(f"Phase peaks of stage {est.worst.stage}, tensors only (GiB)"
                       + (", calibrated" if analytic else ""))
    phases.add_column("phase")
    phases.add_column("first step", justify="right")
    phases.add_column("steady state", justify="right")
    if analytic:
        phases.add_column("first step (analytic)", justify="right")
        phases.add_column("steady state (analytic)", justify="right")
    for name in PHASES:
        phases.add_row(name, format_gib(getattr(est.worst.first_step, name)),
                       format_gib(getattr(est.worst.steady, name)),
                       *([format_gib(getattr(analytic[1], name)),
                          format_gib(getattr(analytic[0], name))] if analytic else []))
    if est.worst.load_bytes:  # before step 1 (``StageMemory.load_bytes``)
        phases.add_row("model load", format_gib(est.worst.load_bytes), "",
                       *(["", ""] if analytic else []))

    summary = Paragraph(verdict_line(est), "bold green" if est.fits else "bold red")
    notes = Paragraph("assumptions:\n" + "\n".join(f"  - {a}" for a in est.assumptions)
                      + "".join(f"\n  - not always a saving: {c}" for c in est.caveats), "dim")

    # the verdict first, then what it is made of
    parts: list[Part] = [
        summary, *([Paragraph(_why_not(est))] if not est.fits else []), header, stages, table,
        *([Paragraph(paged_line(est))] if worst.paged_bytes else []), phases,
        *([Paragraph(reserved_line(est, reserved, alloc_conf))] if reserved else []),
        Paragraph(_time_line(est))]
    why = explanations(est)
    if why:
        parts.append(Paragraph("why:\n" + "\n".join(f"  - {e.line()}" for e in why)))
    return [*parts, notes]


def paged_line(est: Estimate) -> str:
    """What the GPU holds of a paged optimizer's states (``memplan.model.optimizer``)."""
    s = est.worst
    return (f"{est.workload.optimizer.value}: {format_gib(s.paged_bytes)} of optimizer states "
            "in unified memory, on the GPU while it has room and paged out to host memory "
            f"under pressure; the GPU holds {format_gib(s.optimizer_bytes)} of states in "
            "device memory (absmax, small tensors) and, during the step, the pages of the "
            f"tensor being updated (in the step temporaries, "
            f"{format_gib(s.optimizer_temp_bytes)}); the peak counts only these")


def verdict_line(est: Estimate) -> str:
    """Whether it fits, the peak, its stage and the headroom, in one line."""
    verdict = "FITS" if est.fits else "DOES NOT FIT"
    return (f"{verdict}: peak {format_gib(est.peak_bytes)} of {format_gib(est.capacity_bytes)} "
            f"capacity (stage {est.worst.stage}, {est.worst.peak_phase}); headroom "
            f"{format_gib(est.headroom_bytes)}")


def _why_not(est: Estimate) -> str:
    """The phase that overflows, the largest component in it, and where to look next."""
    w = est.worst
    parts = {"parameters": w.params_bytes, "gradients": w.grads_bytes,
             "optimizer states": w.optimizer_bytes, "saved activations": w.activations_bytes,
             "optimizer step temporaries": w.optimizer_temp_bytes, "loss logits": w.loss_bytes}
    name, size = max(parts.items(), key=lambda item: item[1])
    return (f"over by {format_gib(-est.headroom_bytes)} at the {w.peak_phase} peak; largest "
            f"part: {name} ({format_gib(size)}). `memplan plan --model {est.spec.name} "
            f"--gpus {est.parallel.world_size}` searches layouts and recompute that fit.")


def _short_phase(s: StageMemory) -> str:
    if s.load_bytes > max(s.first_step.peak, s.steady.peak):
        return "model load"
    first = s.first_step.peak > s.steady.peak
    phases = s.first_step if first else s.steady
    return phases.peak_phase + (", step 1" if first else "")


def does_not_fit(est: Estimate, budget_bytes: int, safety: float) -> str:
    """Why ``est`` does not fit in ``budget_bytes`` (capacity less the ``safety`` fraction):
    the most loaded stage's peak and its components, for ``memplan.check``'s error."""
    w = est.worst
    parts = ", ".join(f"{name} {format_gib(getattr(w, attr))}" for name, attr in (
        ("params", "params_bytes"), ("grads", "grads_bytes"), ("optimizer", "optimizer_bytes"),
        ("activations", "activations_bytes")))
    return (f"does not fit: stage {w.stage} peaks at {format_gib(w.peak_bytes)} "
            f"({w.peak_phase}) > {format_gib(budget_bytes)} usable "
            f"({format_gib(est.capacity_bytes)}, {safety:.0%} kept free); {parts}")


def check_fits(est: Estimate, *, safety: float) -> Estimate:
    """``est``, or MemplanError with the breakdown (``does_not_fit``) when it does not fit in
    capacity * (1 - safety): ``memplan.check``, a launcher's pre-flight check."""
    budget = int(est.capacity_bytes * (1 - safety))
    if est.peak_bytes <= budget:
        return est
    raise MemplanError(does_not_fit(est, budget, safety))


def _buffers_label(wl) -> str:
    """The buffers line's label: what the workload keeps beside the RoPE tables."""
    kept = [name for on, name in ((wl.te_fp8.value != "none", "TE fp8 weights"),
                                  (wl.attention_global_buffer, "Megatron's global buffer"))
            if on]
    return ("registered buffers (RoPE tables)" if not kept
            else f"kept buffers (RoPE tables, {', '.join(kept)})")
