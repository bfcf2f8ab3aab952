"""memplan's step time against published training throughput: the Throughput section of
``docs/accuracy.md``.

Each run of ``benchmarks/data/throughput_runs.json`` is estimated as its source describes it
(``memplan.estimate`` with the run's ``memplan_args``) and timed by memplan's step-time model
(``memplan.planning.timing.estimate_step_time``), uncalibrated. A run is compared on MFU
where its source publishes it (counted with the source's own FLOPs where it gives the speed
beside it: ``_value``), else on tokens/s/GPU. Per group (one source's table, one job
with a knob changed) the Spearman rank correlation of memplan's numbers with the published
ones says whether memplan orders the runs as they ran.

``python benchmarks/throughput_table.py`` prints the section; ``benchmarks/accuracy_table.py``
writes it into ``docs/accuracy.md`` (and ``--check`` covers it).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import memplan  # noqa: E402
from memplan.errors import MemplanError  # noqa: E402
from memplan.hardware import load_gpu  # noqa: E402
from memplan.planning.kernels import linear_time_factor  # noqa: E402
from memplan.planning.timing import DEFAULT_MFU, estimate_step_time, step_time  # noqa: E402
from memplan.workload import Float8Recipe, StepModel  # noqa: E402

RUNS = ROOT / "benchmarks" / "data" / "throughput_runs.json"
# the targets of the step-time model (issue: a rank correlation of at least 0.8 in every group
# of three runs or more; a median |error| of at most 15% before calibration)
MIN_GROUP = 3


def load_runs(path: Path = RUNS) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["runs"]


def _args(run: dict[str, Any]) -> dict[str, Any]:
    args = dict(run["memplan_args"])
    if "/" in args["model"]:
        args["model"] = str(ROOT / args["model"])
    if "gpus_per_node" in run:  # a node of other size than the catalog GPU's
        gpu = load_gpu(args.get("gpu", "h100-sxm"))
        args["gpu"] = gpu.model_copy(update={"gpus_per_node": run["gpus_per_node"]})
    return args


# Mechanisms dropped, in this order, when memplan's memory model refuses a combination (float8
# under torch.compile, float8 with TP): the run is then timed as the closest run memplan
# expresses, and the row says what was dropped.
FALLBACKS = (("compile", "torch.compile (memory estimated eager)"),
             ("float8", "float8 (memory estimated in bf16)"))


def _timed(est: Any, run: dict[str, Any], by_kernel: bool = False) -> Any:
    """The step time of ``est`` with the run's own compile and float8 settings: a mechanism
    the memory model refuses in this combination is dropped from the memory estimate only
    (the step-time model reads it). ``by_kernel``: timed kernel by kernel whatever step
    model the run's preset selects (``kernel_model``): a run at the flat fraction takes the
    PyTorch modules' kernels (``StepModel.KERNELS_TORCH``)."""
    given = run["memplan_args"]
    update: dict[str, Any] = {}
    if by_kernel and est.workload.step_model is StepModel.MFU:
        update["step_model"] = StepModel.KERNELS_TORCH
    if given.get("compile") and not est.workload.compile:
        update["compile"] = True
    if given.get("async_tp") and not est.workload.async_tp:
        update["async_tp"] = True
    if given.get("float8", "none") != "none" and est.workload.float8 is Float8Recipe.NONE:
        update["float8"] = Float8Recipe(given["float8"])
    if not update:
        return estimate_step_time(est)
    wl = est.workload.model_copy(update=update)
    return step_time(est.spec, est.gpu, est.parallel, wl, est.global_batch_size,
                     est.num_microbatches, est.worst.num_params)


def _value(st: Any, pub: dict[str, float], quantity: str) -> float:
    """memplan's ``quantity`` for a run published as ``pub``. An MFU published beside the
    speed it was computed from (tokens/s/GPU or seconds per iteration) counts the source's
    own FLOPs (KempnerForge's metrics/mfu.py: 6 P + 12 L D S, attention without the causal
    half; Korthikanti et al. 2022: 72 B s l h^2 (1 + s / 6h + V / 12 l h), the same): memplan's MFU is then the published
    one times memplan's speed over the published speed, so that the two MFUs count the same
    FLOPs and the error is the step time's alone. Otherwise memplan's own FLOP count."""
    if quantity == "mfu" and "tokens_per_s_per_gpu" in pub:
        return pub["mfu"] * st.tokens_per_s_per_gpu / pub["tokens_per_s_per_gpu"]
    if quantity == "mfu" and "iteration_s" in pub:
        return pub["mfu"] * pub["iteration_s"] / st.step_s
    return float(getattr(st, quantity))


