"""A fixed sweep of ``memplan estimate --json`` over many configurations, to pin the numbers.

Every configuration is drawn from one seeded generator over the catalog models (dense and MoE)
and every option that changes the bytes: recompute policy and k-of-L, precision, attention,
norm, ZeRO stage, tp/pp/vpp/cp/ep, sequence parallelism, TP style, gradient buffers, loss
chunks, offload, optimizer and its implementation, schedule, micro- and global batch. Invalid
draws are redrawn, so the sweep holds exactly ``--count`` valid configurations (600), in
draw order. After them come the uneven ones (``uneven_configs``, appended when the first 600
were already recorded, which stayed as they were): data-parallel sizes 3, 5, 6 and 12, four
configurations for each with ZeRO 1, 2 and 3, drawn by the same generator from their own seed,
so that a shard rounded the wrong way (floor for ceil) moves a number. Every record must also
satisfy ``invariants``, which hold by construction of the JSON.

    python benchmarks/sweep_estimates.py --write tests/data/estimate_sweep.jsonl.gz
    python benchmarks/sweep_estimates.py --check tests/data/estimate_sweep.jsonl.gz

``--check`` compares each configuration's JSON with the recorded one and prints every field
that differs (keys the recorded file does not have are new fields, listed once and ignored)
and every invariant a new record breaks. ``--write`` refuses to write a record that breaks an
invariant and, over an existing file, prints how many configurations changed and, per field,
in how many configurations it moved (why is the committer's to say in the commit).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

MODELS = ("tiny", "gpt2", "llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-7b",
          "llama-2-70b", "mixtral-8x7b", "llama-3.1-405b", "gpt3-175b")
SEED = 20261201
# Appended after the first 600 (which stay as first recorded): data-parallel sizes that are
# not powers of two, each with ZeRO 1, 2 and 3, from their own generator.
UNEVEN_SEED = 20261202
UNEVEN_DP = (3, 5, 6, 12)
UNEVEN_PER = 4


def _draw(rng: random.Random) -> dict[str, Any]:
    model = rng.choice(MODELS)
    tp = rng.choice([1, 1, 2, 4, 8])
    pp = rng.choice([1, 1, 2, 4, 8])
    vpp = rng.choice([1, 1, 2, 4]) if pp > 1 else 1
    cp = rng.choice([1, 1, 1, 2, 4])
    dp = rng.choice([1, 2, 4, 8, 16])
    ep = rng.choice([1, 2, 4, 8]) if model == "mixtral-8x7b" else 1
    recompute = rng.choice(["none", "selective", "full", "full"])
    cfg: dict[str, Any] = {
        "model": model, "gpus": tp * pp * cp * dp, "tp": tp, "pp": pp, "vpp": vpp, "cp": cp,
        "ep": ep, "zero": rng.choice([0, 1, 2, 3]),
        "gpu": rng.choice(["h100-sxm", "a100-80gb", "h200"]),
        "micro_batch_size": rng.choice([1, 1, 2, 4, 8]),
        "seq_len": rng.choice([512, 1024, 2048, 4096, 8192]),
        "precision": rng.choice(["bf16-mixed", "bf16-fp32-grads", "fp16-mixed", "fp32",
                                 "fsdp-bf16", "bf16-pure", "amp-bf16", "amp-fp16"]),
        "optimizer": rng.choice(["adamw", "adamw", "adamw", "sgd"]),
        "optimizer_impl": rng.choice(["foreach", "fused", "forloop"]),
        "recompute": recompute,
        "attention": rng.choice(["flash", "flash", "eager"]),
        "norm_impl": rng.choice(["upcast", "fused"]),
        "logits_fp32": rng.choice([True, True, False]),
        "loss_chunks": rng.choice([1, 1, 1, 4, 8]),
        "sequence_parallel": rng.choice([None, None, False]) if tp > 1 else None,
        "vocab_parallel": rng.choice([True, True, False]),
        "tp_style": rng.choice(["megatron", "dtensor"]),
        "grad_buffers": rng.choice(["view", "copy"]),
        "offload": rng.choice(["none", "none", "none", "optimizer"]),
        "schedule": rng.choice(["1f1b", "1f1b", "gpipe"]),
    }
    if recompute == "full" and rng.random() < 0.4:
        cfg["recompute_layers"] = rng.choice([0, 1, 2, 3])
    if rng.random() < 0.3:
        cfg["global_batch_size"] = cfg["micro_batch_size"] * dp * pp * rng.choice([1, 2, 4])
    return cfg


def _valid(cfg: dict[str, Any]) -> bool:
    import memplan
    from memplan.errors import MemplanError

    try:
        memplan.estimate(**cfg)
    except MemplanError:
        return False
    return True


def configs(count: int, seed: int = SEED) -> list[dict[str, Any]]:
    """``count`` valid configurations (those ``memplan.estimate`` accepts), in draw order."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < count:
        cfg = _draw(rng)
        if _valid(cfg):
            out.append(cfg)
    return out


