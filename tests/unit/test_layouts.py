"""The layouts of large runs: uneven pipeline stages, HSDP shard groups, and the planner's
search of them (its answer when nothing fits, its time model's costs)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import NamedTuple

import pytest

import memplan
from memplan.cli import main
from memplan.parallel import ParallelConfig, rank_layers, weighted_split
from memplan.planning.planner import pipeline_splits
from memplan.planning.timing import (
    ATTENTION_TFLOPS_BY_SEQ,
    _cp_attention_time,
    attention_rate,
    comm_seconds,
    stage_balance,
)
from memplan.workload import PipelineSplit


# Llama 3.1 405B on one TP-8 rank: a layer holds q and o (16384 x 16384), k and v (16384 x 1024)
# and the SwiGLU MLP (3 x 16384 x 53248) split by 8, plus two replicated norms of 16384:
# 3,187,671,040 / 8 + 32,768 = 398,491,648 parameters. The vocabulary-parallel embedding (and
# head) is 128,256 x 16,384 / 8 = 262,668,288.
LAYER_405B_TP8 = 398_491_648
VOCAB_405B_TP8 = 262_668_288


class Ran(NamedTuple):
    exit_code: int
    out: str
    err: str


def cli(*args: str) -> Ran:
    """The console entry point in process: its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return Ran(code, out.getvalue(), err.getvalue())


def one_line_error(result: Ran, *pieces: str) -> None:
    assert result.exit_code == 2, result
    assert result.out == ""
    lines = result.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memplan: error: "), result.err
    for piece in pieces:
        assert piece in lines[0], lines[0]


# --- splits ---------------------------------------------------------------------------------

