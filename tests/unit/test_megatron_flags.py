"""Megatron-LM flags modelled from megatron-core's source, each with bytes derived by hand:
the deferred output-layer weight gradient (``--defer-embedding-wgrad-compute``,
``memplan.model.deferred_wgrad``)."""

from __future__ import annotations

from pathlib import Path

import pytest

import memplan
from memplan.config_import import megatron
from memplan.errors import MemplanError
from memplan.model.deferred_wgrad import Deferred, deferred
from memplan.model.dims import Dims
from memplan.model.head import HeadBlock
from memplan.model.stage import PhasePeaks
from memplan.model.moments import Segment, fold
from memplan.spec import load_model
from memplan.workload import Workload

# functional-test style configs of the flags below (tests/data/megatron/flags/README.md)
MEGATRON = Path(__file__).resolve().parents[1] / "data" / "megatron" / "flags"
TINY = load_model("tiny")  # h 64, V 128, 2 layers (model_specs/models/tiny.toml)


def _dims(sp: bool) -> Dims:
    """A micro-batch of 2 x 64 tokens in bf16 on one of 2 TP ranks (64 vocabulary rows)."""
    return Dims(b=2, s=64, s_kv=64, tokens=128, res_tokens_div=2 if sp else 1, tp=2, e=2,
                vocab_shard=64, stream_e=2)


def test_deferred_pairs_by_hand() -> None:
    """tiny (h 64), 128 tokens, tp 2 with sequence parallelism, bf16: a pair is the output
    layer's input shard 128 / 2 x 64 x 2 = 8,192 B and the logits' gradient 128 x 64 x 2 =
    16,384 B: 24,576 B. The drain's gathered input is 128 x 64 x 2 = 16,384 B.

    m = 4, limit 0 (all): the last micro-batch sees 3 earlier pairs (73,728 B) at its forward
    and backward and keeps its own; its compute-dtype weight gradient (64 x 64 x 2 = 8,192 B)
    is not made. Drain: 4 pairs less the first input (98,304 - 8,192) + two gathered buffers
    (32,768) = 122,880 B; the two buffers (32,768 B) stay.
    limit 1: one pair throughout (24,576), the last micro-batch computes its own; drain: the
    pair less its input + one gathered buffer = 24,576 - 8,192 + 16,384 = 32,768 B.
    With 3 micro-batches in flight at the last one's forward (interleaving), only 4 - 3 = 1
    has run its backward: 24,576 B at the forward.
    Without sequence parallelism the input is 128 x 64 x 2 = 16,384 B (pair 32,768), read as
    it is at the drain: 4 pairs, 131,072 B, nothing gathered."""
    sp = _dims(True)
    every = Workload(head_wgrad_deferral=0)
    assert deferred(TINY, every, sp, 4, 1) == Deferred(
        pair=24_576, own=24_576, before_forward=73_728, before_backward=73_728, drain=122_880,
        resident=32_768, weight_grad=8_192)
    assert deferred(TINY, Workload(head_wgrad_deferral=1), sp, 4, 1) == Deferred(
        pair=24_576, own=0, before_forward=24_576, before_backward=24_576, drain=32_768,
        resident=16_384, weight_grad=0)
    assert deferred(TINY, every, sp, 4, 3).before_forward == 24_576
    assert deferred(TINY, every, _dims(False), 4, 1) == Deferred(
        pair=32_768, own=32_768, before_forward=98_304, before_backward=98_304, drain=131_072,
        resident=0, weight_grad=8_192)
    assert deferred(TINY, Workload(), sp, 4, 1) == Deferred()


def test_deferred_pair_stays_after_the_head_backward() -> None:
    """A head that saves 100 B; 30 B in flight in the loss's backward, the final norm's 40 B
    and 50 B at the projection's backward, 10 B at its main gradients; a 25 B pair kept.
    Alive 100: loss 100 + 30 = 130, then 0 alive: projection 40 + 50 = 90; the pair stays
    (25 alive): main gradients 25 + 10 = 35; 25 B alive at the end (0 without)."""
    head = HeadBlock(saved_bytes=100, loss=30, final_norm_all=40, linear=50, main_grads=10,
                     forward_saved=1)
    events = head._replace(deferred=25).backward_events(0, 0, 0, growing=False)
    assert fold([Segment(events)], 100) == (130, 25)
    plain = head.backward_events(0, 0, 0, growing=False)
    assert fold([Segment(plain)], 100) == (130, 0)


def _last_stage(**kw: object) -> tuple[PhasePeaks, PhasePeaks]:
    est = memplan.estimate("tiny", gpus=2, pp=2, framework="megatron", micro_batch_size=2,
                           seq_len=64, global_batch_size=8, precision="bf16-fp32-grads", **kw)
    stage = est.stages[-1]
    return stage.steady, stage.first_step