def predict(run: dict[str, Any], by_kernel: bool = False
            ) -> tuple[str, float | None, float | None, str, list[str]]:
    """(compared quantity, published, memplan's, refusal, mechanisms dropped) of one run.
    MFU is compared where the source publishes it (it compares across models), else
    tokens/s/GPU. ``by_kernel``: timed kernel by kernel (``_timed``)."""
    pub = run["published"]
    quantity = "mfu" if "mfu" in pub else "tokens_per_s_per_gpu"
    args, dropped = _args(run), []
    while True:
        try:
            est = memplan.estimate(**args)
            return (quantity, pub[quantity], _value(_timed(est, run, by_kernel), pub, quantity),
                    "", dropped)
        except MemplanError as err:
            left = [(k, what) for k, what in FALLBACKS if k in args]
            if not left:
                return quantity, pub[quantity], None, str(err), dropped
            args.pop(left[0][0])
            if left[0][0] == "compile":  # async TP needs compile: timed, not estimated, too
                args.pop("async_tp", None)
            dropped.append(left[0][1])


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on the ranks); None when either side is flat."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return None if va == 0 or vb == 0 else cov / (va * vb) ** 0.5


def published_step_s(run: dict[str, Any], est: Any) -> float | None:
    """Seconds per step of the run as published: its seconds per iteration, else the global
    batch's tokens over its tokens/s/GPU times the GPUs; None where only an MFU is published."""
    pub = run["published"]
    if "iteration_s" in pub:
        return float(pub["iteration_s"])
    if "tokens_per_s_per_gpu" in pub:
        tokens = est.global_batch_size * est.workload.seq_len
        return tokens / (pub["tokens_per_s_per_gpu"] * est.parallel.world_size)
    return None


def breakdown(run: dict[str, Any]) -> dict[str, Any] | None:
    """Where memplan's step time goes for ``run`` (uncalibrated), None where memplan refuses
    the run as given: the step's seconds and its compute, pipeline bubble and exposed
    communication; ``rate``, the compute's hardware FLOPs per GPU per second over the GPU's
    dense BF16 peak; ``linear``, the decoder linears' time factor from the measured GEMM rates
    by shape (``memplan.planning.kernels.linear_time_factor``; 1 on a GPU without a table);
    ``left_rate``, the rate the published step leaves for the same hardware FLOPs once
    memplan's bubble and exposed communication are taken out of it (None without a published
    speed, or where those two alone exceed it). Read, not fitted: nothing here enters the
    model."""
    try:
        est = memplan.estimate(**_args(run))
    except MemplanError:
        return None
    st = _timed(est, run)
    flops_per_gpu = st.hardware_flops / est.parallel.world_size
    peak = est.gpu.bf16_flops
    pub_s = published_step_s(run, est)
    left = None if pub_s is None else pub_s - st.bubble_s - st.exposed_comm_s
    float8 = run["memplan_args"].get("float8", "none") != "none"
    return {"est": est, "st": st, "published_s": pub_s,
            "rate": flops_per_gpu / st.compute_s / peak,
            "left_rate": None if left is None or left <= 0 else flops_per_gpu / left / peak,
            "linear": linear_time_factor(est.spec, est.gpu, est.parallel.tp, float8,
                                         DEFAULT_MFU)}


# the step's terms that ``term_rho`` leaves out, by name: the StepTime fields they sum
TERMS = {"the bubble": ("bubble_s",), "the exposed communication": ("exposed_comm_s",),
         "both (compute alone)": ("bubble_s", "exposed_comm_s")}


def term_rho(members: list[dict[str, Any]]) -> dict[str, float | None]:
    """A group's rank correlation with each of ``TERMS`` left out of memplan's step: memplan's
    number (MFU or tokens/s, both inverse to the step) times step / (step - the term). Which
    term orders the runs wrongly: one whose removal restores the order."""
    done = [(r, breakdown(r["run"])) for r in members if r["memplan"] is not None]
    done = [(r, b) for r, b in done if b is not None]
    out = {}
    for name, fields in TERMS.items():
        mine = []
        for r, b in done:
            st = b["st"]
            mine.append(r["memplan"] * st.step_s
                        / (st.step_s - sum(getattr(st, f) for f in fields)))
        out[name] = (spearman([r["published"] for r, _ in done], mine)
                     if len(done) >= 2 else None)
    return out


def build_rows(runs: list[dict[str, Any]], by_kernel: bool = False) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        quantity, pub, est, refused, dropped = predict(run, by_kernel)
        rows.append({"run": run, "quantity": quantity, "published": pub, "memplan": est,
                     "refused": refused, "dropped": dropped,
                     "error": None if est is None else est / pub - 1.0})
    return rows


