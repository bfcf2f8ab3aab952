"""``stage.backward_floor``: the lower bound a search uses to rule a configuration out without
walking its layers.

The floor is the steady backward's fold over its first segment alone, a prefix of the fold
``walk_stage`` makes, so it can never exceed the stage's tensor peak. Checked on every stage of
the pinned sweep's 648 configurations and on the frameworks' mechanisms (FSDP2, FSDP1,
DeepSpeed ZeRO-3, gradients kept between steps, adapters), and on the plans it prunes: the
candidates, rejections and closest miss are those of the search without it.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import memplan
from memplan.model import estimate as memory
from memplan.model import stage as stage_module

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "tests" / "data" / "estimate_sweep.jsonl.gz"

MECHANISMS = [
    dict(model="llama-3-8b", gpus=8, framework="torchtitan", micro_batch_size=2),
    dict(model="llama-3-8b", gpus=16, framework="torchtitan", pp=2, micro_batch_size=1,
         global_batch_size=32),
    dict(model="llama-2-7b", gpus=8, framework="hf", zero=3, micro_batch_size=4),
    dict(model="llama-2-7b", gpus=8, framework="deepspeed", zero=3, micro_batch_size=2),
    dict(model="llama-2-7b", gpus=8, framework="deepspeed", zero=2, micro_batch_size=2),
    dict(model="mixtral-8x7b", gpus=64, ep=8, zero=1, micro_batch_size=1, seq_len=4096),
    dict(model="llama-4-scout", gpus=64, tp=2, pp=2, ep=4, micro_batch_size=1),
    dict(model="qwen3-next-80b-a3b", gpus=64, tp=2, pp=4, micro_batch_size=1),
    dict(model="llama-3-8b", gpus=8, keep_grads=True, micro_batch_size=2),
    dict(model="llama-3-8b", gpus=8, lora_rank=16, micro_batch_size=2),
]


def _checked(monkeypatch: pytest.MonkeyPatch, seen: list) -> None:
    """Every stage ``stage_record`` walks also gets its floor, compared with its peak."""
    walk = stage_module.walk_stage

    def checked(spec, par, wl, m, stage, schedule, shared, parts):
        walked = walk(spec, par, wl, m, stage, schedule, shared, parts)
        floor = stage_module.backward_floor(spec, par, wl, m, stage, schedule, shared, parts)
        seen.append((floor, walked.tensor_peak))
        return walked

    monkeypatch.setattr(stage_module, "walk_stage", checked)
    memory.cached_estimate.cache_clear()


def test_the_floor_is_never_above_the_walked_peak_over_the_pinned_sweep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with gzip.open(SWEEP, "rt") as fh:
        configs = [json.loads(line)["config"] for line in fh]
    seen: list[tuple[int, int]] = []
    _checked(monkeypatch, seen)
    for cfg in configs:
        memplan.estimate(**cfg)
    over = [(f, p) for f, p in seen if f > p]
    assert len(seen) >= len(configs) and not over
    # not vacuous: most stages get a floor, and a tight one (the activations of the
    # micro-batches in flight, the states and the loss are most of a backward's peak)
    bounded = [(f, p) for f, p in seen if f > 0]
    assert len(bounded) > 0.8 * len(seen)
    assert sorted(f / p for f, p in bounded)[len(bounded) // 2] > 0.7


@pytest.mark.parametrize("cfg", MECHANISMS, ids=lambda c: f"{c['model']}-{c.get('framework')}")
def test_the_floor_is_never_above_the_walked_peak_under_each_mechanism(
        monkeypatch: pytest.MonkeyPatch, cfg: dict) -> None:
    seen: list[tuple[int, int]] = []
    _checked(monkeypatch, seen)
    memplan.estimate(**cfg)
    assert seen and all(f <= p for f, p in seen)


@pytest.mark.parametrize("model,gpus", [("llama-4-scout", 64), ("mixtral-8x7b", 64),
                                        ("llama-3-70b", 64)])
def test_a_plan_pruned_by_floors_is_the_plan_without_them(monkeypatch: pytest.MonkeyPatch,
                                                          model: str, gpus: int) -> None:
    """The floor only decides configurations that do not fit: the ranked candidates, the
    rejections and the closest miss are those of the search that walks every one, with fewer
    exact evaluations."""
    with_floor = memplan.plan(model, gpus=gpus, top=10)
    monkeypatch.setattr(memory, "backward_floor", lambda *args: 0)
    walked = memplan.plan(model, gpus=gpus, top=10)
    assert with_floor.candidates == walked.candidates
    assert with_floor.rejected == walked.rejected
    assert with_floor.closest_miss == walked.closest_miss
    assert with_floor.evaluated < walked.evaluated
