"""Changes that do not always save memory are stated, and never offered as a saving.

ZeRO-3 gathers each unit's parameters (and holds its unsharded gradients until the
reduce-scatter) in buffers beside the shards; at small dp those buffers outweigh the shard it
saves. A chunked loss sums its chunks' head-weight gradients in backward; with few tokens per
micro-batch that outweighs the logits it saves. Both cases are reproduced here from the
estimator itself (ZeRO-3: the tiny model in fp32 on 2 GPUs, whose gathered root and blocks
outweigh the half of its 108 KB of fp32 weights a shard saves; the chunked loss: GPT-2, fp32,
2 GPUs), so the test fails if either stops holding as well as if ``diagnose`` or ``plan``
offers the costlier change. (GPT-2 at dp 2 is no such ZeRO-3 case: its traced FSDP2 rank peaks
below ZeRO-2's estimate, tests/traced/test_ground_truth.py.)
"""

from __future__ import annotations

import json

import memplan
from memplan.diagnose import diagnose
from memplan.model.estimate import LOSS_CHUNKS_CAVEAT, ZERO3_CAVEAT

# GPT-2 (124M parameters) in fp32 on 2 GPUs: dp 2, one sequence of 256 tokens per micro-batch
SMALL_DP = {"gpus": 2, "micro_batch_size": 1, "seq_len": 256, "precision": "fp32"}
FEW_TOKENS = {**SMALL_DP, "seq_len": 128}
# ZeRO-3's buffers outweigh its shard: the tiny model in fp32 on 2 GPUs
Z3_MODEL, Z3_CASE = "tiny", {**SMALL_DP, "seq_len": 128}


def test_zero3_costs_more_than_zero2_at_small_dp_and_says_so() -> None:
    z2 = memplan.estimate(Z3_MODEL, zero=2, **Z3_CASE)
    z3 = memplan.estimate(Z3_MODEL, zero=3, **Z3_CASE)
    assert z3.worst.params_bytes == z2.worst.params_bytes // 2  # the shard ZeRO-3 saves...
    assert z3.worst.sharding_buffers_bytes > z2.worst.sharding_buffers_bytes  # ...its buffers
    assert z3.peak_bytes > z2.peak_bytes
    assert ZERO3_CAVEAT in z3.caveats and ZERO3_CAVEAT not in z2.caveats


def test_the_caveats_are_printed_and_in_the_json(capsys) -> None:
    from memplan.cli import main

    argv = ["estimate", "-m", "gpt2", "-n", "2", "--precision", "fp32", "--seq", "128",
            "--zero", "3", "--loss-chunks", "8"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["caveats"] == [ZERO3_CAVEAT, LOSS_CHUNKS_CAVEAT]
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"not always a saving: {' '.join(ZERO3_CAVEAT.split())}" in text
    assert "not always a saving: a chunked loss sums" in text


def test_more_loss_chunks_cost_more_at_few_tokens_and_say_so() -> None:
    one = memplan.estimate("gpt2", loss_chunks=1, **FEW_TOKENS)
    many = memplan.estimate("gpt2", loss_chunks=8, **FEW_TOKENS)
    assert many.peak_bytes > one.peak_bytes
    assert LOSS_CHUNKS_CAVEAT in many.caveats and LOSS_CHUNKS_CAVEAT not in one.caveats


def test_diagnose_does_not_offer_zero3_where_zero2_is_smaller() -> None:
    """From ZeRO 0 both stage 2 and stage 3 lower the peak; stage 3 lowers it less, so only
    stage 2 is offered and stage 3 is skipped with the reason."""
    base = memplan.estimate(Z3_MODEL, zero=0, **Z3_CASE)
    z2 = memplan.estimate(Z3_MODEL, zero=2, **Z3_CASE)
    z3 = memplan.estimate(Z3_MODEL, zero=3, **Z3_CASE)
    assert z2.peak_bytes < z3.peak_bytes < base.peak_bytes  # stage 3 would look like a saving
    r = diagnose(Z3_MODEL, zero=0, **Z3_CASE)
    offered = {f.name: f for f in r.fixes.ranked}
    assert "ZeRO stage 3" not in offered
    assert offered["ZeRO stage 2"].peak_bytes == z2.peak_bytes
    why = dict(r.fixes.skipped)["ZeRO stage 3"]
    assert why.startswith(f"saves less than ZeRO stage 2: its peak_bytes {z3.peak_bytes} is not "
                          f"below {z2.peak_bytes}")
    for f in r.fixes.ranked:  # nothing offered costs more than the baseline
        assert f.peak_bytes < base.peak_bytes


def test_diagnose_does_not_offer_a_chunked_loss_that_costs_more() -> None:
    r = diagnose("gpt2", zero=0, **FEW_TOKENS)
    assert not any(f.name.startswith("chunked cross-entropy") for f in r.fixes.ranked)
    why = next(w for name, w in r.fixes.skipped if name.startswith("chunked cross-entropy"))
    assert why.startswith("lowers no peak")


def test_plan_ranks_zero2_before_its_costlier_zero3_twin() -> None:
    """Same layout, micro-batch and recompute: the ZeRO-3 candidate needs more memory and more
    communication, so the plan ranks it after the ZeRO-2 one (and after every other stage)."""
    result = memplan.plan(Z3_MODEL, gpus=2, seq_len=Z3_CASE["seq_len"], precision="fp32", tp=1,
                          pp=1, global_batch_size=2)
    order = {int(c.layout.zero): i for i, c in enumerate(result.candidates)}
    peaks = {int(c.layout.zero): c.peak_bytes for c in result.candidates}
    assert peaks[3] > peaks[2]
    assert order[2] < order[3] and order[3] == len(result.candidates) - 1