@pytest.mark.parametrize("limit", [1, 2])
def test_deferred_pairs_beside_the_last_micro_batch(limit: int) -> None:
    """tiny on pp 2 (tp 1), 4 micro-batches of 2 x 64 tokens, bf16: a pair is 128 x 64 x 2
    (the input) + 128 x 128 x 2 (the logits' gradient) = 49,152 B. With a limit below 4 the
    last micro-batch computes its own weight gradient and the ``limit`` earlier pairs are
    alive under its every instant: forward and backward peaks of the last stage grow by
    limit x 49,152 B in both steps; the optimizer step (after the drain) does not (no sequence
    parallelism: no gathered buffer stays). The drain (gradients, weights, states and the
    pairs) stays below the backward's peak."""
    base, deferred_run = _last_stage(), _last_stage(head_wgrad_deferral=limit)
    for plain, dfr in zip(base, deferred_run):
        assert dfr.forward - plain.forward == limit * 49_152
        assert dfr.backward - plain.backward == limit * 49_152
        assert dfr.optimizer == plain.optimizer


def test_deferral_needs_a_pipeline() -> None:
    """megatron-core refuses the deferral without pipeline parallelism."""
    with pytest.raises(MemplanError, match="head_wgrad_deferral .* needs pp > 1"):
        memplan.estimate("tiny", gpus=1, head_wgrad_deferral=0)


def test_megatron_defer_embedding_wgrad_args_file() -> None:
    """--defer-embedding-wgrad-compute with --wgrad-deferral-limit 3 (a functional-test style
    config) maps to head_wgrad_deferral 3; the run is estimated (pp 2 over 4 GPUs)."""
    imp = megatron.read(str(MEGATRON / "memplan_tp2_pp2_defer_wgrad.yaml"), 4)
    assert imp.inputs["head_wgrad_deferral"] == 3
    assert "--defer-embedding-wgrad-compute" not in imp.unread
    assert "--wgrad-deferral-limit" not in imp.unread
    memplan.estimate(imp.model, gpus=4, **imp.inputs)


@pytest.mark.parametrize(("extra", "flag"), [
    ("--defer-embedding-wgrad-compute", "--defer-embedding-wgrad-compute"),  # pp 1
    ("--pipeline-model-parallel-size 2 --defer-embedding-wgrad-compute "
     "--no-gradient-accumulation-fusion", "--defer-embedding-wgrad-compute"),
    ("--pipeline-model-parallel-size 2 --defer-embedding-wgrad-compute "
     "--wgrad-deferral-limit -1", "--wgrad-deferral-limit"),
])
def test_megatron_deferral_refused_where_megatron_raises(extra: str, flag: str) -> None:
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
            "--max-position-embeddings 512 --vocab-size 1000 --tokenizer-type NullTokenizer ")
    with pytest.raises(MemplanError, match=flag):
        megatron.read(base + extra, 8)


def test_megatron_fsdp_no_shard_args_file() -> None:
    """Megatron FSDP with no_shard (a functional-test style config, 8 GPUs, bf16): its
    buffers are Megatron DDP's without the distributed optimizer (param_and_grad_buffer.py
    _init_each_parameter_group_buffers: the module's bf16 weights, whole fp32 main weights
    and gradient buffer, whole optimizer states), --use-distributed-optimizer
    notwithstanding: --zero 0 with fp32 main gradients. Per parameter on every rank: 2 B of
    weights, 4 B of gradients, 4 B of main weights + 2 x 4 B of Adam states = 12 B, and fused
    Adam's fp32 step count per parameter tensor: 68 of them (per layer 16: the q, k, v,
    output, fc1 and fc2 weights and biases, two LayerNorms' weights and biases; the word and
    position embeddings, tied to the output layer; the final norm's weight and bias), 272 B.
    Every stage record equals Megatron's DDP run of the same arguments without Megatron FSDP
    and the distributed optimizer."""
    imp = megatron.read(str(MEGATRON / "memplan_tp1_pp1_megatron_fsdp_no_shard.yaml"), 8)
    assert imp.inputs["zero"] == 0 and imp.inputs["precision"] == "bf16-fp32-grads"
    assert not {"--use-megatron-fsdp", "--data-parallel-sharding-strategy"} & set(imp.unread)
    est = memplan.estimate(imp.model, gpus=8, **imp.inputs)
    rank = est.stages[0]
    n = rank.num_params
    assert (rank.params_bytes, rank.grads_bytes, rank.optimizer_bytes) == (
        2 * n, 4 * n, 12 * n + 68 * 4)
    text = (MEGATRON / "memplan_tp1_pp1_megatron_fsdp_no_shard.yaml").read_text()
    ddp = megatron.read("\n".join(line for line in text.splitlines() if not any(
        flag in line for flag in ("fsdp", "sharding", "distributed-optimizer"))), 8)
    assert memplan.estimate(ddp.model, gpus=8, **ddp.inputs).stages == est.stages


