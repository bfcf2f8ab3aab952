"""Agreement survey: the analytic model against traces of random specs and workloads.

Not a test: run it by hand (torch needed), from the repository root::

    .venv/bin/python benchmarks/survey_ground_truth.py --seconds 150 --seed 4 [--small] [--fsdp]

Each sample draws a decoder spec (Llama or GPT style, MHA/GQA/MQA, gated or plain MLP, biases,
tied embeddings, dropout) and a workload (recipe, recompute, attention kernel, norm kernel,
logits dtype, optimizer implementation), traces two steps with fake tensors and compares every
row of ``memplan trace``; with ``--fsdp`` it traces rank 0 of FSDP2 over 2, 4 or 8 ranks of
the fake process group instead (``precision`` fsdp-bf16, fp32 or bf16-pure, as
tests/traced/test_ground_truth.py's FSDP grid), sequences down to 16 tokens so that the layers
can outweigh their activations. It prints how many samples had a row beyond 0.5% and the worst ones:
the grid in tests/traced/test_ground_truth.py pins the cases that agree, this finds the next ones.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter

from memplan.api import make_layout, make_workload
from memplan.profile.compare import compare
from memplan.spec import ModelSpec, load_model

TOLERANCE_PCT = 0.5


def sample_spec(rng: random.Random, small: bool) -> ModelSpec:
    heads = rng.choice([2, 4, 8])
    kv = rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0])
    fields = dict(
        load_model("tiny").model_dump(), name="survey", num_layers=rng.choice([1, 2, 3]),
        hidden_size=rng.choice([32, 64, 96] if small else [256, 512]),
        ffn_hidden_size=rng.choice([64, 160, 256] if small else [688, 1024, 1376]),
        num_attention_heads=heads, num_kv_heads=kv,
        head_dim=rng.choice([8, 16] if small else [32, 64]),
        vocab_size=rng.choice([8, 50, 128, 300] if small else [1000, 4000]),
        max_seq_len=1024, tied_embeddings=rng.random() < 0.3)
    if rng.random() < 0.3:  # GPT style
        fields.update(norm="layernorm", norm_bias=True, mlp=rng.choice(["gelu", "relu"]),
                      position="learned", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
                      dropout=rng.choice([0.0, 0.1]))
    else:
        fields.update(mlp=rng.choice(["swiglu", "geglu"]), qkv_bias=rng.random() < 0.3)
    return ModelSpec.model_validate(fields)


def sample_workload(rng: random.Random, small: bool) -> dict:
    return dict(
        seq_len=rng.choice([16, 64, 128, 256] if small else [128, 256, 512]),
        micro_batch_size=rng.choice([1, 2, 3]),
        precision=rng.choice(["bf16-mixed", "fp32", "fp16-mixed", "bf16-fp32-grads"]),
        recompute=rng.choice(["none", "selective", "full"]),
        attention=rng.choice(["flash", "eager"]), norm_impl=rng.choice(["upcast", "fused"]),
        logits_fp32=rng.random() < 0.7,
        optimizer_impl=rng.choice(["foreach", "fused", "forloop"]),
        loss_chunks=rng.choice([1, 1, 2, 3, 8]))


def sample_fsdp(rng: random.Random, small: bool) -> tuple[int, dict]:
    """A data-parallel degree and an FSDP2 workload (the recipes FSDP2 runs)."""
    return rng.choice([2, 4, 8]), dict(
        seq_len=rng.choice([16, 32, 64, 128] if small else [16, 32, 128, 256]),
        micro_batch_size=rng.choice([1, 2]),
        precision=rng.choice(["fsdp-bf16", "fp32", "bf16-pure"]),
        recompute=rng.choice(["none", "selective", "full"]),
        attention=rng.choice(["flash", "eager"]), norm_impl=rng.choice(["upcast", "fused"]),
        optimizer_impl=rng.choice(["foreach", "fused"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="tiny widths (transients dominate)")
    parser.add_argument("--fsdp", action="store_true", help="rank 0 of FSDP2 (zero 3) over dp ranks")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    runs, misses, rows = 0, [], Counter()
    start = time.time()
    while time.time() - start < args.seconds:
        spec = sample_spec(rng, args.small)
        if args.fsdp:
            dp, fields = sample_fsdp(rng, args.small)
            spec = spec.model_copy(update={"dropout": 0.0})  # FSDP grid: no dropout
            layout = make_layout(dp, zero=3)
            fields["dp"] = dp
        else:
            fields, layout = sample_workload(rng, args.small), make_layout(1)
        result = compare(spec, layout, make_workload(
            spec, **{k: v for k, v in fields.items() if k != "dp"}))
        runs += 1
        off = [r for r in result.rows if abs(r.diff_pct) > TOLERANCE_PCT]
        if off:
            misses.append((max(abs(r.diff_pct) for r in off), spec, fields, off))
            rows.update(r.name for r in off)
    print(f"{runs} samples, {len(misses)} with a row beyond {TOLERANCE_PCT}%")
    if misses:
        worst = [m[0] for m in misses]
        print(f"worst row per miss: median {statistics.median(worst):.2f}%, "
              f"max {max(worst):.2f}%; rows: {dict(rows)}")
        for pct, spec, fields, off in sorted(misses, key=lambda m: -m[0])[:8]:
            shape = (f"L{spec.num_layers} h{spec.hidden_size} f{spec.ffn_hidden_size} "
                     f"a{spec.num_attention_heads}/g{spec.num_kv_heads} d{spec.head_dim} V{spec.vocab_size} "
                     f"{'tied ' if spec.tied_embeddings else ''}{'qkv-bias ' if spec.qkv_bias else ''}"
                     f"{spec.norm.value} {spec.mlp.value} dropout {spec.dropout}")
            print(f"  {pct:6.2f}%  {shape}  {fields}")


if __name__ == "__main__":
    main()
