"""LoRA adapters and quantized frozen base weights (``memplan.model.adapters``): storage, states
and saved activations derived by hand, validation, the CLI flags.

The toy shape is the one tests/traced/test_finetune.py traces: Llama 3 cut to two layers,
hidden 256, 8 query and 2 KV heads of 32 (q 256 wide, k and v 64), ffn 896, vocabulary 1000,
untied head; micro-batch 2 of 128 tokens (T = 256).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import memplan
from memplan import api
from memplan.cli import app, main
from memplan.errors import MemplanError
from memplan.hardware import DEFAULT_GPU, load_gpu
from memplan.model.adapters import adapters_of, int8_bytes, nf4_bytes
from memplan.model.dims import Dims
from memplan.model.estimate import estimate
from memplan.model.layer import layer_kind
from memplan.overheads import no_overheads
from memplan.spec import spec_from_hf_dict
from memplan.workload import Workload

HF = Path(__file__).resolve().parents[1] / "data" / "hf" / "Meta-Llama-3-8B" / "config.json"


def toy():
    data = json.loads(HF.read_text())
    data.update(num_hidden_layers=2, hidden_size=256, intermediate_size=896,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
    return spec_from_hf_dict(data, "test", "llama3-toy")


def states(**lora):
    spec, par, wl = api.resolve(toy(), framework="hf", micro_batch_size=2, seq_len=128,
                                precision="bf16-pure", **lora)
    return estimate(spec, load_gpu(DEFAULT_GPU), par, wl, overheads=no_overheads()).stages[0]


def test_nf4_storage_of_one_weight() -> None:
    """A 896 x 256 weight (229,376 elements) as NF4 with double quantization, as
    bitsandbytes 0.50.2 stores it (read from a Params4bit on CPU): 114,688 B of packed nibbles,
    3,584 uint8 block absmax (229,376 / 64), 14 fp32 nested absmax (ceil(3,584 / 256)) = 56 B,
    an fp32 offset (4 B) and the 16-entry fp32 code (64 B): 118,396 B."""
    assert nf4_bytes(229_376) == 114_688 + 3_584 + 56 + 4 + 64 == 118_396


def test_int8_storage_of_one_weight() -> None:
    """A 896 x 256 Linear8bitLt weight: 229,376 int8 + 896 fp32 row scales = 232,960 B."""
    assert int8_bytes(256, 896) == 229_376 + 896 * 4


def test_default_targets() -> None:
    """peft's default for separate projections is q and v; a fused qkv is adapted whole;
    all-linear is every projection; naming a part adapts a fused projection holding it."""
    assert adapters_of(Workload(lora_rank=8)).targets == {"q", "v", "qkv"}
    assert adapters_of(Workload(lora_rank=8), fused_qkv=True).targets == {"qkv"}
    assert adapters_of(Workload(lora_rank=8, lora_targets="all-linear")).targets >= {
        "q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up"}
    assert "qkv" in adapters_of(Workload(lora_rank=8, lora_targets="k")).targets
    assert adapters_of(Workload()) is None


def test_lora_states_by_hand() -> None:
    """Default targets, rank 8: q's adapters 8 x 256 + 256 x 8 = 4,096, v's 8 x 256 + 64 x 8
    = 2,560; two layers: 13,312 fp32 parameters. Gradients 13,312 x 4 = 53,248 B; AdamW's two
    fp32 states 106,496 B and, fused (the hf preset), an fp32 step count on the device per
    adapter tensor, 8 x 4 = 32 B: 106,528 B. The bf16 base: embedding
    256,000, per layer 65,536 + 2 x 16,384 + 65,536 + 3 x 229,376 + 2 x 256 = 852,480, final
    norm 256, head 256,000: 2,217,216 x 2 B = 4,434,432 B, plus the adapters' 53,248 B."""
    st = states(lora_rank=8)
    assert st.grads_bytes == 53_248
    assert st.optimizer_bytes == 106_496 + 32
    assert st.params_bytes == 4_434_432 + 53_248