@pytest.mark.parametrize(("extra", "zero", "precision"), [
    ("", 3, "bf16-fp32-grads"),
    ("--data-parallel-sharding-strategy optim_grads", 2, "bf16-fp32-grads"),
    ("--megatron-fsdp-main-grads-dtype bf16", 3, "bf16-fp32-grads"),
    ("--grad-reduce-in-bf16", 3, "bf16-mixed"),
    ("--main-grads-dtype bf16", 3, "bf16-mixed"),
    ("--main-grads-dtype bf16 --megatron-fsdp-main-grads-dtype fp32", 3, "bf16-fp32-grads"),
    ("--megatron-fsdp-main-grads-dtype fp32 --megatron-fsdp-grad-comm-dtype fp32 "
     "--megatron-fsdp-main-params-dtype fp32", 3, "bf16-fp32-grads"),
])
def test_megatron_fsdp_sharded_strategies_are_units_of_buckets(extra: str, zero: int,
                                                               precision: str) -> None:
    """optim_grads_params (the default) shards weights, main gradients and fp32 main
    weights (--zero 3), optim_grads all but the weights (--zero 2); both as units of
    temporary buckets (``fsdp_units`` buckets). --bf16 turns accumulate_allreduce_grads_in_
    fp32 on (arguments.py validate_args), handed to Megatron-FSDP as grad_reduce_in_fp32
    (training.py get_model), under which the main-gradient buffers and their buckets are
    fp32 whatever --megatron-fsdp-main-grads-dtype says (megatron-core 0.16.1
    ParamAndGradBuffer; Megatron-LM's mcore_fsdp_adapter.py until adfe9e1; traced:
    tests/traced/test_megatron_fsdp_buffers.py): bf16-fp32-grads. --grad-reduce-in-bf16 or
    --main-grads-dtype bf16 turn it off: then --megatron-fsdp-main-grads-dtype decides,
    "auto" being the weights' bf16 (bf16-mixed), fp32 giving fp32 main gradients."""
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
            "--max-position-embeddings 512 --vocab-size 1000 --tokenizer-type NullTokenizer "
            "--bf16 --use-distributed-optimizer --use-megatron-fsdp ")
    imp = megatron.read(base + extra, 8)
    assert (imp.inputs["zero"], imp.inputs["fsdp_units"], imp.inputs["precision"]) == (
        zero, "buckets", precision)
    assert not {f for f in imp.unread if "fsdp" in f or "sharding" in f}
    est = memplan.estimate(imp.model, gpus=8, **imp.inputs)
    assert est.stages[0].sharding_buffers_bytes > 0


@pytest.mark.parametrize(("extra", "flag"), [
    ("--use-megatron-fsdp --data-parallel-sharding-strategy optim",
     "--use-megatron-fsdp --data-parallel-sharding-strategy"),
    ("--use-megatron-fsdp --megatron-fsdp-main-params-dtype bf16",
     "--megatron-fsdp-main-params-dtype"),
    ("--use-megatron-fsdp --main-grads-dtype bf16 --megatron-fsdp-main-grads-dtype fp32 "
     "--megatron-fsdp-grad-comm-dtype bf16", "--megatron-fsdp-grad-comm-dtype"),
    ("--use-megatron-fsdp --grad-reduce-in-bf16 --megatron-fsdp-main-grads-dtype fp32",
     "--megatron-fsdp-grad-comm-dtype"),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy no_shard --grad-reduce-in-bf16",
     "--use-megatron-fsdp"),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy no_shard "
     "--megatron-fsdp-main-grads-dtype bf16", "--megatron-fsdp-main-grads-dtype"),
])
def test_megatron_fsdp_refused_by_strategy(extra: str, flag: str) -> None:
    """optim (a new shard per reduce-scatter beside whole gradient buffers), main weights
    other than fp32, a gradient-communication dtype other than the main gradients' (a bucket
    of its own) and no_shard with bf16 gradients are not modelled: refused, naming the
    flag, in one line."""
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
            "--max-position-embeddings 512 --vocab-size 1000 --tokenizer-type NullTokenizer "
            "--bf16 ")
    with pytest.raises(MemplanError) as err:
        megatron.read(base + extra, 8)
    assert flag in str(err.value) and "\n" not in str(err.value)