def _with_dp(cfg: dict[str, Any], dp: int, zero: int) -> dict[str, Any]:
    """``cfg`` at data-parallel size ``dp`` and ZeRO stage ``zero`` (GPUs and global batch
    follow)."""
    old_dp = cfg["gpus"] // (cfg["tp"] * cfg["pp"] * cfg["cp"])
    out = {**cfg, "gpus": cfg["tp"] * cfg["pp"] * cfg["cp"] * dp, "zero": zero}
    if "global_batch_size" in cfg:
        out["global_batch_size"] = cfg["global_batch_size"] // old_dp * dp
    return out


def uneven_configs(seed: int = UNEVEN_SEED) -> list[dict[str, Any]]:
    """``UNEVEN_PER`` valid configurations for each dp in ``UNEVEN_DP`` and ZeRO stage 1, 2
    and 3: shard degrees that divide few parameter counts, so a floor where a ceil belongs
    (or the reverse) moves a number."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for dp in UNEVEN_DP:
        for zero in (1, 2, 3):
            found = 0
            while found < UNEVEN_PER:
                cfg = _with_dp(_draw(rng), dp, zero)
                if _valid(cfg):
                    out.append(cfg)
                    found += 1
    return out


def all_configs(count: int) -> list[dict[str, Any]]:
    """The recorded sweep: ``count`` drawn configurations, then the uneven ones."""
    return configs(count) + uneven_configs()


def record(cfg: dict[str, Any]) -> dict[str, Any]:
    """The configuration and its ``estimate --json`` object."""
    import memplan
    from memplan.report import estimate_json

    return {"config": cfg, "estimate": estimate_json(memplan.estimate(**cfg))}


# Bytes per element of each precision's (weights, gradients, fp32 master copy, what the
# optimizer updates), from the mixed-precision recipes (Micikevicius et al. 2018; torch.optim
# creates states with zeros_like of what it updates), stated here independently of memplan.
PRECISION_BYTES = {"bf16-mixed": (2, 2, 4, 4), "bf16-fp32-grads": (2, 4, 4, 4),
                   "fp16-mixed": (2, 2, 4, 4), "fp32": (4, 4, 0, 4), "fsdp-bf16": (4, 4, 0, 4),
                   "bf16-pure": (2, 2, 0, 2), "amp-bf16": (4, 4, 0, 4), "amp-fp16": (4, 4, 0, 4)}
# torch.amp.GradScaler's fp32 scale and int32 growth tracker (fp16 autocast only)
GRAD_SCALER_BYTES = {"amp-fp16": 4 + 4}
PHASE_NAMES = ("forward_bytes", "backward_bytes", "optimizer_bytes")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def invariants(rec: dict[str, Any]) -> list[str]:
    """Each property a record must have by construction of ``estimate --json``, violated.

    Per stage:
      1. peak = tensor peak + CUDA context + workspace + allocator + calibration (the lines
         ``report`` prints add up to the peak);
      2. the allocator line is 5% of the tensor peak (uncalibrated), rounded down;
      3. the tensor peak is the largest of the six phase peaks (step 1 and steady);
      4. both steps' optimizer phases are the same (no activation is alive at the step, the
         states exist by then) and the steady forward and backward hold at least step 1's
         (the steady state adds optimizer states, kept gradients, held logits);
      5. the optimizer phase is weights + gradients + optimizer states + the step's
         temporaries + registered buffers + DDP's copied gradient buckets, exactly (no sweep
         configuration holds logits across the step);
      6. the steady forward holds at least weights + optimizer states + buffers (and every
         gradient with more than one micro-batch per step: the earlier ones made them), the
         steady backward at least those and every gradient (its end); step 1 alike without
         the optimizer states;
      7. without virtual stages, all saved activations are the micro-batches in flight times
         one micro-batch's terms;
      8. for dense models: weights, gradients and optimizer states are the rank's parameters
         times ``PRECISION_BYTES``, each sharded (ceil) over dp_shard x cp from its ZeRO stage
         on (3, 2, 1), optimizer = master + states (2 AdamW, 1 SGD) in the updated dtype, plus
         the grad scaler; fused AdamW adds fp32 step counters (at least one); with the
         optimizer offloaded under ZeRO, none on the GPU and master + states + an fp32
         gradient copy on the host; offloaded without ZeRO (torchao's CPUOffloadOptimizer), a
         host copy, a host gradient and the states in the weights' dtype, within the bounds
         its 4,096-element threshold leaves.
    Per record:
      9. the most loaded stage is the one with the largest peak (the first at a tie), and the
         top-level lines, peak, phase, headroom (capacity - peak) and fit are its;
     10. tp * pp * cp * dp GPUs, dp = dp_shard * replicas, pp stages, every layer on a stage
         once (stage_layers and each stage's num_layers sum to the model's layers);
     11. with tp = 1 and a dense model, the stages' parameters sum to the model's, a tied
         embedding counted twice when pp > 1 (the last stage keeps a copy).
    """
    from memplan.spec import load_model

    cfg, est = rec["config"], rec["estimate"]
    lay, out = est["layout"], []

    def need(ok: bool, what: str) -> None:
        if not ok:
            out.append(what)

    spec = load_model(cfg["model"])
    dense = spec.moe is None
    precision = est["workload"]["precision"]
    param_b, grad_b, master_b, updated_b = PRECISION_BYTES[precision]
    states = 2 if cfg["optimizer"] == "adamw" else 1
    shard = lay["dp_shard"] * lay["cp"]
    copy_buckets = (lay["zero"] < 2 and lay["dp"] * lay["cp"] > 1
                    and lay["grad_buffers"] == "copy")
    for st in est["stages"]:
        s = f"stage {st['stage']}: "
        steady, first = st["phases"]["steady"], st["phases"]["first_step"]
        need(st["peak_bytes"] == st["tensor_peak_bytes"] + st["cuda_context_bytes"]
             + st["workspace_bytes"] + st["allocator_bytes"] + st["calibration_bytes"],
             s + "peak != tensor peak + overheads")
        # the caching allocator is replayed apart (memplan.model.reserved): no flat share
        need(st["allocator_bytes"] == 0, s + "allocator bytes in the analytic peak")
        need(st["tensor_peak_bytes"] == max(p[n] for p in (steady, first) for n in PHASE_NAMES),
             s + "tensor peak != largest phase")
        need(first["optimizer_bytes"] == steady["optimizer_bytes"], s + "optimizer phases differ")
        need(steady["forward_bytes"] >= first["forward_bytes"]
             and steady["backward_bytes"] >= first["backward_bytes"],
             s + "steady phase below step 1's")
        held = st["params_bytes"] + st["optimizer_bytes"] + st["buffers_bytes"]
        need(steady["optimizer_bytes"] == held + st["grads_bytes"] + st["optimizer_temp_bytes"]
             + (st["grads_bytes"] if copy_buckets else 0), s + "optimizer phase != its parts")
        # with several micro-batches the earlier ones' gradients exist in the forward too
        grads_fwd = st["grads_bytes"] if est["workload"]["num_microbatches"] > 1 else 0
        need(steady["forward_bytes"] >= held + grads_fwd, s + "forward below the states it holds")
        need(steady["backward_bytes"] >= held + st["grads_bytes"],
             s + "backward below the states and gradients it holds")
        # step 1: no optimizer states yet (its master copy is not a line of its own)
        step1 = st["params_bytes"] + st["buffers_bytes"]
        need(first["forward_bytes"] >= step1 + grads_fwd
             and first["backward_bytes"] >= step1 + st["grads_bytes"],
             s + "step 1 below the weights and gradients it holds")
        if lay["vpp"] == 1:
            one = sum(st["activation_terms_per_microbatch"].values())
            need(st["activations_bytes"] == st["microbatches_in_flight"] * one,
                 s + "activations != in flight x one micro-batch")
        if dense:
            n = st["num_params_on_rank"]

            def held_from(stage: int, n: int = n) -> int:
                return _ceil_div(n, shard) if lay["zero"] >= stage else n

            need(st["params_bytes"] == held_from(3) * param_b, s + "weights by ZeRO stage")
            need(st["grads_bytes"] == held_from(2) * grad_b, s + "gradients by ZeRO stage")
            opt = held_from(1) * (master_b + states * updated_b) + GRAD_SCALER_BYTES.get(
                precision, 0)
            if lay["offload"] == "optimizer" and lay["zero"] == 0:
                # torchao's CPUOffloadOptimizer (torchao/optim/cpu_offload.py): each tensor of
                # at least 4,096 elements gets a host copy, a host gradient and its states in
                # the weights' dtype, and an fp32 step count with AdamW (at most one per 4,096
                # elements); smaller ones stay with an on-device optimizer (norm weights: well
                # under 1% of the weights)
                whole = n * (2 + states) * param_b
                steps = n // 4096 * 4 if cfg["optimizer"] == "adamw" else 0
                low = 0.99 * whole if spec.hidden_size >= 4096 else 0  # tiny: most stay
                need(low <= st["host_bytes"] <= whole + steps,
                     s + "offloaded optimizer (torchao's host copy, gradient and states)")
            elif lay["offload"] == "optimizer":
                need(st["optimizer_bytes"] == 0 and st["host_bytes"] == held_from(1) * (
                    4 + states * 4 + 4), s + "offloaded optimizer")
            elif cfg["optimizer"] == "adamw" and cfg["optimizer_impl"] == "fused":
                need(st["optimizer_bytes"] >= opt + 4, s + "fused AdamW without step counters")
            else:
                need(st["optimizer_bytes"] == opt, s + "optimizer states by ZeRO stage")
    stages = est["stages"]
    worst = max(stages, key=lambda st: (st["peak_bytes"], -st["stage"]))
    need(est["most_loaded_stage"] == worst["stage"], "most loaded stage")
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                "host_bytes", "calibration_bytes", "peak_bytes", "peak_phase"):
        need(est[key] == worst[key], f"top-level {key} != the most loaded stage's")
    need(est["headroom_bytes"] == est["capacity_bytes"] - est["peak_bytes"], "headroom")
    need(est["fits"] == (est["peak_bytes"] <= est["capacity_bytes"]), "fits")
    need(lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == est["num_gpus"], "GPUs != layout")
    need(lay["dp_shard"] * lay["replicas"] == lay["dp"], "dp != dp_shard x replicas")
    need(len(stages) == lay["pp"], "stages != pp")
    need(sum(lay["stage_layers"]) == spec.num_layers
         and sum(st["num_layers"] for st in stages) == spec.num_layers, "layers per stage")
    if lay["tp"] == 1 and dense:
        tied = spec.vocab_size * spec.hidden_size if spec.tied_embeddings and lay["pp"] > 1 else 0
        need(sum(st["num_params_on_rank"] for st in stages) == est["num_params"] + tied,
             "stage parameters != the model's")
    return out


def _diff(old: Any, new: Any, path: str, out: list[str], added: set[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in old:
            if key not in new:
                out.append(f"{path}.{key}: missing")
            else:
                _diff(old[key], new[key], f"{path}.{key}", out, added)
        added.update(f"{path}.{key}" for key in new if key not in old)
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            _diff(a, b, f"{path}[{i}]", out, added)
    elif old != new:
        out.append(f"{path}: {old!r} -> {new!r}")


def check(path: Path) -> int:
    with gzip.open(path, "rt") as fh:
        recorded = [json.loads(line) for line in fh]
    differences, added = 0, set()
    for i, rec in enumerate(recorded):
        out: list[str] = []
        new = record(rec["config"])
        _diff(rec["estimate"], new["estimate"], "", out, added)
        out += [f"invariant broken: {what}" for what in invariants(new)]
        for line in out:
            print(f"config {i} {json.dumps(rec['config'], sort_keys=True)}: {line}")
        differences += bool(out)
    generic = sorted({a.split("[")[0] if a.startswith(".stages") else a for a in added})
    if generic:
        print("new fields (ignored):", ", ".join(generic))
    print(f"{len(recorded)} configurations, {differences} differ")
    return 1 if differences else 0


def _field(path: str) -> str:
    """A difference's field with stage indices dropped (``.stages[*].peak_bytes``)."""
    return re.sub(r"\[\d+\]", "[*]", path.split(":")[0])


def changes(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    """What a re-record changes: configurations added, removed and changed, and per changed
    field how many configurations it moved in, with one example."""
    def key(rec: dict[str, Any]) -> str:
        return json.dumps(rec["config"], sort_keys=True)

    before = {key(r): r for r in old}
    after = {key(r): r for r in new}
    changed, fields, examples = 0, Counter(), {}
    for k, rec in after.items():
        if k not in before:
            continue
        out: list[str] = []
        _diff(before[k]["estimate"], rec["estimate"], "", out, set())
        changed += bool(out)
        for field in {_field(line) for line in out}:
            fields[field] += 1
            examples.setdefault(field, next(line for line in out if _field(line) == field))
    lines = [f"{len(new)} configurations: {changed} changed, "
             f"{len(after.keys() - before.keys())} added, "
             f"{len(before.keys() - after.keys())} removed"]
    lines += [f"  {field}: {n} configurations (e.g. {examples[field]})"
              for field, n in sorted(fields.items(), key=lambda item: (-item[1], item[0]))]
    return lines


def write(path: Path, count: int) -> int:
    records = [record(cfg) for cfg in all_configs(count)]
    broken = [(i, v) for i, rec in enumerate(records) for v in invariants(rec)]
    for i, what in broken[:20]:
        print(f"config {i} {json.dumps(records[i]['config'], sort_keys=True)}: {what}")
    if broken:
        print(f"{len(broken)} invariants broken: not written")
        return 1
    if path.exists():
        with gzip.open(path, "rt") as fh:
            old = [json.loads(line) for line in fh]
        print("\n".join(changes(old, records)))
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(json.dumps(rec, sort_keys=True) for rec in records) + "\n")
    print(f"wrote {len(records)} configurations to {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path)
    group.add_argument("--check", type=Path)
    parser.add_argument("--count", type=int, default=600)
    args = parser.parse_args()
    if args.write:
        return write(args.write, args.count)
    return check(args.check)


if __name__ == "__main__":
    sys.exit(main())
