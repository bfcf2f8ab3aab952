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

``python benchmarks/accuracy_table.py`` writes the doc; ``--check`` exits 1 if it would change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import memplan
from memplan.errors import MemplanError

DATA = ROOT / "benchmarks" / "data" / "published_runs.json"
DOC = ROOT / "docs" / "accuracy.md"
GiB = 2**30

QUANTITIES = ("max_allocated", "allocated_current", "max_reserved", "device_used")
RANKS = ("last", "max")


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
    if quantity == "max_reserved":
        return stage.tensor_peak_bytes + stage.workspace_bytes + stage.allocator_bytes
    if quantity == "device_used":
        return stage.peak_bytes
    raise ValueError(f"unknown quantity {quantity!r}")


@dataclass(frozen=True)
class Row:
    run: dict
    memplan_bytes: int | None  # None when refused
    refused: str | None = None

    @property
    def error_pct(self) -> float | None:
        if self.memplan_bytes is None:
            return None
        measured = self.run["measured_bytes"]
        return 100.0 * (self.memplan_bytes - measured) / measured

    @property
    def expressed(self) -> bool:
        return self.memplan_bytes is not None and not self.run.get("not_expressible")


def evaluate(run: dict) -> Row:
    args = dict(run["memplan_args"])
    model = args.pop("model")
    path = ROOT / model
    if path.is_file():  # a config committed under benchmarks/data/configs
        model = str(path)
    try:
        est = memplan.estimate(model, **args)
    except MemplanError as err:
        return Row(run, None, refused=str(err).splitlines()[0])
    quantity = run["quantity"]
    if run["rank"] == "last":
        value = quantity_bytes(est.stages[-1], quantity)
    else:
        value = max(quantity_bytes(s, quantity) for s in est.stages)
    return Row(run, value)


def build_rows(runs: list[dict]) -> list[Row]:
    return [evaluate(run) for run in runs]


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
    return ", ".join(parts)


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


def render(rows: list[Row]) -> str:
    expressed = [r.error_pct for r in rows if r.expressed]
    approximated = [r.error_pct for r in rows if r.memplan_bytes is not None and not r.expressed]
    refused = [r for r in rows if r.refused is not None]
    sources = sorted({r.run["framework"] for r in rows})
    out = [
        "# memplan against published, measured memory",
        "",
        "Generated by `python benchmarks/accuracy_table.py` from `benchmarks/data/published_runs.json`;",
        "`python benchmarks/accuracy_table.py --check` fails when this file is stale (also a unit test).",
        "Each run's source, a quote of its numbers, what it measured and the memplan arguments that",
        "describe it are in the JSON. Sizes in GiB (2^30 bytes).",
        "",
        "## Summary",
        "",
        f"- {len(rows)} measured runs ({', '.join(sources)}).",
        f"- Runs memplan expresses (nothing listed as not expressible): {_stats(expressed)}.",
        ("- Runs estimated as the closest expressible run (features memplan cannot express, "
         f"listed): {_stats(approximated)}."),
        f"- Refused by memplan: {len(refused)}.",
        "",
        "## Runs",
        "",
        "| id | source | framework | layout | measured | memplan | error | not expressible |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        run = r.run
        if r.memplan_bytes is None:
            memplan_cell, err_cell = _cell(f"refused: {r.refused}"), ""
        else:
            memplan_cell, err_cell = _gib(r.memplan_bytes), f"{r.error_pct:+.1f}%"
        gaps = "; ".join(run.get("not_expressible") or []) or "-"
        out.append(
            f"| {_cell(run['id'])} | {_source_link(run)} | {run['framework']} | "
            f"{_cell(_layout(run))}; {run['quantity']} ({run['rank']} rank) | "
            f"{_gib(run['measured_bytes'])} | {memplan_cell} | {err_cell} | {_cell(gaps)} |")
    out += [
        "",
        "## Method",
        "",
        "- Each source's measured number is compared with the memplan number that corresponds to",
        "  what it measured: peak allocated = tensor peak + cuBLAS workspace; allocated between steps",
        "  = parameters + gradients + optimizer states; peak reserved = tensor peak + workspace +",
        "  allocator reserve; device used = memplan's per-GPU peak (CUDA context included).",
        "- Megatron-LM CI golden values come from rank world_size - 1, the last pipeline stage, so",
        "  memplan's last stage is compared; torchtitan reports the maximum over GPUs, so memplan's",
        "  most loaded stage (for the compared quantity) is.",
        "- memplan runs uncalibrated: its stated defaults (CUDA context, workspace, a 5% allocator",
        "  reserve) and no calibration profile. No term was fitted to these numbers.",
        "- Error is (memplan - measured) / measured. The headline statistics count only the runs",
        "  memplan expresses; runs with float8, torch.compile, uneven pipeline stages and similar",
        "  gaps are estimated as the closest expressible run and reported on their own line.",
        "- Model configs not in the catalog are TOML specs under `benchmarks/data/configs/`, each",
        "  with the source flags it transcribes (Megatron pads the vocabulary to a multiple of",
        "  128 x tp, so the padded size is in the spec).",
        "",
    ]
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