def test_qlora_states_by_hand() -> None:
    """All linears, rank 16, NF4: adapters per layer 16 x (512 + 320 + 320 + 512 + 3 x 1,152)
    = 81,920, 163,840 in all (655,360 B). Base: embedding, norms and head in bf16, (256,000 +
    4 x 256 + 256 + 256,000) x 2 = 1,026,560 B; per layer q and o 65,536 elements as NF4:
    32,768 + 1,024 + 4 x 4 + 68 = 33,876 B each, k and v 16,384: 8,192 + 256 + 4 + 68 = 8,520
    each, gate, up and down 118,396 each (``test_nf4_storage_of_one_weight``): 439,980 B a
    layer, 879,960 B for two. Total 1,026,560 + 879,960 + 655,360 = 2,561,880 B (as traced)."""
    st = states(lora_rank=16, lora_targets="all-linear", base_quant="nf4")
    assert st.params_bytes == 2_561_880
    assert st.grads_bytes == 655_360


def test_adapter_activations_by_hand() -> None:
    """bf16 base, q and v adapted, rank 8, T = 256 tokens: each adapter saves its own fp32
    cast of the normed input, 256 x 256 x 4 = 262,144 B (two: 524,288), and its rank-8
    intermediate, 256 x 8 x 4 = 8,192 B (two: 16,384). The frozen linears save no input:
    the norms' weighted copies, the norms' outputs and the down projection's input are 0;
    SDPA still saves the attention output (256 x 256 x 2 = 131,072 B)."""
    spec, par, wl = api.resolve(toy(), framework="hf", micro_batch_size=2, seq_len=128,
                                precision="bf16-pure", lora_rank=8)
    terms = dict(layer_kind(spec, wl, Dims.of(spec, par, wl), False, wl.recompute).terms)
    assert terms["attn.lora_input"] == 524_288
    assert terms["attn.lora_rank"] == 16_384
    assert terms["mlp.lora_input"] == terms["mlp.lora_rank"] == 0
    assert terms["attn_norm.normed"] == terms["attn_norm.output"] == terms["mlp.prod"] == 0
    assert terms["attn.out"] == 131_072


def test_dropout_adds_mask_and_copy() -> None:
    """With dropout each adapter saves a bool mask and the fp32 dropout output instead of the
    cast: q and v, 256 x 256 x (1 + 4) = 327,680 B each."""
    spec, par, wl = api.resolve(toy(), framework="hf", micro_batch_size=2, seq_len=128,
                                precision="bf16-pure", lora_rank=8, lora_dropout=0.1)
    terms = dict(layer_kind(spec, wl, Dims.of(spec, par, wl), False, wl.recompute).terms)
    assert terms["attn.lora_input"] == 2 * 327_680


