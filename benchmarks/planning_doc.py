"""memplan's plans next to published layouts: builds the tables of ``docs/planning.md``.

For each published training run (the Llama 3 paper's 405B pre-training, torchtitan's H100
benchmarks) it runs ``memplan.plan`` on the same model, GPU count, sequence and global batch
(generic and with the run's ``--framework``), and ``memplan.estimate`` on the published layout as
its authors describe it. The prose of the doc is written by hand around the tables this script
writes between ``<!-- table:NAME -->`` and ``<!-- end -->`` markers.

``python benchmarks/planning_doc.py`` rewrites the tables; ``--check`` exits 1 if they would
change.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import memplan
from memplan.planning.timing import estimate_step_time, step_flops
from memplan.report.plan import _layout

DOC = ROOT / "docs" / "planning.md"
GiB = 2**30

# (table name, model, GPUs, plan arguments, framework of the published run)
PLANS = [
    ("plan-405b-16384", "llama-3.1-405b", 16384,
     {"seq_len": 8192, "global_batch_size": 2048}, None),
    ("plan-405b-512", "llama-3.1-405b", 512,
     {"seq_len": 8192, "global_batch_size": 256, "gpu_memory": "96GB"}, "torchtitan"),
    ("plan-70b-512", "llama-3.1-70b", 512,
     {"seq_len": 8192, "global_batch_size": 1024, "gpu_memory": "96GB"}, "torchtitan"),
    ("plan-70b-256", "llama-3.1-70b", 256,
     {"seq_len": 8192, "global_batch_size": 512, "gpu_memory": "96GB"}, "torchtitan"),
    ("plan-8b-8", "llama-3.1-8b", 8,
     {"seq_len": 8192, "global_batch_size": 16, "gpu_memory": "96GB"}, "torchtitan"),
    ("plan-8b-128", "llama-3.1-8b", 128,
     {"seq_len": 8192, "global_batch_size": 256, "gpu_memory": "96GB"}, "torchtitan"),
]

_LLAMA3 = dict(model="llama-3.1-405b", gpus=16384, tp=8, pp=16, vpp=8,
               stage_layers="0,1x126,0", seq_len=8192, global_batch_size=2048,
               micro_batch_size=1)
_TITAN = dict(framework="torchtitan", precision="fsdp-bf16", seq_len=8192, gpu_memory="96GB")

# (label, published tokens/s/GPU or None, published memory GiB or None, estimate arguments)
PUBLISHED = [
    ("Llama 3 405B, 16,384 H100: TP8 PP16 (v8, 0,1x126,0) DP128, ZeRO-1, no recompute",
     "400 TFLOP/s/GPU", None, dict(zero=1, recompute="none", **_LLAMA3)),
    ("the same, ZeRO-2 (gradients sharded too)", "", None,
     dict(zero=2, recompute="none", **_LLAMA3)),
    ("the same, ZeRO-1, full recompute of 3 of each stage's 8 layers", "", None,
     dict(zero=1, recompute="full", recompute_layers=3, **_LLAMA3)),
    ("torchtitan 405B, 512 H100: FSDP8 TP8 PP8 1F1B, local batch 32, full AC", "100", 82.5,
     dict(model="llama-3.1-405b", gpus=512, tp=8, pp=8, zero=3, global_batch_size=256,
          micro_batch_size=4, recompute="full", **_TITAN)),
    ("the same, interleaved 1F1B (2 stages per rank)", "128", 72.7,
     dict(model="llama-3.1-405b", gpus=512, tp=8, pp=8, vpp=2, zero=3, global_batch_size=256,
          micro_batch_size=4, recompute="full", **_TITAN)),
    ("torchtitan 70B, 256 H100: FSDP32 TP8, local batch 16, full AC", "829", 71.9,
     dict(model="llama-3.1-70b", gpus=256, tp=8, zero=3, global_batch_size=512,
          micro_batch_size=16, recompute="full", **_TITAN)),
    ("torchtitan 8B, 8 H100: FSDP8, local batch 2, selective AC", "5,762", 82.4,
     dict(model="llama-3.1-8b", gpus=8, zero=3, global_batch_size=16, micro_batch_size=2,
          recompute="selective", **_TITAN)),
    ("torchtitan 8B, 128 H100: FSDP128, local batch 2, selective AC", "5,605", 67.0,
     dict(model="llama-3.1-8b", gpus=128, zero=3, global_batch_size=256, micro_batch_size=2,
          recompute="selective", **_TITAN)),
]


def _recompute(c) -> str:
    return c.recompute.label + (f" {c.recompute_layers}" if c.recompute_layers else "")


def plan_table(model: str, gpus: int, fields: dict, framework: str | None) -> str:
    rows = ["| framework | layout | mbs | recompute | peak GiB | tokens/s/GPU | MFU |",
            "|---|---|---:|---|---:|---:|---:|"]
    for fw in (None, framework) if framework else (None,):
        # torchtitan trains as FSDP2's mixed precision does: fp32 weights, bf16 compute
        recipe = {"precision": "fsdp-bf16"} if fw == "torchtitan" else {}
        result = memplan.plan(model, gpus=gpus, framework=fw, **fields, **recipe)
        for c in result.candidates[:3]:
            rows.append(f"| {fw or 'generic'} | {_layout(c.layout)} | {c.micro_batch_size} | "
                        f"{_recompute(c)} | {c.peak_bytes / GiB:.1f} | "
                        f"{c.time.tokens_per_s_per_gpu:,.0f} | {c.time.mfu:.2f} |")
        if not result.candidates:
            rows.append(f"| {fw or 'generic'} | nothing fits | | | | | |")
    return "\n".join(rows)


def published_table() -> str:
    rows = ["| published run | published tokens/s/GPU | published GiB | memplan peak GiB "
            "(stage) | fits | memplan tokens/s/GPU | model FLOPs/token |",
            "|---|---:|---:|---:|---|---:|---:|"]
    for label, tps, gib, args in PUBLISHED:
        est = memplan.estimate(**args)
        t = estimate_step_time(est)
        model, _ = step_flops(est.spec, est.workload, 1, pp=est.parallel.pp,
                              vpp=est.parallel.vpp, split=est.parallel.stage_layers)
        per_token = model / est.workload.seq_len
        fits = "yes" if est.fits else "no"
        rows.append(f"| {label} | {tps} | {'' if gib is None else f'{gib:.1f}'} | "
                    f"{est.peak_bytes / GiB:.1f} ({est.worst.stage}) | {fits} | "
                    f"{t.tokens_per_s_per_gpu:,.0f} | {per_token:.3g} |")
    return "\n".join(rows)


def tables() -> dict[str, str]:
    out = {name: plan_table(model, gpus, fields, fw) for name, model, gpus, fields, fw in PLANS}
    out["published"] = published_table()
    return out


def render(text: str, generated: dict[str, str]) -> str:
    for name, table in generated.items():
        pattern = re.compile(rf"(<!-- table:{re.escape(name)} -->\n)(?:(?!<!-- ).)*?"
                             rf"(<!-- end -->)", re.DOTALL)
        if not pattern.search(text):
            raise SystemExit(f"{DOC}: no <!-- table:{name} --> marker")
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    current = DOC.read_text()
    new = render(current, tables())
    if args.check:
        if new != current:
            print(f"{DOC} is stale: run python benchmarks/planning_doc.py")
            sys.exit(1)
        print(f"{DOC} is up to date")
        return
    DOC.write_text(new)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
