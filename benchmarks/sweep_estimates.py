"""A fixed sweep of ``memplan estimate --json`` over many configurations, to pin the numbers.

Every configuration is drawn from one seeded generator over the catalog models (dense and MoE)
and every option that changes the bytes: recompute policy and k-of-L, precision, attention,
norm, ZeRO stage, tp/pp/vpp/cp/ep, sequence parallelism, TP style, gradient buffers, loss
chunks, offload, optimizer and its implementation, schedule, micro- and global batch. Invalid
draws are redrawn, so the sweep holds exactly ``--count`` valid configurations.

    python benchmarks/sweep_estimates.py --write tests/data/estimate_sweep.jsonl.gz
    python benchmarks/sweep_estimates.py --check tests/data/estimate_sweep.jsonl.gz

``--check`` compares each configuration's JSON with the recorded one and prints every field
that differs (keys the recorded file does not have are new fields, listed once and ignored).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path
from typing import Any

MODELS = ("tiny", "gpt2", "llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-7b",
          "llama-2-70b", "mixtral-8x7b", "llama-3.1-405b", "gpt3-175b")
SEED = 20261201


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


def configs(count: int, seed: int = SEED) -> list[dict[str, Any]]:
    """``count`` valid configurations (those ``memplan.estimate`` accepts), in draw order."""
    import memplan
    from memplan.errors import MemplanError

    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < count:
        cfg = _draw(rng)
        try:
            memplan.estimate(**cfg)
        except MemplanError:
            continue
        out.append(cfg)
    return out


def record(cfg: dict[str, Any]) -> dict[str, Any]:
    """The configuration and its ``estimate --json`` object."""
    import memplan
    from memplan.report import estimate_json

    return {"config": cfg, "estimate": estimate_json(memplan.estimate(**cfg))}


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
        _diff(rec["estimate"], record(rec["config"])["estimate"], "", out, added)
        for line in out:
            print(f"config {i} {json.dumps(rec['config'], sort_keys=True)}: {line}")
        differences += bool(out)
    generic = sorted({a.split("[")[0] if a.startswith(".stages") else a for a in added})
    if generic:
        print("new fields (ignored):", ", ".join(generic))
    print(f"{len(recorded)} configurations, {differences} differ")
    return 1 if differences else 0


def write(path: Path, count: int) -> None:
    lines = [json.dumps(record(cfg), sort_keys=True) for cfg in configs(count)]
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} configurations to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path)
    group.add_argument("--check", type=Path)
    parser.add_argument("--count", type=int, default=600)
    args = parser.parse_args()
    if args.write:
        write(args.write, args.count)
        return 0
    return check(args.check)


if __name__ == "__main__":
    sys.exit(main())