def test_off_by_default() -> None:
    """Without LoRA nothing changes: every parameter trains (bf16-pure: 2 B gradients)."""
    st = states()
    assert st.grads_bytes == 2_217_216 * 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lora_targets": "q"}, "lora_targets (q) needs lora_rank > 0"),
    ({"base_quant": "nf4"}, "base_quant (nf4) needs lora_rank > 0"),
    ({"lora_dropout": 0.1}, "lora_dropout (0.1) needs lora_rank > 0"),
    ({"lora_rank": 8, "lora_targets": "q,x"}, "must name projections of q,k,v,o,gate,up,down"),
])
def test_validation_names_the_field(kwargs, message) -> None:
    with pytest.raises(MemplanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        api.resolve(toy(), **kwargs)


def test_cli_flags() -> None:
    """The flags reach the workload; the JSON and the text say LoRA is on; a mistake is one
    line and exit 2."""
    runner = CliRunner()
    args = ["estimate", "-m", "llama-2-7b", "--seq", "512", "--lora-rank", "16",
            "--lora-targets", "q,k,v,o", "--lora-dropout", "0.05", "--base-quant", "nf4"]
    out = json.loads(runner.invoke(app, [*args, "--json"], catch_exceptions=False).stdout)
    assert out["workload"]["lora_rank"] == 16
    assert out["workload"]["lora_targets"] == ["q", "k", "v", "o"]
    assert out["workload"]["base_quant"] == "nf4"
    assert any(a.startswith("LoRA rank 16 on q,k,v,o") for a in out["assumptions"])
    text = runner.invoke(app, args, env={"COLUMNS": "250"}, catch_exceptions=False).stdout
    assert "LoRA rank 16 on q,k,v,o, dropout 0.05, base weights frozen (nf4)" in text
    assert "lora_rank" not in json.loads(runner.invoke(
        app, ["estimate", "-m", "llama-2-7b", "--json"]).stdout)["workload"]


def test_cli_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "-m", "llama-2-7b", "--base-quant", "int8"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == ("memplan: error: base_quant (int8) needs lora_rank > 0 (frozen base "
                   "weights train through adapters), got lora_rank 0\n")


def test_dequantized_weight_in_backward() -> None:
    """A quantized base's backward dequantizes its weight to the compute dtype beside the
    input gradient: the toy's down projection, 896 x 256 in bf16, 458,752 B; none
    unquantized."""
    from memplan.model.linear import dequant_bytes
    from memplan.model.mlp import mlp_linears

    spec = toy()
    down = mlp_linears(spec, spec.ffn_hidden_size)[-1]
    for quant, expected in (("nf4", 458_752), ("int8", 458_752), ("none", 0)):
        _, par, wl = api.resolve(spec, precision="bf16-pure", lora_rank=8, base_quant=quant)
        assert dequant_bytes(down, Dims.of(spec, par, wl)) == expected


def test_lora_step_flops_skip_the_frozen_weight_gradients() -> None:
    """Llama-2-7B at seq 2048, one sequence: its matmuls are 13,214,679,040 FLOPs per token
    forward and the attention core 536,870,912 (both as memplan.planning.timing counts them),
    so full training is 3 x 13,751,549,952 = 41,254,649,856 per token. With LoRA every base
    weight is frozen: its backward makes only the input's gradient, one forward's worth, so
    13,214,679,040 less; the default q,v adapters of rank 16 add 2 x 16 x (4096 + 4096) =
    262,144 forward FLOPs per projection, 2 per layer, 32 layers: 16,777,216, trained: x 3 =
    50,331,648. Per token 41,254,649,856 - 13,214,679,040 + 50,331,648 = 28,090,302,464;
    x 2048 tokens = 57,528,939,446,272."""
    from memplan.planning.timing import step_flops

    spec = memplan.load_model("llama-2-7b")
    full = memplan.make_workload(spec, seq_len=2048, micro_batch_size=1)
    lora = memplan.make_workload(spec, seq_len=2048, micro_batch_size=1, lora_rank=16)
    assert step_flops(spec, full, 1, pp=1)[0] == 41_254_649_856 * 2048
    assert step_flops(spec, lora, 1, pp=1)[0] == 57_528_939_446_272


def test_torchao_01_nf4_storage_of_one_weight() -> None:
    """The same 896 x 256 weight as torchao 0.1's NF4Tensor (traced: tests/traced/
    test_torchao_nf4.py): 114,688 B of packed nibbles, 3,584 int8 block scales, their bf16
    quantization factors kept as a view of the whole expanded tensor, 3,584 x 2 = 7,168 B, a
    bf16 mean (2 B) and the 16-entry bf16 code (32 B): 125,474 B."""
    from memplan.model.adapters import nf4_torchao_01_bytes

    assert nf4_torchao_01_bytes(229_376) == 114_688 + 3_584 + 7_168 + 2 + 32 == 125_474


def test_torchao_01_states_and_load_by_hand() -> None:
    """All linears, rank 16, torchao 0.1 NF4: per layer q and o 65,536 elements, 32,768 +
    1,024 + 2,048 + 34 = 35,874 B each; k and v 16,384, 8,192 + 256 + 512 + 34 = 8,994 each;
    gate, up and down 125,474 each: 466,158 B a layer, 932,316 for two. Total with the bf16
    embedding, norms and head (1,026,560) and the fp32 adapters (655,360): 2,614,236 B. The
    model's load quantizes the largest weight (229,376 elements) whole beside every weight:
    68 x 229,376 + 5 x 3,584 + 34 = 15,615,522 B on top of the weights and buffers, above
    either step's peak at 256 tokens, so it is the tensor peak. bitsandbytes' NF4 models no
    load."""
    st = states(lora_rank=16, lora_targets="all-linear", base_quant="nf4-torchao-0.1")
    assert st.params_bytes == 2_614_236
    assert st.load_bytes == st.params_bytes + st.buffers_bytes + 15_615_522
    assert st.tensor_peak_bytes == st.load_bytes
    assert st.peak_phase == "model load (before step 1)"
    assert states(lora_rank=16, lora_targets="all-linear", base_quant="nf4").load_bytes == 0


def test_torchao_01_quantizes_the_adapted_linears_only() -> None:
    """torchtune quantizes the base of a LoRALinear only: q and v adapted (rank 8), per layer q
    as NF4 35,874 B and v 8,994 B (``test_torchao_01_states_and_load_by_hand``), k, o, gate, up
    and down in bf16 (32,768 + 131,072 + 3 x 458,752), norms 1,024: 1,585,988 B; two layers
    3,171,976, embedding, final norm and head 1,024,512, the fp32 adapters 53,248: 4,249,736 B.
    The largest weight quantized at load is q (65,536 elements): 68 x 65,536 + 5 x 1,024 + 34
    = 4,461,602 B. bitsandbytes' NF4 quantizes every linear (k's 16,384-element weight
    too: the base of ``test_qlora_states_by_hand``, 1,906,520 B, and the adapters 53,248)."""
    st = states(lora_rank=8, base_quant="nf4-torchao-0.1")
    assert st.params_bytes == 4_249_736
    assert st.load_bytes == st.params_bytes + st.buffers_bytes + 4_461_602
    assert states(lora_rank=8, base_quant="nf4").params_bytes == 1_906_520 + 53_248


def test_torchao_01_is_not_sharded(capsys: pytest.CaptureFixture[str]) -> None:
    """torchao 0.1's NF4Tensor has no ops for FSDP to shard it: zero 3 is refused, in one line
    naming both values, exit 2."""
    code = main(["estimate", "-m", "llama-2-7b", "--gpus", "2", "--zero", "3",
                 "--lora-rank", "8", "--base-quant", "nf4-torchao-0.1"])
    assert code == 2
    assert capsys.readouterr().err == (
        "memplan: error: base_quant nf4-torchao-0.1 with zero 3: torchao 0.1's NF4Tensor "
        "cannot be sharded (nf4-torchao, torchao's since 0.3, describes a sharded QLoRA)\n")


def test_torchao_nf4_storage_of_one_weight() -> None:
    """The same 896 x 256 weight as torchao's NF4Tensor since 0.3 (traced: tests/traced/
    test_torchao_nf4_current.py): 114,688 B of nibbles and 3,584 int8 block scales as 0.1's,
    but one bf16 factor per 256 blocks (ceil(3,584 / 256) = 14: 28 B), the bf16 mean and
    code (34 B): 118,334 B. FSDP2 gathers the nibbles, scales and factors (118,300 B)."""
    from memplan.model.adapters import nf4_torchao_bytes, quant_data_bytes
    from memplan.workload import BaseQuant

    assert nf4_torchao_bytes(229_376) == 114_688 + 3_584 + 28 + 2 + 32 == 118_334
    assert quant_data_bytes(BaseQuant.NF4_TORCHAO, 256, 896) == 118_300


def test_torchao_nf4_states_and_load_by_hand() -> None:
    """All linears, rank 16, torchao's NF4 since 0.3: per layer q and o 32,768 + 1,024 + 8 +
    34 = 33,834 B each; k and v 8,192 + 256 + 2 + 34 = 8,484 each; gate, up and down 118,334
    each: 439,638 B a layer, 879,276 for two; with the bf16 embedding, norms and head
    (1,026,560) and the fp32 adapters (655,360): 2,561,196 B. The load's copy_ quantizes the
    largest weight (229,376 elements, under one chunk) beside every weight: 69 x 229,376 +
    3 x 3,584 + 28 + 34 = 15,837,758 B, the tensor peak at 256 tokens."""
    st = states(lora_rank=16, lora_targets="all-linear", base_quant="nf4-torchao")
    assert st.params_bytes == 2_561_196
    assert st.load_bytes == st.params_bytes + st.buffers_bytes + 15_837_758
    assert st.tensor_peak_bytes == st.load_bytes
    assert st.peak_phase == "model load (before step 1)"


def test_torchao_nf4_quantizes_the_adapted_linears_only() -> None:
    """q and v adapted (rank 8): q 33,834 B and v 8,484 B as NF4 (above), k, o, gate, up and
    down in bf16 (32,768 + 131,072 + 3 x 458,752), norms 1,024: 1,583,438 B a layer,
    3,166,876 for two, with the embedding, final norm and head (1,024,512) and the fp32
    adapters (53,248): 4,244,636 B. The load quantizes q (65,536 elements): 69 x 65,536 +
    3 x 1,024 + 8 + 34 = 4,525,098 B."""
    st = states(lora_rank=8, base_quant="nf4-torchao")
    assert st.params_bytes == 4_244_636
    assert st.load_bytes == st.params_bytes + st.buffers_bytes + 4_525_098


def test_torchao_nf4_is_sharded_by_fsdp2() -> None:
    """At zero 3 on 2 ranks (FSDP2) a rank holds half of every parameter FSDP2 shards: the
    bf16 embedding, norms and head (1,026,560 B), the NF4 weights' nibbles, scales and
    factors (fsdp_pre_all_gather: 33,800 for q and o, 8,450 for k and v, 118,300 for gate, up
    and down; 878,800 for two layers) and the fp32 adapters (655,360), and the whole mean and
    code of each of its 14 NF4 shards (34 B each): 952,680 + 327,680 + 476 = 1,280,836 B."""
    spec, par, wl = api.resolve(toy(), gpus=2, zero=3, micro_batch_size=2, seq_len=128,
                                precision="bf16-pure", lora_rank=16, lora_targets="all-linear",
                                base_quant="nf4-torchao")
    st = estimate(spec, load_gpu(DEFAULT_GPU), par, wl, overheads=no_overheads()).stages[0]
    assert wl.fsdp_version == 2
    assert st.params_bytes == 1_280_836


def test_torchao_dequantize_the_same_in_both_releases() -> None:
    """torchao 0.3 on dequantizes as 0.1 did (get_original_weight, LinearNF4: traced alike),
    eager and compiled: the same saved bytes and moments for a layer, all linears adapted."""
    spec = toy()
    for compiled in (False, True):
        kinds = []
        for quant in ("nf4-torchao-0.1", "nf4-torchao"):
            _, par, wl = api.resolve(spec, precision="bf16-pure", lora_rank=8, seq_len=128,
                                     lora_targets="all-linear", base_quant=quant,
                                     compile=compiled, recompute="full",
                                     compile_in_checkpoint=compiled)
            dm = Dims.of(spec, par, wl)
            kinds.append(layer_kind(spec, wl, dm, False, wl.recompute))
        assert kinds[0] == kinds[1]


def test_torchao_01_dequantize_working_set() -> None:
    """torchao's get_original_weight, the toy's down projection (229,376 elements): int64
    indices of both nibbles 8 B, the looked-up and the scaled halves 2 + 2 B, the stacked bf16
    weight 2 B a weight, and 3,584 bf16 block scales: 14 x 229,376 + 7,168 = 3,218,432 B,
    more than the bf16 weight beside its input gradient (T = 256 x 896 x 2 = 458,752 B each:
    917,504), which is bitsandbytes' figure."""
    from memplan.model.linear import dequant_backward_bytes, dequant_forward_bytes
    from memplan.model.mlp import mlp_linears

    spec = toy()
    down = mlp_linears(spec, spec.ffn_hidden_size)[-1]
    for quant, backward, forward in (("nf4-torchao-0.1", 3_218_432, 3_218_432),
                                     ("nf4-torchao", 3_218_432, 3_218_432),
                                     ("nf4", 917_504, 458_752), ("none", 458_752, 458_752)):
        _, par, wl = api.resolve(spec, precision="bf16-pure", lora_rank=8,
                                 lora_targets="all-linear", base_quant=quant)
        dm = Dims.of(spec, par, wl)
        assert dequant_backward_bytes(down, dm, 458_752) == backward
        assert dequant_forward_bytes(down, dm, 458_752) == forward


def _checkpointed_mlp(**lora):
    from memplan.model.mlp import Mlp

    spec, par, wl = api.resolve(toy(), framework="hf", micro_batch_size=2, seq_len=128,
                                precision="bf16-pure", recompute="full", **lora)
    dm = Dims.of(spec, par, wl)
    (moment,) = [m for m in Mlp().working_set(spec, wl, dm) if m.name == "mlp"]
    return moment.transient_bytes


def test_checkpointed_mlp_holds_each_adapters_fp32_tensors() -> None:
    """A checkpointed layer's first forward saves nothing, yet peft's Linear.forward holds
    the adapters' fp32 cast of the input (bound to its local x) and lora_B's output and its
    scaled copy beside the base output. LoRA on every linear, T = 256, bf16 base, fp32
    adapters: up's adapter 256 x 256 x 4 (the cast, 262,144) + 2 x 256 x 896 x 4 (1,835,008)
    = 2,097,152 beside the activation's and up's outputs (2 x 256 x 896 x 2 = 917,504):
    3,014,656 B; the gate's 458,752 + 2,097,152 = 2,555,904; the down projection's: the
    product (458,752), its output (131,072), the cast 256 x 896 x 4 = 917,504 and 2 x 256 x
    256 x 4 = 524,288: 2,031,616. Without adapters the MLP's working set is 3 x 458,752 =
    1,376,256 (traced: tests/traced/test_finetune.py, gc cases)."""
    assert _checkpointed_mlp() == 1_376_256
    assert _checkpointed_mlp(lora_rank=8, lora_targets="all-linear") == 3_014_656
    # q and v only: the MLP's working set is the plain one
    assert _checkpointed_mlp(lora_rank=8) == 1_376_256
    # dropout 0.1 at the down projection: its input's cast (917,504), dropout's fp32 output and
    # bool mask 256 x 896 x 5 = 1,146,880 and lora_A's output 256 x 8 x 4 = 8,192 until lora_A
    # returns: 458,752 + 131,072 + 917,504 + 1,155,072 = 2,662,400, still below up's 3,014,656
    assert _checkpointed_mlp(lora_rank=8, lora_targets="down") == 458_752 + 131_072 + 1_441_792
    assert _checkpointed_mlp(lora_rank=8, lora_targets="down", lora_dropout=0.1) == 2_662_400


def test_rerun_holds_the_down_adapters_gradients_and_up_adapters_sum() -> None:
    """Under full recompute a layer's backward first runs the down projection's adapter-sum
    nodes, which need no saved tensor (peft: ``result.to(dtype)``, ``result + lora_B(...) *
    scaling``): the base output's gradient (bf16, 256 x 256 x 2 = 131,072) and the scaled
    product's (fp32, 256 x 256 x 4 = 262,144) wait through the rerun, beside the stream's
    gradient (131,072). The rerun, saving again, reaches up's adapter sum with what the MLP
    saved before it (its norm's fp32 input 262,144, stats 1,024, gate and act 2 x 458,752,
    the gate's and up's fp32 input casts 2 x 262,144 and lora_A outputs 2 x 8,192 =
    1,721,344), the attention's saved bytes (its norm's 263,168, q 131,072, k and v 2 x
    32,768, the output 131,072, lse 8,192, four casts 1,048,576, four lora_A outputs 32,768 =
    1,680,384) and the layer's checkpointed input (131,072) alive: 3,532,800; beside them the
    post-attention residual (131,072: the MLP's norm saves its fp32 copy, not it), the MLP's
    input (131,072), up's output (458,752) and its adapter's lora_B output and scaled copy
    (2 x 256 x 896 x 4 = 1,835,008), and the three gradients: 3,080,192. Their sum, 6,612,992
    B, is the traced rerun's with the layer's input (tests/traced/test_finetune.py, gc)."""
    from memplan.model.mlp import rerun_pending_bytes
    from memplan.workload import Recompute

    spec, par, wl = api.resolve(toy(), framework="hf", micro_batch_size=2, seq_len=128,
                                precision="bf16-pure", recompute="full", lora_rank=8,
                                lora_targets="all-linear")
    dm = Dims.of(spec, par, wl)
    assert rerun_pending_bytes(spec, dm) == 131_072 + 262_144
    kind = layer_kind(spec, wl, dm, False, Recompute.FULL)
    (rerun,) = [m for m in kind.moments if m.name == "mlp_lora"]
    assert (rerun.alive_bytes, rerun.transient_bytes) == (3_532_800, 3_080_192)
    # an fp32 base: the sum's gradient goes to the base as it is, only the scaled product's
    # is made (256 x 256 x 4); the product is saved by down's lora_A itself, so the rerun's
    # stop adds nothing beside the saved bytes
    from memplan.model.mlp import rerun_stop_bytes

    spec, par, wl = api.resolve(toy(), framework="hf", micro_batch_size=2, seq_len=128,
                                precision="fp32", recompute="full", lora_rank=8,
                                lora_targets="all-linear")
    assert rerun_pending_bytes(spec, Dims.of(spec, par, wl)) == 262_144
    assert rerun_stop_bytes(spec, Dims.of(spec, par, wl)) == 0
    # bf16 with dropout: the product (256 x 896 x 2 = 458,752) and its fp32 cast (917,504)
    spec, par, wl = api.resolve(toy(), framework="hf", micro_batch_size=2, seq_len=128,
                                precision="bf16-pure", recompute="full", lora_rank=8,
                                lora_targets="all-linear", lora_dropout=0.1)
    assert rerun_stop_bytes(spec, Dims.of(spec, par, wl)) == 458_752 + 917_504
    # q and v only: the down projection has no adapter, no adapter gradient waits
    spec, par, wl = api.resolve(toy(), framework="hf", micro_batch_size=2, seq_len=128,
                                precision="bf16-pure", recompute="full", lora_rank=8)
    assert rerun_pending_bytes(spec, Dims.of(spec, par, wl)) == 0


def test_torchao_nf4_load_is_replayed_per_weight() -> None:
    """The caching allocator's sequence (``memplan.model.alloc_sequence``) for torchao's NF4
    since 0.3: after the weights and buffers are made, one working set per quantized weight,
    in registration order (each layer's q, k, v, o, gate, up, down), each the tensors of its
    ``copy_`` (``adapters.torchao_copy_pieces``: q's 65,536 weights, under one chunk: the
    131,072 B source, the 32 B code, 1,024 int8 scales, 8 B of factors, the 2 B mean, 2,048 B
    of block absmax, the 131,072 B scaled copy, the 65,536 B index buffer and two 2,097,152 B
    distance tensors). 0.1's set-up is its own (``nf4_init``), and bitsandbytes' has none."""
    from memplan.model import memo
    from memplan.model.adapters import torchao_copy_pieces
    from memplan.model.alloc_sequence import stage_sequence
    from memplan.model.allocator import Blip
    from memplan.model.reserved import stage_inputs
    from memplan.model.stage import walk_stage

    def setup_blips(quant: str) -> list[tuple[int, ...]]:
        spec, par, wl = api.resolve(toy(), framework="hf", micro_batch_size=2, seq_len=128,
                                    precision="bf16-pure", lora_rank=16,
                                    lora_targets="all-linear", base_quant=quant)
        est = estimate(spec, load_gpu(DEFAULT_GPU), par, wl, overheads=no_overheads())
        parts = memo.stage_parts(spec, par, wl)
        shared = memo.shared_terms(spec, wl, Dims.of(spec, par, wl), par.experts, parts)
        walked = walk_stage(spec, par, wl, est.num_microbatches, 0, est.schedule, shared,
                            parts[0])
        b = stage_sequence(stage_inputs(spec, par, wl, 1, walked, shared))
        return [e.tensors() for e in b.events[:b.marks[0]] if isinstance(e, Blip)]

    layer = [65_536, 16_384, 16_384, 65_536, 229_376, 229_376, 229_376]
    got = setup_blips("nf4-torchao")
    assert got == [tuple(torchao_copy_pieces(n)) for n in layer * 2]
    assert got[0] == (131_072, 32, 1_024, 8, 2, 2_048, 131_072, 65_536, 2_097_152, 2_097_152)
    assert setup_blips("nf4") == []