def test_torchtitan_split_counts_the_embedding_and_head_as_a_layer_each() -> None:
    """torchtitan 0.3.0's _generate_llm_fqn_per_model_part: 126 + 2 effective layers over 8
    stages is 16 each, the first and last giving one to the embedding and the head; 32 + 2 over
    4 is 9, 9, 8, 8 (the first stages take the remainder), less one at each end; 126 + 2 over
    16 is 8 each (Llama 3's 405B: one layer fewer on the first and the last stage)."""
    assert weighted_split(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert weighted_split(32, 4) == (8, 9, 8, 7)
    assert weighted_split(126, 16) == (7,) + (8,) * 14 + (7,)
    assert weighted_split(4, 4) == ()  # a stage would hold no layer: torchtitan refuses
    assert sum(weighted_split(80, 24)) == 80


def test_rank_layers_sum_virtual_stages_per_rank() -> None:
    """Virtual stage c*pp + r is chunk c of rank r (Megatron-LM's interleaving)."""
    par = ParallelConfig(pp=4, vpp=2, stage_layers=(3, 4, 4, 4, 4, 4, 4, 3))
    assert rank_layers(30, par) == (7, 8, 8, 7)


def test_planner_splits() -> None:
    # torchtitan's rule gives its one split, even where the layers divide
    assert pipeline_splits(32, 4, 1, PipelineSplit.WEIGHTED) == [(8, 9, 8, 7)]
    # otherwise the even split where it divides, and the weighted one beside it
    assert pipeline_splits(32, 4, 1, PipelineSplit.EVEN) == [None, (8, 9, 8, 7)]
    assert pipeline_splits(126, 8, 1, PipelineSplit.EVEN) == [(15, 16, 16, 16, 16, 16, 16, 15)]
    assert pipeline_splits(126, 1, 1, PipelineSplit.EVEN) == [None]
    assert pipeline_splits(126, 1, 1, PipelineSplit.WEIGHTED) == [None]  # no pipeline


# --- estimates of the published 405B layouts ------------------------------------------------

def test_torchtitan_405b_fsdp8_tp8_pp8_split_and_states() -> None:
    """torchtitan's 405B benchmark layout (FSDP 8, TP 8, PP 8 on 512 GPUs) from --framework
    alone: its split, fp32 weights sharded by 8 on every stage, the embedding on stage 0."""
    est = memplan.estimate("llama-3.1-405b", gpus=512, tp=8, pp=8, zero=3, framework="torchtitan",
                           precision="fsdp-bf16", seq_len=8192, recompute="full")
    assert est.parallel.stage_layers == (15, 16, 16, 16, 16, 16, 16, 15)
    assert [s.num_layers for s in est.stages] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert est.stages[1].params_bytes == 16 * LAYER_405B_TP8 * 4 // 8 == 3_187_933_184
    assert est.stages[0].params_bytes == (15 * LAYER_405B_TP8 + VOCAB_405B_TP8) * 4 // 8
    assert est.worst is max(est.stages, key=lambda s: s.peak_bytes)


def test_torchtitan_under_pp_keeps_units_gathered_and_gradients_unsharded() -> None:
    """reshard_after_forward = not pp_enabled, and the pipeline's backward without gradient
    sync: each stage holds its weights gathered in bf16 and its gradients unsharded in fp32
    (the reduce dtype) beside a unit's reduce-scatter input and output shard."""
    est = memplan.estimate("llama-3-8b", gpus=16, pp=2, zero=3, framework="torchtitan",
                           precision="fsdp-bf16", seq_len=2048)
    last = est.stages[1]
    # the last stage: 16 layers of 41,943,040 attention (2 h^2 + 2 h 1024) + 176,160,768 SwiGLU
    # (3 h 14336) + 8,192 norms = 218,112,000, the final norm 4,096 and the 128256 x 4096 head
    # 525,336,576: 4,015,132,672 parameters
    n = 16 * 218_112_000 + 4096 + 525_336_576
    assert last.num_params == n == 4_015_132_672
    unit = 525_336_576 + 4096  # [final norm, lm_head]: the largest unit of the last stage
    # gathered bf16 (2 n) + unsharded fp32 gradients (4 n) + the unit's reduce-scatter input
    # (4 unit) and its output shard over dp 8 (ceil(4 unit / 8)):
    # 8,030,265,344 + 16,060,530,688 + 2,101,362,688 + 262,670,336 = 26,454,829,056
    assert last.sharding_buffers_bytes == (n * 2 + n * 4 + unit * 4 + -(-unit * 4 // 8))
    assert last.sharding_buffers_bytes == 26_454_829_056
    # without PP the same job holds two blocks and the head's unit, not the stage
    flat = memplan.estimate("llama-3-8b", gpus=16, zero=3, framework="torchtitan",
                            precision="fsdp-bf16", seq_len=2048)
    assert flat.worst.sharding_buffers_bytes < last.num_params * 2


def test_llama3_405b_interleaved_with_embedding_and_head_chunks() -> None:
    """Llama 3 405B (Dubey et al. 2024, section 3.3.2): pp 16 with one-layer virtual stages, the
    first chunk only the embedding and the last only the head: 0,1x126,0 over pp 16 x vpp 8."""
    est = memplan.estimate("llama-3.1-405b", gpus=16384, tp=8, pp=16, vpp=8, zero=1,
                           stage_layers="0,1x126,0", seq_len=8192, global_batch_size=2048)
    assert [s.num_layers for s in est.stages] == [7] + [8] * 14 + [7]
    assert est.stages[0].num_params == 7 * LAYER_405B_TP8 + VOCAB_405B_TP8  # the embedding
    assert est.stages[15].num_params == 7 * LAYER_405B_TP8 + VOCAB_405B_TP8 + 16384  # head
    assert est.stages[1].num_params == 8 * LAYER_405B_TP8


def test_megatron_and_generic_refuse_an_even_split_that_does_not_divide() -> None:
    result = cli("estimate", "-m", "llama-3.1-405b", "-n", "512", "--tp", "8", "--pp", "8",
                 "--framework", "megatron")
    one_line_error(result, "pp*vpp (8) must divide num_layers (126)", "--stage-layers",
                   "get_num_layers_to_build")
    result = cli("estimate", "-m", "llama-3.1-405b", "-n", "512", "--tp", "8", "--pp", "8")
    one_line_error(result, "pp*vpp (8) must divide num_layers (126)", "--stage-layers")
    ok = cli("estimate", "-m", "llama-3.1-405b", "-n", "512", "--tp", "8", "--pp", "8",
             "--framework", "megatron", "--stage-layers", "15,16x6,15", "--json")
    assert ok.exit_code == 0, ok
    data = json.loads(ok.out)
    assert data["layout"]["stage_layers"] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert [s["num_layers"] for s in data["stages"]] == [15, 16, 16, 16, 16, 16, 16, 15]


@pytest.mark.parametrize(("args", "pieces"), [
    (("--pp", "8", "--stage-layers", "15,16,16,16,16,16,16,16"),
     ("sum to 127", "126 layers")),
    (("--pp", "8", "--stage-layers", "0,18,18,18,18,18,18,18"),
     ("pipeline stage 0 has 0 layers",)),
    (("--pp", "4", "--vpp", "2", "--stage-layers", "16,0,16,16,16,16,16,30"),
     ("virtual stage 1 has 0 layers",)),
    (("--pp", "8", "--stage-layers", "63,63"), ("has 2 entries", "8 virtual stages")),
    (("--pp", "4", "--vpp", "2", "--stage-layers", "31,32,32,31"),
     ("has 4 entries", "pp*vpp (4*2) = 8")),
    (("--pp", "8", "--stage-layers", "15,16,x,15"), ("stage_layers must be layer counts",)),
    (("--pp", "8", "--stage-layers", "-1,17,16,16,16,16,16,30"), ("must not be negative",)),
    (("--zero", "3", "--dp-shard", "3"), ("dp_shard (3) must divide dp (64)",)),
    (("--zero", "0", "--dp-shard", "8"), ("dp_shard (8)", "zero 0")),
    (("--zero", "3", "--dp-shard", "0"), ("dp_shard",)),
])
def test_bad_layouts_are_one_line(args: tuple[str, ...], pieces: tuple[str, ...]) -> None:
    one_line_error(cli("estimate", "-m", "llama-3.1-405b", "-n", "512", "--tp", "8", *args),
                   *pieces)


# --- HSDP -------------------------------------------------------------------------------------

def test_hsdp_holds_the_states_of_its_shard_group() -> None:
    """16 GPUs as 2 replicas of an 8-rank shard group hold what 8 GPUs of plain FSDP hold:
    the states are sharded by the group, not by dp."""
    hsdp = memplan.estimate("llama-3-8b", gpus=16, zero=3, dp_shard=8, seq_len=2048)
    fsdp8 = memplan.estimate("llama-3-8b", gpus=8, zero=3, seq_len=2048)
    fsdp16 = memplan.estimate("llama-3-8b", gpus=16, zero=3, seq_len=2048)
    for field in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert getattr(hsdp.worst, field) == getattr(fsdp8.worst, field)
        assert getattr(hsdp.worst, field) > getattr(fsdp16.worst, field)
    assert hsdp.parallel.replicas == 2 and hsdp.parallel.shard_group == 8


def test_hsdp_communication_by_link() -> None:
    """llama-3-8b, 16 H100s (two nodes of 8), ZeRO-3, one micro-batch, bf16-mixed (bf16
    gradients and weights). Plain FSDP over 16 ranks crosses the 50 GB/s network for
    everything, each a 15/16 ring: the gradients' reduce-scatter, the weights' all-gather
    after the step and the forward and backward gathers. HSDP with shard groups of 8 runs
    those over NVLink (450 GB/s, 7/8 ring) and all-reduces the 1/8 of the gradients each rank
    holds across the 2 replicas (2 * 1/2 ring) over the network."""
    spec = memplan.load_model("llama-3-8b")
    gpu = memplan.load_gpu("h100")
    wl = memplan.make_workload(spec, seq_len=2048)
    n, policy = spec.num_params, wl.precision.policy
    assert (policy.grad_bytes, policy.unsharded.itemsize) == (2, 2)
    g, w = n * 2, n * 2  # the gradient and weight bytes a rank communicates
    # and every collective, one per unit (32 layers, embedding, head), pays NCCL's ring
    # latency: 16 ranks on 2 nodes 8.4 + 14 * 3.4 + 9.6 us, 8 on one 8.4 + 7 * 3.4 us, the
    # replicas' all-reduce 2 * (8.4 + 9.6) us
    units = 34
    ring16, ring8, pair = 65.6e-6, 32.2e-6, 2 * 18.0e-6
    full = comm_seconds(spec, gpu, memplan.make_layout(16, zero=3), wl, 1, n)["dp"]
    assert full == pytest.approx(15 / 16 * (g + w + 2 * w) / 50e9 + 4 * units * ring16,
                                 rel=1e-12)
    hsdp = comm_seconds(spec, gpu, memplan.make_layout(16, zero=3, dp_shard=8), wl, 1, n)["dp"]
    assert hsdp == pytest.approx(7 / 8 * (g + w + 2 * w) / 450e9 + 2 * 1 / 2 * g / 8 / 50e9
                                 + units * (4 * ring8 + pair), rel=1e-12)


# --- the planner ------------------------------------------------------------------------------

def test_405b_plan_with_fixed_pp8_searches_uneven_splits() -> None:
    """torchtitan's layout for the 405B on 512 GPUs: with --pp 8 fixed the plan finds fits,
    every one with its split of the 126 layers."""
    result = cli("plan", "-m", "llama-3.1-405b", "-n", "512", "--tp", "8", "--pp", "8",
                 "--seq", "8192", "--gbs", "256", "--framework", "torchtitan", "--json",
                 "--top", "5")
    assert result.exit_code == 0, result
    data = json.loads(result.out)
    assert data["candidates"] and data["no_fit"] is None
    for c in data["candidates"]:
        layout = c["layout"]
        assert layout["pp"] == 8 and layout["zero"] == 3
        assert layout["stage_layers"] == list(weighted_split(126, 8 * layout["vpp"]))


def test_plan_where_nothing_fits_says_why_and_fails() -> None:
    """The 405B on 8 GPUs: nothing fits; the plan exits 1 and names the closest
    configuration, its peak and by how much it misses the usable capacity."""
    result = cli("plan", "-m", "llama-3.1-405b", "-n", "8", "--seq", "4096", "--json")
    assert result.exit_code == 1
    data = json.loads(result.out)
    assert result.err.startswith("memplan: ") and result.err.count("\n") == 1
    err = result.err.removeprefix("memplan: ")
    assert data["candidates"] == []
    miss = data["closest_miss"]
    assert miss["peak_bytes"] - data["budget_bytes"] == data["oom_excess_bytes"] > 0
    assert err.startswith("nothing fits: the closest is ")
    assert f"micro-batch {miss['mbs']}" in err and "over the usable" in err
    text = cli("plan", "-m", "llama-3.1-405b", "-n", "8", "--seq", "4096")
    assert text.exit_code == 1 and text.err.startswith("memplan: nothing fits")


# --- the step-time model's costs ---------------------------------------------------------------

def test_the_busiest_stage_sets_the_pace() -> None:
    """llama-3-8b at pp 4: an even split leaves the head (2 * 128,256 * 4,096 FLOPs per
    token forward) on the last stage beside 8 layers; torchtitan's 8,9,8,7 moves a layer off
    it. The busiest over the mean stage is lower for the uneven split; without pp it is 1."""
    spec = memplan.load_model("llama-3-8b")
    wl = memplan.make_workload(spec, seq_len=8192)
    even = stage_balance(spec, wl, 4, 1, None)
    uneven = stage_balance(spec, wl, 4, 1, (8, 9, 8, 7))
    assert 1.0 < uneven < even
    assert stage_balance(spec, wl, 1) == 1.0


def test_context_parallel_attention_runs_at_the_rate_of_its_share() -> None:
    """The measured FlashAttention-3 rates: 8192 tokens at 614.234 TFLOP/s, 1024 at 517.099;
    cp 8 at 8K runs its attention 614.234 / 517.099 times as long."""
    assert dict(ATTENTION_TFLOPS_BY_SEQ)[8192] == 614.234
    assert attention_rate(16384) == 1.0
    assert attention_rate(8192) == pytest.approx(614.234 / 620.73)
    assert _cp_attention_time(8192, 8) == pytest.approx(614.234 / 517.099)
    assert _cp_attention_time(8192, 1) == 1.0


def test_planning_doc_is_current() -> None:
    """docs/planning.md's tables are what benchmarks/planning_doc.py builds now."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "planning_doc.py"
    spec = importlib.util.spec_from_file_location("planning_doc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = module.DOC.read_text()
    assert module.render(current, module.tables()) == current, (
        "docs/planning.md is stale: run python benchmarks/planning_doc.py")


# --- the layout rules the planner and validate share ----------------------------------------

def test_degree_rules_name_the_first_broken_rule() -> None:
    """Each rule returns the error ``validate`` raises, or None. GPT-2 has 12 heads, 12 KV heads
    and an FFN of 3072: tp 8 divides none of the heads (12 = 8 + 4), tp 4 all three (3, 3,
    768). Load-balanced CP cuts seq into 2*cp chunks: 4096 / 6 leaves 4, 4096 / 8 = 512.
    Mixtral's 8 experts over ep 3 leave 2; ep 4 divides them but not dp*cp = 6. 24 GPUs are
    not a multiple of tp*pp*cp = 2*2*4 = 16."""
    from memplan.parallel import cp_rule, ep_rule, gpus_rule, tp_rule
    from memplan.spec import load_model

    gpt2 = load_model("gpt2")
    err = tp_rule(gpt2, 8)
    assert (err.rule, str(err)) == ("tp must divide num_attention_heads",
                                    "tp (8) must divide num_attention_heads (12)")
    assert tp_rule(gpt2, 4) is None
    mixtral = load_model("mixtral-8x7b")
    odd_experts = mixtral.model_copy(update={"moe": mixtral.moe.model_copy(
        update={"expert_ffn_hidden_size": 14_340})})  # 14,340 / 8 = 1,792.5
    assert str(tp_rule(odd_experts, 8)) == "tp (8) must divide expert_ffn_hidden_size (14340)"
    assert tp_rule(odd_experts, 4) is None  # 14,340 / 4 = 3,585
    assert str(cp_rule(4096, 3)) == "2*cp (6) must divide seq (4096)"
    assert cp_rule(4096, 4) is None and cp_rule(4095, 1) is None
    assert str(ep_rule(8, 3, 6)) == "ep (3) must divide num_experts (8)"
    assert str(ep_rule(8, 4, 6)) == "ep (4) must divide dp*cp (6)"
    assert ep_rule(8, 2, 6) is None
    assert str(gpus_rule(24, 2, 2, 4)) == "gpus (24) must be divisible by tp*pp*cp (2*2*4 = 16)"
    assert gpus_rule(32, 2, 2, 4) is None


def test_planner_counts_rejections_by_the_rules_validate_raises() -> None:
    """GPT-2 on 8 GPUs: of tp 1, 2, 4, 8 only tp 8 breaks a rule (12 heads), counted once
    under validate's own rule name; and ``validate`` refuses that layout with the same rule."""
    from collections import Counter

    from memplan.errors import LayoutError
    from memplan.parallel import validate
    from memplan.planning.planner import layouts
    from memplan.spec import load_model

    gpt2 = load_model("gpt2")
    rejected: Counter = Counter()
    pars = layouts(gpt2, 8, 1024, max_tp=8, fixed={}, rejected=rejected)
    assert rejected["tp must divide num_attention_heads"] == 1
    assert {par.tp for par in pars} == {1, 2, 4}
    with pytest.raises(LayoutError) as err:
        validate(gpt2, ParallelConfig(tp=8), memplan.make_workload(gpt2, seq_len=1024))
    assert err.value.rule == "tp must divide num_attention_heads"


@pytest.mark.parametrize("model, gpus, fixed", [
    ("llama-7b", 64, {}),
    ("mixtral-8x7b", 64, {}),
    ("qwen3-30b-a3b", 64, {"offload": frozenset()}),
    ("llama-3-70b", 512, {"tp": 8, "zero": 3, "sp": True}),
    ("llama-7b", 64, {"pp": 4, "vpp": 2, "vpp_group": 4, "stage_layers": [8, 8, 8, 8, 0, 0, 0, 0],
                      "zero": 1}),
])
def test_search_layouts_are_the_checked_records(model: str, gpus: int, fixed: dict) -> None:
    """The search makes its layouts without the fields' checks (``planner._layout``); each is
    the record the checks make of the same fields, value and type (an int where an int, a
    ``ZeroStage`` member, a tuple split, a frozenset of ``Offload``), given values included
    (a list split made a tuple, as the field's own conversion does)."""
    from collections import Counter

    from memplan.parallel import ParallelConfig
    from memplan.planning.planner import layouts

    spec = memplan.load_model(model)
    pars = layouts(spec, gpus, 4096, max_tp=8, fixed=fixed, rejected=Counter())
    assert pars
    for par in pars:
        checked = ParallelConfig(**par.__dict__)
        assert [(k, v, type(v)) for k, v in par.__dict__.items()] == [
            (k, v, type(v)) for k, v in checked.__dict__.items()]
        assert hash(par) == hash(checked)
