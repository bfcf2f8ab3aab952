"""memplan against published, measured GPU memory: builds ``docs/accuracy.md``.

Reads ``benchmarks/data/published_runs.json`` (runs collected from public sources, each with its
source, a quote of the numbers, what was measured and the memplan arguments that describe it),
runs ``memplan.estimate(**memplan_args)`` for each, and compares the quantity the source
measured with the memplan quantity that corresponds to it. Nothing is fitted: the estimates
use memplan's uncalibrated defaults (no calibration profile), the same as ``memplan estimate``.

Which memplan number is compared (``quantity`` of a record; ``StageMemory`` fields of the
stage named by ``rank``):

- ``max_allocated`` (``torch.cuda.max_memory_allocated`` / ``allocated_bytes.all.peak``):
  ``tensor_peak_bytes + workspace_bytes``. The cuBLAS workspace comes from PyTorch's caching
  allocator, so it is counted as allocated; the CUDA context and the allocator's reserve are not.
- ``allocated_current`` (``allocated_bytes.all.current`` logged between steps):
  ``params_bytes + grads_bytes + optimizer_bytes``, the model states that stay allocated.
- ``max_reserved`` (``torch.cuda.max_memory_reserved`` / ``reserved_bytes.all.peak``):
  ``tensor_peak_bytes + workspace_bytes + allocator_bytes``.
- ``device_used`` (nvidia-smi, ``torch.cuda.mem_get_info``): ``peak_bytes`` (context included).

``rank``: ``last`` is the last pipeline stage (Megatron-LM logs memory from rank
world_size - 1, which holds the last stage); ``max`` is the stage where the compared quantity is
largest (the source reports the maximum over GPUs, or does not say).

A record whose ``not_expressible`` list is empty is a run memplan expresses; its error counts in
the headline median and maximum. Runs with features memplan cannot express are still estimated
(as the closest expressible run) and shown, with the gaps named, and summarised on their own
line; a ``MemplanError`` is reported as ``refused: <message>``.

Other estimators: ``benchmarks/data/other_estimators.json`` (written by
``benchmarks/other_estimators.py``, which runs llm-analysis, Megatron-LM's
``theoretical_memory_usage.py`` and DeepSpeed's ZeRO model-states estimator) holds each tool's
inputs and raw outputs per run id. This script reads only that file (so the doc regenerates
without those tools) and compares the output the file names for the run's ``quantity``
(``compared``, scaled by ``unit_bytes``) with the measurement; runs a tool cannot express are
shown as ``n/a: <why>``. Each tool's summary is next to memplan's on the same runs.

Held-out runs: ``benchmarks/data/heldout_runs.json`` (written by ``benchmarks/heldout_megatron.py``
for Megatron-LM's functional tests) holds measured runs of trainers outside memplan's presets,
kept apart from the published runs and described only by the trainer's own settings
(``trainer_settings``: a Megatron ``model_config.yaml`` given to ``--megatron-args`` as it is, the
GPU count and the GPU). Each is estimated by ``memplan estimate --json`` on those settings, run
through the CLI as a user would (from the repository root, so that paths read as stored); a
``MemplanError`` is reported as ``refused: <message>``. They have their own section and their
own statistics, none of which count in the headline.

Fine-tuning runs: ``benchmarks/data/finetune_runs.json`` holds published fine-tuning
measurements (LoRA, QLoRA, 8-bit and paged optimizers, offloading) in the same record format,
a held-out set: no term of memplan is fitted to them, and they are summarised on their own
(median |error|, the fine-tuning accuracy target) apart from the runs above. Their memplan
arguments use the fine-tuning options (``FINETUNE_OPTIONS``); an option or value memplan does
not accept yet makes the row "not yet expressible: <option>" with no estimate (an estimate
without LoRA or quantization would describe another job), so the doc builds before and after
those options exist and each row turns into an estimate as its options land.

DeepSpeed runs: ``benchmarks/data/deepspeed_runs.json`` holds published DeepSpeed runs, held
out and described like the held-out runs by ``trainer_settings`` (a ds_config given to
``--deepspeed-config``, with the model, sequence and recompute as ``options``), estimated the
same way through the CLI, in a section of their own; a refusal (ZeRO-3, ZeRO-Offload) is shown
with memplan's message and the run's ``not_expressed``. A record's ``measured_phases`` (e.g.
``["first_step.forward", "first_step.backward"]``: the run stopped before its first optimizer
step) compares the most of those phases of the estimate (``phases`` of its JSON) instead of the
tensor peak, and says so in the row; ``inconsistent`` names a row that the source's own numbers
contradict, listed under the table (still counted); a published run's or a fine-tuning
run's ``inconsistent`` likewise, under its table.

``python benchmarks/accuracy_table.py`` writes the doc; ``--check`` exits 1 if it would change.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import memplan
from memplan.errors import MemplanError

DATA = ROOT / "benchmarks" / "data" / "published_runs.json"
OTHERS = ROOT / "benchmarks" / "data" / "other_estimators.json"
HELDOUT = ROOT / "benchmarks" / "data" / "heldout_runs.json"
FINETUNE = ROOT / "benchmarks" / "data" / "finetune_runs.json"
DEEPSPEED = ROOT / "benchmarks" / "data" / "deepspeed_runs.json"
DOC = ROOT / "docs" / "accuracy.md"
GiB = 2**30

QUANTITIES = ("max_allocated", "allocated_current", "max_reserved", "device_used")
# ``memplan.estimate`` keyword arguments of fine-tuning runs that memplan may not accept yet,
# with their command-line flag, probed in this order (a later one may need an earlier one:
# LoRA targets need a LoRA rank). Everything else in a run's arguments memplan accepts today.
FINETUNE_OPTIONS = {
    "gpu": "--gpu",
    "optimizer": "--optimizer",
    "offload": "--offload",
    "lora_rank": "--lora-rank",
    "lora_targets": "--lora-targets",
    "lora_dropout": "--lora-dropout",
    "base_quant": "--base-quant",
}
RANKS = ("last", "max")


def load_finetune_runs(path: Path = FINETUNE) -> list[dict]:
    """The held-out fine-tuning runs (same record format as ``load_runs``); none without
    the file."""
    return load_runs(path) if path.is_file() else []


def load_runs(path: Path = DATA) -> list[dict]:
    runs = json.loads(path.read_text())
    if not isinstance(runs, list):
        raise TypeError(f"{path}: expected a list of runs")
    return runs


def quantity_bytes(stage, quantity: str) -> int:
    """The memplan number of ``stage`` that corresponds to the measured ``quantity``."""
    if quantity == "max_allocated":
        return stage.tensor_peak_bytes + stage.workspace_bytes
    if quantity == "allocated_current":
        return stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes
    if quantity == "max_reserved":  # the lower bound; ``evaluate`` replays the allocator
        return stage.tensor_peak_bytes + stage.workspace_bytes + stage.allocator_bytes
    if quantity == "device_used":
        return stage.peak_bytes
    raise ValueError(f"unknown quantity {quantity!r}")


def load_others(path: Path = OTHERS) -> list[dict]:
    """The other estimators' stored results; one entry per tool, ``runs`` absent when the tool
    was not run at all (its ``reason`` says why)."""
    if not path.is_file():
        return []
    return json.loads(path.read_text())["estimators"]


@dataclass(frozen=True)
class Other:
    """One other estimator on one run: its number for the measured quantity, or why none."""

    label: str
    estimate_bytes: int | None
    note: str | None = None  # "n/a: <why>" or "refused: <message>" when there is no number


def other_estimate(estimator: dict, run: dict) -> Other:
    """The bytes ``estimator`` gives for what ``run`` measured: its stored output named by
    ``compared[quantity]`` times ``unit_bytes``, rounded to whole bytes."""
    label = estimator["label"]
    entry = estimator["runs"].get(run["id"])
    if entry is None:
        return Other(label, None, "n/a: not run (stored results predate this run)")
    if entry["status"] == "n/a":
        return Other(label, None, f"n/a: {entry['reason']}")
    if entry["status"] == "refused":
        return Other(label, None, f"refused: {entry['error'].splitlines()[0]}")
    key = estimator["compared"].get(run["quantity"])
    if key is None:
        return Other(label, None, f"n/a: no number for {run['quantity']}")
    return Other(label, round(entry["outputs"][key] * estimator["unit_bytes"]))


@dataclass(frozen=True)
class Row:
    run: dict
    memplan_bytes: int | None  # None when refused or not yet expressible
    refused: str | None = None
    others: tuple[Other, ...] = field(default=())
    # options of the run memplan does not accept yet ("--lora-rank 16"): no estimate
    pending: tuple[str, ...] = ()
    # a max_reserved run: the caching-allocator model's reserved peak + workspace (also its
    # memplan_bytes), the same with expandable_segments:True (memplan.model.reserved), and the
    # tensor peak + workspace alone (what reserved memory holds at least)
    reserved_bytes: int | None = None
    expandable_bytes: int | None = None
    tensor_bytes: int | None = None

    @property
    def error_pct(self) -> float | None:
        if self.memplan_bytes is None:
            return None
        return error_pct(self.memplan_bytes, self.run["measured_bytes"])

    @property
    def expressed(self) -> bool:
        return self.memplan_bytes is not None and not self.run.get("not_expressible")


def error_pct(estimate_bytes: int, measured_bytes: int) -> float:
    return 100.0 * (estimate_bytes - measured_bytes) / measured_bytes


def _model_and_args(run: dict) -> tuple[str, dict]:
    args = dict(run["memplan_args"])
    model = args.pop("model")
    path = ROOT / model
    if path.is_file():  # a config committed under benchmarks/data/configs
        model = str(path)
    return model, args


def _flag(key: str, value) -> str:
    return f"{FINETUNE_OPTIONS[key]} {value}"


def pending_options(run: dict) -> tuple[str, ...]:
    """The fine-tuning options of ``run`` that memplan does not accept yet, as flags (called
    when the run's arguments are refused).

    The run's arguments without its ``FINETUNE_OPTIONS`` are estimated first; then each of
    those options is added in ``FINETUNE_OPTIONS`` order and kept when memplan accepts it. An
    option is pending when adding it raises ``MemplanError`` (an unknown keyword, a value
    outside today's choices, or a combination today's memplan refuses, such as an optimizer
    offload without ZeRO). When the base itself is refused nothing is pending: ``evaluate``
    reports the refusal."""
    model, args = _model_and_args(run)
    accepted = {k: v for k, v in args.items() if k not in FINETUNE_OPTIONS}
    try:
        memplan.estimate(model, **accepted)
    except MemplanError:
        return ()
    pending = []
    for key in FINETUNE_OPTIONS:
        if key not in args:
            continue
        try:
            memplan.estimate(model, **{**accepted, key: args[key]})
        except MemplanError:
            pending.append(_flag(key, args[key]))
            continue
        accepted[key] = args[key]
    return tuple(pending)


def evaluate(run: dict, others: list[dict] | None = None) -> Row:
    ran = [e for e in (others or []) if "runs" in e]
    extra = tuple(other_estimate(e, run) for e in ran)
    model, args = _model_and_args(run)
    try:
        est = memplan.estimate(model, **args)
    except MemplanError as err:
        # an option memplan does not accept yet is not a refusal of the run
        pending = pending_options(run)
        if pending:
            return Row(run, None, others=extra, pending=pending)
        return Row(run, None, refused=str(err).splitlines()[0], others=extra)
    quantity = run["quantity"]
    if run["rank"] == "last":
        value = quantity_bytes(est.stages[-1], quantity)
    else:
        value = max(quantity_bytes(s, quantity) for s in est.stages)
    if quantity != "max_reserved":
        return Row(run, value, others=extra)
    reserved, expandable = reserved_bytes(est, run["rank"])
    return Row(run, reserved, others=extra, reserved_bytes=reserved, expandable_bytes=expandable,
               tensor_bytes=value)


def reserved_bytes(est, rank: str) -> tuple[int, int]:
    """The allocator model's peak reserved (``memplan.model.reserved``: each stage's reserved
    peak + cuBLAS workspace), with the allocator's defaults and with expandable segments, on
    the last stage or the most loaded one. Replayed without the catalog GPU's capacity as a
    limit: the measured jobs completed, and some ran on devices larger than the catalog GPU
    that stands for them (torchtitan's H100 96GB as h100-sxm)."""
    from memplan.model.reserved import estimate_reserved

    pairs = [(r.reserved_peak_bytes + s.workspace_bytes,
              r.expandable_reserved_peak_bytes + s.workspace_bytes)
             for s, r in zip(est.stages, estimate_reserved(est, limited=False))]
    return pairs[-1] if rank == "last" else max(pairs)


def build_rows(runs: list[dict], others: list[dict] | None = None) -> list[Row]:
    """``others`` defaults to the stored other-estimator results."""
    others = load_others() if others is None else others
    return [evaluate(run, others) for run in runs]


# ------------------------------------------------------------------------- held-out runs

HELDOUT_MEDIAN_PCT = 8.0  # the held-out target: median |error| at most this,
HELDOUT_FLOOR_PCT = -15.0  # none below this (an under-estimate that would OOM), none refused


def load_heldout(path: Path = HELDOUT) -> list[dict]:
    if not path.is_file():
        return []
    return json.loads(path.read_text())["runs"]


def load_excluded(path: Path = HELDOUT) -> dict[str, str]:
    """Runs left out of the held-out set, each with why (selection rules of the collectors)."""
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("excluded", {})


def settings_command(settings: dict) -> list[str]:
    """The ``memplan estimate --json`` command line of a held-out run's trainer settings (paths
    relative to the repository root)."""
    args = ["estimate", "--json", "--gpus", str(settings["gpus"]), "--gpu", settings["gpu"]]
    if "megatron_args" in settings:
        args += ["--megatron-args", settings["megatron_args"]]
    if "torchtitan_config" in settings:
        args += ["--torchtitan-config", settings["torchtitan_config"]]
    if "deepspeed_config" in settings:
        args += ["--deepspeed-config", settings["deepspeed_config"]]
    return args + list(settings.get("options", []))


@dataclass(frozen=True)
class HeldOut:
    """A held-out run and memplan's reading of its trainer settings: the estimate's JSON
    (``layout``, ``workload``, ``config``), None when refused."""

    row: Row
    estimate: dict | None = None

    @property
    def unread(self) -> list[str]:
        return list(((self.estimate or {}).get("config") or {}).get("unread", []))


def evaluate_heldout(run: dict) -> HeldOut:
    """``memplan estimate`` on the run's trainer settings, through the CLI; an error that is not
    a ``MemplanError`` (a crash, not a refusal) is raised."""
    from typer.testing import CliRunner

    from memplan.cli import app

    with contextlib.chdir(ROOT):  # the settings name files relative to the repository
        result = CliRunner().invoke(app, settings_command(run["trainer_settings"]))
    if result.exit_code != 0:
        if isinstance(result.exception, MemplanError):
            return HeldOut(Row(run, None, refused=str(result.exception).splitlines()[0]))
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return HeldOut(Row(run, None, refused=result.output.strip().splitlines()[-1]))
    out = json.loads(result.output)
    stages = [SimpleNamespace(**s) for s in out["stages"]]
    if run.get("measured_phases"):
        stages = [_within_phases(s, run["measured_phases"]) for s in stages]
    quantity = run["quantity"]
    if run["rank"] == "last":
        value = quantity_bytes(stages[-1], quantity)
    else:
        value = max(quantity_bytes(s, quantity) for s in stages)
    return HeldOut(Row(run, value), out)


def _within_phases(stage: SimpleNamespace, phases: list[str]) -> SimpleNamespace:
    """``stage`` with its tensor peak the most of the named phases (``"first_step.forward"``,
    ...: the estimate's ``phases``), for a run whose measurement covers only those (a record's
    ``measured_phases``, with its evidence in the record's notes)."""
    peak = max(stage.phases[step][f"{phase}_bytes"]
               for step, phase in (name.split(".") for name in phases))
    return SimpleNamespace(**{**vars(stage), "tensor_peak_bytes": peak})


def build_heldout(runs: list[dict] | None = None) -> list[HeldOut]:
    return [evaluate_heldout(run) for run in (load_heldout() if runs is None else runs)]


def _heldout_layout(estimate: dict | None) -> str:
    if estimate is None:
        return "-"
    lay, wl = estimate["layout"], estimate["workload"]
    parts = [f"{estimate['num_gpus']}x {estimate['gpu']}", f"tp{lay['tp']}"
             + (" (no SP)" if lay["tp"] > 1 and not lay["sp"] else ""),
             f"pp{lay['pp']}" + (f" vpp{lay['vpp']}" if lay["vpp"] > 1 else "")]
    parts += [f"{k}{lay[k]}" for k in ("cp", "ep", "etp") if lay.get(k, 1) > 1 or
              (k == "etp" and k in lay)]
    parts += [f"dp{lay['dp']}", f"zero{lay['zero']}", f"mbs{wl['mbs']}"]
    if wl.get("gbs"):
        parts.append(f"gbs{wl['gbs']}")
    parts += [f"seq{wl['seq']}", wl["precision"], f"recompute {wl['recompute']}",
              f"{wl['attention']} attn"]
    if wl.get("te_fp8"):
        parts.append(f"TE fp8 {wl['te_fp8']}"
                     + (" with fp8 weights" if wl.get("te_fp8_param_gather") else ""))
    return ", ".join(parts)


def heldout_summary(held: list[HeldOut]) -> list[str]:
    """The held-out statistics: over the runs memplan estimates, and how many it refuses."""
    rows = [h.row for h in held]
    errors = [r.error_pct for r in rows if r.memplan_bytes is not None]
    refused = [r for r in rows if r.refused is not None]
    out = [f"- {len(rows)} held-out runs ({', '.join(sorted({r.run['framework'] for r in rows}))})"
           f": {len(errors)} estimated, {len(refused)} refused."]
    if errors:
        worst = min(rows, key=lambda r: r.error_pct if r.error_pct is not None else 0.0)
        largest = max((r for r in rows if r.error_pct is not None),
                      key=lambda r: abs(r.error_pct))
        out += [f"- Estimated runs: {_stats(errors)}.",
                f"- Largest |error|: {largest.error_pct:+.1f}% ({largest.run['id']}); most "
                f"under: {worst.error_pct:+.1f}% ({worst.run['id']}).",
                f"- Within 8%: {sum(abs(e) <= 8.0 for e in errors)} of {len(errors)}; below "
                f"{HELDOUT_FLOOR_PCT:.0f}%: {sum(e < HELDOUT_FLOOR_PCT for e in errors)}."]
    out.append(f"- Target: median |error| <= {HELDOUT_MEDIAN_PCT:.0f}%, none below "
               f"{HELDOUT_FLOOR_PCT:.0f}%, none refused.")
    return out


def _heldout_line(held: list[HeldOut]) -> str:
    errors = [h.row.error_pct for h in held if h.row.memplan_bytes is not None]
    refused = sum(h.row.refused is not None for h in held)
    return f"{_stats(errors)}; {refused} of {len(held)} refused"


def render_heldout(held: list[HeldOut], excluded: dict[str, str]) -> list[str]:
    out = [
        "## Held-out runs",
        "",
        "Measured runs of trainers outside memplan's presets, kept apart from the runs above",
        "(`benchmarks/data/heldout_runs.json`, Megatron-LM's from",
        "`python benchmarks/heldout_megatron.py --megatron-lm PATH`) and described only by the",
        "trainer's own settings: each Megatron-LM functional test's `model_config.yaml` as it is",
        "(copied under `benchmarks/data/heldout/megatron/`), given to",
        "`memplan estimate --json --gpus 8 --gpu h100-sxm --megatron-args FILE` (the test's CI",
        "recipe runs it on one node of 8 H100 80GB); the golden values' step-10",
        "`mem-max-allocated-bytes` of the last pipeline stage against memplan's last stage, peak",
        "allocated (tensor peak + cuBLAS workspace). None of these numbers is in any test, and no",
        "term of memplan was set from them. They do not count in the summary above.",
        "",
        *heldout_summary(held),
        "",
        "| id | source | flags | memplan's reading | measured | memplan | error | not modelled "
        "(memplan's list) |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for h in held:
        r, run = h.row, h.row.run
        if r.memplan_bytes is None:
            memplan_cell, err_cell = _cell(f"refused: {r.refused}"), ""
        else:
            memplan_cell, err_cell = _gib(r.memplan_bytes), f"{r.error_pct:+.1f}%"
        out.append(
            f"| {_cell(run['id'])} | {_source_link(run)} | {_cell(' '.join(run['flags']))} | "
            f"{_cell(_heldout_layout(h.estimate))} | {_gib(run['measured_bytes'])} | "
            f"{memplan_cell} | {err_cell} | {_cell(', '.join(h.unread)) or '-'} |")
    if excluded:
        out += ["", "Left out of the held-out set, each with why (Megatron-LM tests that meet the",
                "selection of `benchmarks/heldout_megatron.py` but are left out; published FSDP2",
                "runs with gradient accumulation that were examined):", ""]
        out += [f"- `{case}`: {why}." for case, why in sorted(excluded.items())]
    return out


def load_deepspeed(path: Path = DEEPSPEED) -> list[dict]:
    """The published DeepSpeed runs (held out), each with its ds_config; none without the
    file."""
    if not path.is_file():
        return []
    return json.loads(path.read_text())["runs"]


def render_deepspeed(held: list[HeldOut]) -> list[str]:
    """The DeepSpeed section: each run estimated from its ds_config through the CLI, as the
    held-out runs are; a run memplan cannot express (ZeRO-3, ZeRO-Offload) is refused by
    memplan's own message and listed with what is not modelled."""
    rows = [h.row for h in held]
    expressed = [r.error_pct for r in rows if r.memplan_bytes is not None]
    out = ["## DeepSpeed runs (held out)", ""]
    out += _bullet(
        "Published DeepSpeed runs with measured memory (`benchmarks/data/deepspeed_runs.json`), "
        "each described only by a ds_config (committed under `benchmarks/data/deepspeed/`) and "
        "the model, GPUs, sequence and recompute policy, given to `memplan estimate --json "
        "--deepspeed-config FILE`; the most loaded rank's peak allocated (tensor peak + cuBLAS "
        "workspace) against the measured one. Nothing in memplan was set from them; they do not "
        "count in the summary above.")
    out += ["", f"- {len(rows)} runs: {len(expressed)} estimated, "
            f"{sum(r.refused is not None for r in rows)} not expressed (refused by memplan).",
            f"- Estimated runs: {_stats(expressed)}.", "",
            "| id | source | settings | measured | memplan | error | not expressed |",
            "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        run = r.run
        memplan_cell, err_cell = _memplan_cells(r)
        settings = " ".join(settings_command(run["trainer_settings"])[2:])
        if run.get("measured_phases"):
            settings += f" (compared over {', '.join(run['measured_phases'])})"
        out.append(f"| {_cell(run['id'])} | {_source_link(run)} | {_cell(settings)} | "
                   f"{_gib(run['measured_bytes'])} | {memplan_cell} | {err_cell} | "
                   f"{_cell(run.get('not_expressed', '-'))} |")
    phased = [r.run for r in rows if r.run.get("measured_phases")]
    if phased:
        out += ["", "Compared over some phases only (`measured_phases`; the evidence is in each "
                "record's notes): " + ", ".join(f"`{run['id']}`" for run in phased) + ". A run "
                "that stops before its first optimizer step holds no optimizer state and makes "
                "no step (DeepSpeed steps at the accumulation boundary, the states are made at "
                "the first step)."]
    return out + _inconsistent(r.run for r in rows) + [""]


def _inconsistent(runs) -> list[str]:
    """The runs whose ``inconsistent`` says how the source's own numbers contradict them."""
    odd = [run for run in runs if run.get("inconsistent")]
    if not odd:
        return []
    return (["", "Rows the source's own numbers contradict (kept in the statistics as "
             "measured; the computation is in each record's notes):", ""]
            + [f"- `{run['id']}`: {run['inconsistent']}." for run in odd])


def build_finetune_rows(runs: list[dict] | None = None) -> list[Row]:
    """The held-out fine-tuning runs (default: the committed file), without other
    estimators (none of them has LoRA, quantized weights or 8-bit optimizers)."""
    return [evaluate(run, []) for run in (load_finetune_runs() if runs is None else runs)]


def _layout(run: dict) -> str:
    a = run["memplan_args"]
    tp, pp, cp = a.get("tp", 1), a.get("pp", 1), a.get("cp", 1)
    dp = a["gpus"] // (tp * pp * cp)
    parts = [f"{a['gpus']}x {a.get('gpu', 'h100-sxm')}", f"tp{tp}"]
    if a.get("sequence_parallel") is False and tp > 1:
        parts[-1] += " (no SP)"
    parts.append(f"pp{pp}" + (f" vpp{a['vpp']}" if a.get("vpp", 1) > 1 else ""))
    if cp > 1:
        parts.append(f"cp{cp}")
    parts += [f"dp{dp}", f"zero{a.get('zero', 0)}", f"mbs{a.get('micro_batch_size', 1)}"]
    if "global_batch_size" in a:
        parts.append(f"gbs{a['global_batch_size']}")
    parts += [f"seq{a.get('seq_len', '?')}", a.get("precision", "bf16-mixed"),
              f"recompute {a.get('recompute', 'none')}"]
    if a.get("attention"):
        parts.append(f"{a['attention']} attn")
    parts += _finetune_parts(a)
    return ", ".join(parts)


def _finetune_parts(a: dict) -> list[str]:
    """LoRA, base quantization, optimizer, torchtune's chunked loss and offload of a run's
    arguments, where given."""
    parts = []
    if a.get("lora_rank"):
        lora = f"LoRA r{a['lora_rank']} {a.get('lora_targets', 'default targets')}"
        if a.get("lora_dropout"):
            lora += f" dropout {a['lora_dropout']}"
        parts.append(lora)
    if a.get("base_quant", "none") != "none":
        parts.append(f"{a['base_quant']} base")
    if "optimizer" in a:
        parts.append(a["optimizer"])
    if a.get("loss_impl") == "torchtune-chunked":
        parts.append(f"torchtune chunked CE x{a.get('loss_chunks', 1)}")
    if a.get("offload", "none") != "none":
        parts.append(f"offload {a['offload']}")
    if a.get("optimizer_in_backward"):
        parts.append("optimizer in backward")
    if a.get("compile"):
        parts.append("compiled layers")
    if a.get("float8", "none") != "none":
        parts.append(f"float8 {a['float8']}" + (" (float8 all-gather)"
                                                 if a.get("float8_all_gather") else ""))
    return parts


def _source_link(run: dict) -> str:
    url = run["source"].split(" ")[0]
    return f"[link]({url})" if url.startswith("http") else run["source"]


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _stats(errors: list[float]) -> str:
    if not errors:
        return "none"
    abs_err = [abs(e) for e in errors]
    return (f"median |error| {statistics.median(abs_err):.1f}%, max |error| {max(abs_err):.1f}%, "
            f"mean signed error {statistics.fmean(errors):+.1f}% over {len(errors)} runs")


def _other_summary(index: int, estimator: dict, rows: list[Row]) -> str:
    """One estimator's statistics over the runs it estimates, next to memplan's on the same
    runs (those memplan does not refuse)."""
    cells = [(r, r.others[index]) for r in rows]
    have = [(r, o) for r, o in cells if o.estimate_bytes is not None]
    both = [(r, o) for r, o in have if r.memplan_bytes is not None]
    own = [error_pct(o.estimate_bytes, r.run["measured_bytes"]) for r, o in both]
    memplan_same = [r.error_pct for r, _ in both]
    refused = sum(1 for _, o in cells if o.note and o.note.startswith("refused"))
    approximated = sum(1 for r, _ in both if not r.expressed)
    label = estimator["label"]
    where = (f"On those {len(both)}" if len(both) == len(have)
             else f"On the {len(both)} of them memplan also estimates")
    line = (f"- {estimator['tool']} {estimator['version']}: a number for {len(have)} of "
            f"{len(rows)} runs ({refused} refused, {len(rows) - len(have) - refused} n/a). "
            f"{where} ({approximated} approximated by memplan): {label} {_stats(own)}; "
            f"memplan on the same runs: {_stats(memplan_same)}.")
    only = [(r, o) for r, o in have if r.memplan_bytes is None]
    if only:
        errs = ", ".join(f"{error_pct(o.estimate_bytes, r.run['measured_bytes']):+.1f}%"
                         for r, o in only)
        line += f" On {len(only)} runs memplan refuses: {errs}."
    return line


def _other_cell(other: Other, measured_bytes: int) -> str:
    if other.estimate_bytes is None:
        return _cell(other.note or "")
    return f"{_gib(other.estimate_bytes)} ({error_pct(other.estimate_bytes, measured_bytes):+.1f}%)"


_HOW = {
    "llm-analysis": (
        "**llm-analysis {version}** (PyPI, `pip install --no-deps llm-analysis==0.2.2 "
        "'fire<0.6'`: its pins would downgrade transformers and huggingface_hub, which it needs "
        "only to read a Hub config): `LLMAnalysis(...).training(...)`, built as its `train` "
        "entry point does, with a `ModelConfig` from the run's model shape (the padded "
        "vocabulary; for a gated MLP `ffn_embed_dim` = 1.5 x the gated width, so that its "
        "2 h ffn weights and 2 ffn saved values per token equal SwiGLU's 3 h ffn and 3 ffn), "
        "its `h100-sxm-80gb` GPU config with the run's nominal capacity (80, 96 or 141 GB; only "
        "its check that the batch fits reads it, and that check refuses the runs it predicts "
        "do not fit), `w16a16e16`, tp, pp, dp, `sp_size` tp with sequence parallelism else 1, "
        "the micro-batch and gradient accumulation, sequence, recompute level (none, "
        "selective, full: 0, 1, 2), ZeRO stage (Megatron's distributed optimizer 1, FSDP 3), "
        "and for unfused attention `flash_attn=False` with `softmax_dropout` (attention "
        "dropout 0.1). Compared: `(weight+op_state+grad+act)_memory_per_gpu` with peaks, "
        "`(weight+op_state+grad)_memory_per_gpu` with allocated between steps. n/a: context "
        "parallelism and the interleaved schedule, which it has no input for."),
    "megatron": (
        "**Megatron-LM `megatron/training/theoretical_memory_usage.py`** at {version}, run "
        "from a Megatron-LM git checkout (`--megatron-lm`; it is not in the megatron-core "
        "wheel, and none of it is copied here). Per Megatron-LM CI run: the run's "
        "`model_config.yaml` read at the run's commit from the checkout's history, its "
        "MODEL_ARGS turned into flags as the CI's `_run_training.sh` does, parsed by "
        "Megatron's own `parse_args` and `validate_args` (WORLD_SIZE = the run's GPUs, its "
        "ENV_VARS set, `get_device_arch_version` answered 9 for Hopper as there is no GPU "
        "here, `typing.override` from typing_extensions on Python 3.11), the vocabulary padded "
        "by its `vocab_size_with_padding`, the micro-batch count from its calculator, then "
        "`report_theoretical_memory(args, num_microbatches=..., verbose=True)` as "
        "`training.py` calls it. Compared: `total` (weights + optimizer + activations; its "
        "'MB' is 2^20 bytes) with max allocated, `weight and optimizer` with allocated between "
        "steps. It describes rank 0 (the first stage, the most loaded shard); the CI logs the "
        "last stage. n/a: the torchtitan runs (no Megatron arguments; no FSDP)."),
    "deepspeed": (
        "**DeepSpeed {version}** ZeRO model-states estimator (installed with `--no-deps "
        "--no-build-isolation` into its own directory, not the project's environment; it "
        "imports on CPU): `estimate_zero3_model_states_mem_needs(total_params, "
        "largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload=False, "
        "cpu_offload_params=False, zero_init=True)`, the no-offload row that "
        "`estimate_zero3_model_states_mem_needs_all_cold` prints, with the spec's exact "
        "parameter count and its largest single module (the V x h embedding). Its per-GPU "
        "number (4 x largest layer + 18 bytes x parameters / GPUs) is model states only, so "
        "against a measured peak its error is mostly the activations it does not count. n/a: "
        "ZeRO-0 and ZeRO-1 runs (it has ZeRO-2 and ZeRO-3 estimators only), tp, pp or cp."),
}


def _bullet(text: str) -> list[str]:
    return textwrap.wrap(text, width=94, initial_indent="- ", subsequent_indent="  ",
                         break_on_hyphens=False, break_long_words=False)


def _other_method(estimator: dict) -> list[str]:
    """How one other estimator was run (text per tool) and what it leaves out (its data)."""
    if "runs" not in estimator:
        return _bullet(f"**{estimator['tool']}**: not run: {estimator['reason']}.")
    how = _HOW.get(estimator["id"], "**{tool} {version}**: {entry}.")
    text = how.format(version=estimator["version"], tool=estimator["tool"],
                      entry=estimator["entry"])
    return _bullet(text + " Leaves out: " + "; ".join(estimator["leaves_out"]) + ".")


def _memplan_cells(r: Row) -> tuple[str, str]:
    if r.pending:
        return _cell("not yet expressible: " + ", ".join(r.pending)), ""
    if r.memplan_bytes is None:
        return _cell(f"refused: {r.refused}"), ""
    return _gib(r.memplan_bytes), f"{r.error_pct:+.1f}%"


def _finetune_summary(rows: list[Row]) -> list[str]:
    expressed = [r.error_pct for r in rows if r.expressed]
    approximated = [r.error_pct for r in rows if r.memplan_bytes is not None and not r.expressed]
    pending = [r for r in rows if r.pending]
    flags = sorted({f.split(" ")[0] for r in pending for f in r.pending})
    refused = [r for r in rows if r.refused is not None]
    sources = sorted({r.run["framework"] for r in rows})
    return [
        f"- {len(rows)} measured fine-tuning runs ({', '.join(sources) or 'none'}), held out: "
        "nothing in memplan was fitted to them.",
        f"- Runs memplan expresses: {_stats(expressed)}.",
        f"- Runs estimated as the closest expressible run (gaps listed): {_stats(approximated)}.",
        (f"- Not yet expressible (options memplan does not accept yet: "
         f"{', '.join(flags) or 'none'}): {len(pending)}."),
        f"- Refused by memplan: {len(refused)}.",
    ]


def _finetune_headline(rows: list[Row]) -> str:
    expressed = [r.error_pct for r in rows if r.expressed]
    pending = sum(1 for r in rows if r.pending)
    return (f"- Fine-tuning runs (held out, their own section below): {len(rows)} runs; those "
            f"memplan expresses: {_stats(expressed)}; not yet expressible: {pending}.")


def render_finetune(rows: list[Row]) -> list[str]:
    """The fine-tuning section: its summary, one row per run, and how it was collected."""
    out = ["## Fine-tuning runs (held out)", ""]
    out += _bullet(
        "Published fine-tuning measurements (LoRA, QLoRA, 8-bit and paged optimizers, "
        "offloading) from `benchmarks/data/finetune_runs.json`, compared by the same method "
        "as the runs above and summarised apart from them. A run whose options memplan does "
        "not accept yet is shown as not yet expressible, with no estimate.")
    out += [""] + _finetune_summary(rows) + [
        "",
        "| id | source | framework | layout | measured | memplan | error | not expressible |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        run = r.run
        memplan_cell, err_cell = _memplan_cells(r)
        gaps = "; ".join(run.get("not_expressible") or []) or "-"
        out.append(
            f"| {_cell(run['id'])} | {_source_link(run)} | {run['framework']} | "
            f"{_cell(_layout(run))}; {run['quantity']} ({run['rank']} rank) | "
            f"{_gib(run['measured_bytes'])} | {memplan_cell} | {err_cell} | {_cell(gaps)} |")
    out += _inconsistent(r.run for r in rows)
    out.append("")
    return out


def _reserved_stats(errors: list[float]) -> str:
    if not errors:
        return "none"
    return (f"median |error| {statistics.median(abs(e) for e in errors):.1f}%, worst "
            f"under-prediction {min(min(errors), 0.0):+.1f}% over {len(errors)} runs")


def _reserved_summary(rows: list[Row]) -> list[str]:
    """The tensor peak + workspace alone and the allocator model, over the runs memplan
    expresses and over all that report reserved memory."""
    out = []
    for label, pick in (("runs memplan expresses", lambda r: r.expressed),
                        ("all runs reporting it", lambda r: r.memplan_bytes is not None)):
        have = [r for r in rows if r.reserved_bytes is not None and pick(r)]
        before = [error_pct(r.tensor_bytes, r.run["measured_bytes"]) for r in have]
        after = [error_pct(r.reserved_bytes, r.run["measured_bytes"]) for r in have]
        out.append(f"- {label.capitalize()}: allocator model {_reserved_stats(after)}; "
                   f"tensor peak + workspace alone {_reserved_stats(before)}.")
    return out


def render_reserved(rows: list[Row]) -> list[str]:
    """The runs that report reserved memory (main and fine-tuning) with the allocator model's
    reserved peak beside the tensor peak it holds."""
    have = [r for r in rows if r.reserved_bytes is not None]
    out = ["## Reserved memory: the caching-allocator model", ""]
    out += _bullet(
        "The runs above that report peak reserved memory (torchtitan's max_reserved, "
        "torchtune's and peft's reserved peaks), with memplan's reserved peak from the "
        "caching-allocator model (`memplan estimate --json`: each stage's "
        "`reserved_peak_bytes`; the stage's allocation sequence derived from the model and "
        "replayed through PyTorch's allocator rules, docs/allocator.md) + cuBLAS workspace, "
        "the number the runs above show and `plan` fits, beside the tensor peak + workspace "
        "it holds (no allocator bytes). "
        "With `expandable_segments:True`: the same replay with expandable segments (none of "
        "these runs set it). Replayed without the GPU's capacity as a limit (the jobs "
        "completed; torchtitan's ran on H100 96GB, which the catalog's h100-sxm stands for).")
    out += [""] + _reserved_summary(rows) + [
        "",
        "| id | measured | tensor peak + workspace | error | allocator model | error | "
        "expandable segments | not expressible |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in have:
        measured = r.run["measured_bytes"]
        gaps = "; ".join(r.run.get("not_expressible") or []) or "-"
        out.append(
            f"| {_cell(r.run['id'])} | {_gib(measured)} | {_gib(r.tensor_bytes)} | "
            f"{error_pct(r.tensor_bytes, measured):+.1f}% | {_gib(r.reserved_bytes)} | "
            f"{error_pct(r.reserved_bytes, measured):+.1f}% | {_gib(r.expandable_bytes)} | "
            f"{_cell(gaps)} |")
    return out + [""]


def render(rows: list[Row], others: list[dict] | None = None,
           heldout: list[HeldOut] | None = None, excluded: dict[str, str] | None = None,
           finetune: list[Row] | None = None, deepspeed: list[HeldOut] | None = None) -> str:
    """``others``: the stored other-estimator results (default: the committed file), in the
    order of each row's ``others``; ``heldout``: the held-out runs' rows (default: the
    committed held-out runs, estimated); ``finetune``: the held-out fine-tuning rows (default:
    the committed file's)."""
    others = load_others() if others is None else others
    heldout = build_heldout() if heldout is None else heldout
    excluded = load_excluded() if excluded is None else excluded
    finetune = build_finetune_rows() if finetune is None else finetune
    deepspeed = build_heldout(load_deepspeed()) if deepspeed is None else deepspeed
    ran = [e for e in others if "runs" in e]
    expressed = [r.error_pct for r in rows if r.expressed]
    approximated = [r.error_pct for r in rows if r.memplan_bytes is not None and not r.expressed]
    refused = [r for r in rows if r.refused is not None]
    sources = sorted({r.run["framework"] for r in rows})
    out = [
        "# memplan against published, measured memory",
        "",
        "Generated by `python benchmarks/accuracy_table.py` from",
        "`benchmarks/data/published_runs.json` and `benchmarks/data/other_estimators.json`;",
        "`python benchmarks/accuracy_table.py --check` fails when this file is stale (also a unit",
        "test). Each run's source, a quote of its numbers, what it measured and the memplan",
        "arguments that describe it are in the first JSON; each other estimator's version, inputs",
        "and raw outputs per run in the second. Sizes in GiB (2^30 bytes). Held-out runs",
        "(`benchmarks/data/heldout_runs.json`) and fine-tuning runs, also held out",
        "(`benchmarks/data/finetune_runs.json`), have their own sections.",
        "",
        "## Summary",
        "",
        f"- {len(rows)} measured runs ({', '.join(sources)}).",
        f"- Runs memplan expresses (nothing listed as not expressible): {_stats(expressed)}.",
        ("- Runs estimated as the closest expressible run (features memplan cannot express, "
         f"listed): {_stats(approximated)}."),
        f"- Refused by memplan: {len(refused)}.",
        *(_other_summary(i, e, rows) for i, e in enumerate(ran)),
        *([f"- Held-out runs (section below): {_heldout_line(heldout)}."] if heldout else []),
        _finetune_headline(finetune),
        *([f"- DeepSpeed runs (held out, section below): {_heldout_line(deepspeed)}."]
          if deepspeed else []),
        *(f"- Peak reserved (section below), {line[2].lower()}{line[3:]}"
          for line in _reserved_summary(rows + finetune)),
        "",
        "## Runs",
        "",
        "Other estimators: their estimate (signed error), or why there is none.",
        "",
        ("| id | source | framework | layout | measured | memplan | error | not expressible | "
         + "".join(f"{e['label']} | " for e in ran)).rstrip(),
        "|---|---|---|---|---:|---:|---:|---|" + "---:|" * len(ran),
    ]
    for r in rows:
        run = r.run
        memplan_cell, err_cell = _memplan_cells(r)
        gaps = "; ".join(run.get("not_expressible") or []) or "-"
        extra = "".join(f" {_other_cell(o, run['measured_bytes'])} |" for o in r.others)
        out.append(
            f"| {_cell(run['id'])} | {_source_link(run)} | {run['framework']} | "
            f"{_cell(_layout(run))}; {run['quantity']} ({run['rank']} rank) | "
            f"{_gib(run['measured_bytes'])} | {memplan_cell} | {err_cell} | {_cell(gaps)} |"
            + extra)
    out += _inconsistent(r.run for r in rows)
    if heldout:
        out += ["", *render_heldout(heldout, excluded)]
    out += [""] + render_finetune(finetune)
    if deepspeed:
        out += render_deepspeed(deepspeed)
    out += render_reserved(rows + finetune)
    out += [
        "## Method",
        "",
        "- Each source's measured number is compared with the memplan number that corresponds to",
        "  what it measured: peak allocated = tensor peak + cuBLAS workspace; allocated between steps",
        "  = parameters + gradients + optimizer states; peak reserved = the caching-allocator",
        "  model's reserved peak + workspace; device used = memplan's per-GPU peak (CUDA context",
        "  included).",
        "- Megatron-LM CI golden values come from rank world_size - 1, the last pipeline stage, so",
        "  memplan's last stage is compared; torchtitan reports the maximum over GPUs, so memplan's",
        "  most loaded stage (for the compared quantity) is.",
        "- memplan runs uncalibrated: its stated defaults (CUDA context, workspace) and no",
        "  calibration profile. No term was fitted to these numbers.",
        "- Error is (memplan - measured) / measured. The headline statistics count only the runs",
        "  memplan expresses; runs with float8, torch.compile, uneven pipeline stages and similar",
        "  gaps are estimated as the closest expressible run and reported on their own line.",
        "- Fine-tuning runs: the settings are read from the configuration the source names, at the",
        "  source's commit (a recipe's YAML, a launch command), and each option memplan has is set",
        "  from them (LoRA rank, targets and dropout, base-weight quantization, optimizer,",
        "  offload); what it has no option for is listed as not expressible. Options memplan does",
        "  not accept yet are found by estimating the run with and without each of them.",
        "- Model configs not in the catalog are TOML specs under `benchmarks/data/configs/`, each",
        "  with the source flags it transcribes (Megatron pads the vocabulary to a multiple of",
        "  128 x tp, so the padded size is in the spec).",
        "",
        "### Other estimators",
        "",
    ]
    out += _bullet(
        "`python benchmarks/other_estimators.py --megatron-lm PATH --deepspeed-path DIR` runs "
        "them (each in a subprocess) and stores each tool's version, the inputs it was given "
        "and its raw outputs per run id, with per-run caveats; a tool that is not available "
        "keeps its stored results. This doc reads only the stored file. No other estimator is "
        "a dependency of memplan or its test extra.")
    out += _bullet(
        "Each is given what it has inputs for and compared with the same measurement as "
        "memplan, with the same error definition; its summary line puts memplan's statistics "
        "on the same runs next to it. None of them models the CUDA context, the cuBLAS "
        "workspace or the allocator, so against a peak reserved they miss the allocator's "
        "bytes too.")
    for estimator in others:
        out += _other_method(estimator)
    out.append("")
    from benchmarks.throughput_table import render as render_throughput
    from benchmarks.throughput_table import build_rows as throughput_rows
    from benchmarks.throughput_table import load_runs as throughput_runs

    out += render_throughput(throughput_rows(throughput_runs()))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/accuracy.md differs from what would be written")
    args = parser.parse_args(argv)
    text = render(build_rows(load_runs()))
    if args.check:
        current = DOC.read_text() if DOC.is_file() else ""
        if current != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python benchmarks/accuracy_table.py")
            return 1
        print(f"{DOC.relative_to(ROOT)} is up to date")
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