def test_megatron_mtp_args_file_maps_to_mtp_layers() -> None:
    """--mtp-num-layers 1 (a functional-test style config) maps to mtp_layers 1, read (not
    listed as not modelled), and the run is estimated (pp 2 over 2 GPUs); the bytes are
    derived in tests/unit/test_mtp.py."""
    imp = megatron.read(str(MEGATRON / "memplan_tp1_pp2_mtp.yaml"), 2)
    assert imp.inputs["mtp_layers"] == 1
    assert not {"--mtp-num-layers", "--mtp-loss-scaling-factor"} & set(imp.unread)
    memplan.estimate(imp.model, gpus=2, **imp.inputs)


def test_megatron_mtp_scaling_factor_alone_holds_nothing() -> None:
    """--mtp-loss-scaling-factor without --mtp-num-layers scales nothing that exists: read,
    neither refused nor listed as not modelled."""
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
            "--max-position-embeddings 512 --vocab-size 1000 --tokenizer-type NullTokenizer ")
    imp = megatron.read(base + "--mtp-loss-scaling-factor 0.3", 8)
    assert "--mtp-loss-scaling-factor" not in imp.unread


@pytest.mark.parametrize(("impl", "grouped"), [("transformer_engine", True), ("local", False)])
def test_megatron_moe_grouped_gemm_keeps_te_workspaces(impl: str, grouped: bool) -> None:
    """--moe-grouped-gemm with Transformer Engine's layers runs TE's GroupedLinear
    (TEGroupedMLP), whose grouped GEMM keeps 4 cuBLAS workspaces of 32 MiB + 1,024 B on an
    H100 (transformer_engine/pytorch/cpp_extensions/gemm.py get_cublas_workspace): the
    workspace line grows by 4 x 33,555,456 = 134,221,824 B over the same run without the flag,
    nothing else moves. With --transformer-impl local (Megatron's GroupedMLP) the flag is left
    not read."""
    base = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
            "--max-position-embeddings 512 --vocab-size 1000 --tokenizer-type NullTokenizer "
            f"--bf16 --num-experts 4 --expert-model-parallel-size 2 --transformer-impl {impl}")
    imp = megatron.read(base + " --moe-grouped-gemm", 2)
    plain = megatron.read(base, 2)
    assert imp.inputs.get("te_grouped_gemm", False) is grouped
    assert ("--moe-grouped-gemm" in imp.unread) is not grouped
    on = memplan.estimate(imp.model, gpus=2, gpu="h100", **imp.inputs)
    off = memplan.estimate(plain.model, gpus=2, gpu="h100", **plain.inputs)
    for a, b in zip(off.stages, on.stages):
        assert b.workspace_bytes - a.workspace_bytes == (134_221_824 if grouped else 0)
        assert b.tensor_peak_bytes == a.tensor_peak_bytes


def test_megatron_fsdp_moe_functional_test_states_and_workspaces() -> None:
    """The functional test gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_
    top2router as written (12 layers, h 512, ffn 2048, 8 experts, ep 2, tp 2, no linear
    biases, LayerNorm, learned positions, GPT-2 vocabulary 50257 padded to 50432, tied
    output, --bf16, Megatron-FSDP optim_grads_params on 8 GPUs: dp 4, expert dp 2).
    Per rank, by hand: dense weights 50432 / 2 * 512 = 12,910,592 (embedding) + 524,288
    (positions) + 12 * (2 * 1,024 norms + 3 * 512 * 256 qkv + 256 * 512 proj + 8 * 512
    router = 530,432) + 1,024 (final norm) = 19,801,088, sharded over 4: 4,950,272; expert
    weights 12 * 4 local experts * 2 * 512 * 1024 = 50,331,648, sharded over 2: 25,165,824;
    30,116,096 in all. Gradient shards fp32 under --bf16 (grad_reduce_in_fp32): 4 B each,
    120,464,384 B, so no fp32 copy at the step; the workspace line: PyTorch's 32 MiB,
    Transformer Engine's four grouped-GEMM workspaces, 4 * 33,555,456 = 134,221,824 B, and
    its workspace for its other GEMMs (the attention's linears), 33,555,456 B."""
    path = (Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "heldout" / "megatron"
            / "gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router.yaml")
    imp = megatron.read(str(path), 8)
    stage = memplan.estimate(imp.model, gpus=8, gpu="h100-sxm", **imp.inputs).stages[-1]
    shard = 19_801_088 // 4 + 50_331_648 // 2
    assert shard == 30_116_096
    assert (stage.params_bytes, stage.grads_bytes) == (2 * shard, 4 * shard)
    assert stage.optimizer_temp_bytes == 0
    assert stage.workspace_bytes == 32 * 2**20 + 5 * (32 * 2**20 + 1024)