def groups(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["run"]["group"], []).append(r)
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median |error| and each group's rank correlation (what the targets read)."""
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    rho = {}
    for name, members in groups(rows).items():
        done = [r for r in members if r["memplan"] is not None]
        # a flat prediction orders nothing: None, read as 0
        rho[name] = (spearman([r["published"] for r in done], [r["memplan"] for r in done])
                     if len(done) >= 2 else None)
    return {"median_abs_error": statistics.median(errors) if errors else None,
            "rho": rho, "runs": len(rows), "estimated": len(errors)}


def _num(quantity: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if quantity == "mfu" else f"{value:,.0f}"


def _rho(value: float | None) -> str:
    return "0 (flat)" if value is None else f"{value:+.2f}"


def _below_target(rows: list[dict[str, Any]], rho: dict[str, float | None]) -> list[str]:
    """Where memplan's step goes in each group of ``MIN_GROUP`` runs or more whose rank
    correlation is under 0.8 (``breakdown``), and the group's correlation with each term of
    the step left out (``term_rho``)."""
    low = [n for n, m in groups(rows).items()
           if len(m) >= MIN_GROUP and (rho[n] is None or rho[n] < 0.8)]
    if not low:
        return []
    out = ["", "Where memplan's step goes in the groups below the rank target: its seconds of",
           "compute, pipeline bubble and exposed communication; the rate its compute runs at",
           "(hardware FLOPs per GPU per second of compute over the dense BF16 peak); the",
           "decoder linears' time factor from the measured GEMM rates by shape",
           "(`memplan.planning.kernels`, 1 on a GPU without a table); and the rate the",
           "published step leaves for the same FLOPs once memplan's bubble and exposed",
           "communication are taken out of it (`benchmarks/step_time_breakdown.py`). Each",
           "group's rank correlation is given again with a term of memplan's step left out:",
           "a term whose removal restores the order is the one that misorders the runs.", ""]
    for name in low:
        left = "; ".join(f"without {t}: {_rho(v)}"
                         for t, v in term_rho(groups(rows)[name]).items())
        out.append(f"- {name}: {_rho(rho[name])}; {left}.")
    out += ["",
            "| run | hidden / tp | memplan step s | compute s | bubble s | exposed comm s | "
            "published step s | compute rate | GEMM shape factor | rate the published step "
            "leaves |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in low:
        for r in groups(rows)[name]:
            b = breakdown(r["run"])
            if b is None:
                continue
            st, est = b["st"], b["est"]
            pub = "-" if b["published_s"] is None else f"{b['published_s']:.2f}"
            left = "-" if b["left_rate"] is None else f"{b['left_rate']:.3f}"
            out.append(f"| {r['run']['id']} | {est.spec.hidden_size} / {est.parallel.tp} | "
                       f"{st.step_s:.2f} | {st.compute_s:.2f} | {st.bubble_s:.2f} | "
                       f"{st.exposed_comm_s:.2f} | {pub} | {b['rate']:.3f} | "
                       f"{b['linear']:.3f} | {left} |")
    return out


def kernel_model(rows: list[dict[str, Any]], kern: list[dict[str, Any]]) -> list[str]:
    """Every run timed kernel by kernel (``kern``: ``build_rows`` with ``by_kernel``, the GEMMs
    at the measured rates by shape, the attention at FlashAttention-2's, the memory-bound
    kernels by their bytes; the runs at the flat fraction with the PyTorch modules' kernels),
    per group beside the step model each run's preset selects (``rows``): what the published
    kernel rates alone say, not a fit."""
    s, k = summary(rows), summary(kern)
    big = [n for n, m in groups(kern).items() if len(m) >= MIN_GROUP]
    passing = sum(1 for n in big if k["rho"][n] is not None and k["rho"][n] >= 0.8)
    out = ["", "### Kernel by kernel", "",
           "Every run timed kernel by kernel (`step_model` kernels for the Megatron-LM runs,",
           "`kernels-torch` for the others: the GEMMs at the measured rates by shape of",
           "`memplan.planning.kernels`, the attention at FlashAttention-2's measured rate,",
           "the PyTorch modules' memory-bound kernels by their bytes, the optimizer's step by",
           "its bytes), beside the step model each run's preset selects (the flat fraction",
           "outside Megatron-LM). The published kernel rates alone, nothing fitted to these",
           "runs. Where a group's signed error kernel by kernel is large and positive, its",
           "published steps spend time the kernels and the modelled communication do not",
           "account for; torchtitan's 2024 H100s are 96 GB HBM2e parts at a 500 W limit whose",
           "peak is \"between SXM and NVL, and we don't know its exact value\" (its",
           "benchmarks/llama3_h100_202412_torchtitan.md, footnote 2), below the SXM part the",
           "kernel rates were measured on, yet with the GEMMs scaled to the H100 NVL's 835",
           "TFLOP/s (dense BF16; NVIDIA H100 datasheet, 1,671 with sparsity) those groups",
           "would still be over by a quarter or more. No preset but Megatron-LM's selects this",
           "step model.", "",
           f"- Median |error| kernel by kernel: {k['median_abs_error']:.1%} over "
           f"{k['estimated']} runs (as selected: {s['median_abs_error']:.1%}).",
           f"- Groups of {MIN_GROUP} runs or more with a rank correlation of at least 0.8: "
           f"{passing} of {len(big)}.", "",
           "| group | rank correlation, as selected | kernel by kernel | median signed error, "
           "as selected | kernel by kernel |", "|---|---:|---:|---:|---:|"]
    for name, members in groups(kern).items():
        def med(group: list[dict[str, Any]]) -> str:
            errs = [r["error"] for r in group if r["error"] is not None]
            return f"{statistics.median(errs):+.1%}" if errs else "-"
        out.append(f"| {name} | {_rho(s['rho'][name])} | {_rho(k['rho'][name])} | "
                   f"{med(groups(rows)[name])} | {med(members)} |")
    return out


def render(rows: list[dict[str, Any]]) -> list[str]:
    s = summary(rows)
    big = [n for n, m in groups(rows).items() if len(m) >= MIN_GROUP]
    passing = sum(1 for n in big if s["rho"][n] is not None and s["rho"][n] >= 0.8)
    out = [
        "## Throughput",
        "",
        "memplan's step time (`memplan.planning.timing`, uncalibrated) against published",
        f"training throughput: {s['runs']} runs in {len(groups(rows))} groups",
        "(`benchmarks/data/throughput_runs.json`, each with its source, the numbers as printed",
        "and the configuration memplan is given; `benchmarks/throughput_table.py`). A run is",
        "compared on MFU (model FLOPs over the GPU's dense BF16 peak) where its source publishes",
        "it, else on tokens/s/GPU. An MFU published beside the speed it was computed from",
        "(tokens/s or seconds per iteration) counts the source's own FLOPs, so memplan's is",
        "taken the same way: the published MFU times memplan's speed over the published one;",
        "without a speed, memplan counts its own FLOPs (causal attention at half the full",
        "product). Error is memplan / published - 1. Within a group (one",
        "job, one or two knobs changed) the Spearman rank correlation says whether memplan orders",
        "the runs as they ran; a group's correlation is only meaningful from three runs.",
        "Megatron-LM runs are timed kernel by kernel (the step model its preset selects,",
        "`step_model` kernels): their GEMMs at the measured GEMM rates",
        "(`memplan.planning.kernels.gemm_time_factor`; the A100 at 271.2 TFLOP/s) and their",
        "memory-bound per-token kernels (norms, bias-dropout-add, activation, softmax over",
        "materialised scores, the loss) by the bytes they move over the HBM bandwidth",
        "(`elementwise_bytes`), the optimizer's step by its bytes too",
        "(`optimizer_step_seconds`), and their pipeline sends wait without virtual stages",
        "(`pipeline_p2p` blocking); the other runs at the flat fraction of peak (`DEFAULT_MFU`).",
        "",
        f"- Median |error|: {s['median_abs_error']:.1%} over {s['estimated']} runs.",
        f"- Groups of {MIN_GROUP} runs or more with a rank correlation of at least 0.8: "
        f"{passing} of {len(big)}.",
        "",
        "| group | runs | rank correlation | median \\|error\\| |",
        "|---|---:|---:|---:|",
    ]
    for name, members in groups(rows).items():
        errs = [abs(r["error"]) for r in members if r["error"] is not None]
        med = f"{statistics.median(errs):.1%}" if errs else "-"
        out.append(f"| {name} | {len(members)} | {_rho(s['rho'][name])} | {med} |")
    out += _below_target(rows, s["rho"])
    kern = build_rows([r["run"] for r in rows], by_kernel=True)
    out += kernel_model(rows, kern)
    out += ["", "| run | configuration (as published) | published | memplan | error | "
            "kernel by kernel | not expressible |", "|---|---|---:|---:|---:|---:|---|"]
    for r, kr in zip(rows, kern):
        run = r["run"]
        unit = " MFU" if r["quantity"] == "mfu" else ""
        est = _num(r["quantity"], r["memplan"]) if not r["refused"] else f"refused: {r['refused']}"
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        gaps = "; ".join(run["not_expressible"] + r["dropped"]) or "-"
        by_kernel = ("-" if kr["error"] is None else
                     f"{_num(kr['quantity'], kr['memplan'])} ({kr['error']:+.1%})")
        quote = run["quote"].replace("|", "/")
        link = run["source"].split(" ")[0]
        out.append(f"| [{run['id']}]({link}) | {quote} | {_num(r['quantity'], r['published'])}"
                   f"{unit} | {est} | {err} | {by_kernel} | {gaps} |")
    out.append("")
    return out


def main() -> int:
    print("\n".join(render(build_rows(load_runs()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
