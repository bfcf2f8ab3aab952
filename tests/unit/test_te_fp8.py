"""Transformer Engine's fp8 linears (``Workload.te_fp8``, ``memplan.model.te_fp8`` and
``memplan.model.linear``), with bytes derived by hand from Transformer Engine v2.9's code
(``transformer_engine/pytorch/``). Transformer Engine needs CUDA, so none of this is traced on
the CPU machines the tests run on; each expected value below follows from these facts of the
source (the same at the commit Megatron-LM's functional tests ran with, b9d690e, 2.16.0 dev,
except where said):

- ``tensor/float8_tensor.py`` (delayed: ``Float8Quantizer``; tensorwise:
  ``Float8CurrentScalingQuantizer``), ``make_empty``: the data ``torch.uint8`` in the tensor's
  shape, a transposed ``uint8`` copy for columnwise use (Hopper), one fp32 ``scale_inv`` of
  shape (1,) for both.
- ``tensor/mxfp8_tensor.py`` ``MXFP8Quantizer.make_empty``: rowwise scales ``uint8``
  (roundup(rows, 128), roundup(cols / 32, 4)), columnwise (roundup(rows / 32, 4),
  roundup(cols, 128)).
- ``tensor/float8_blockwise_tensor.py`` ``Float8BlockQuantizer.get_scale_shape``: fp32 scales;
  weights in 128x128 blocks (ceil(rows / 128), roundup(ceil(cols / 128), 4)) rowwise and
  (ceil(cols / 128), roundup(ceil(rows / 128), 4)) columnwise; activations in 1x128 blocks,
  columnwise (ceil(rows / 128), roundup(cols, 4)).
- ``module/linear.py`` / ``module/layernorm_linear.py`` forward: each module saves one fp8
  copy of its input (the local sequence shard for a column-parallel module under sequence
  parallelism, all tokens for a row-parallel one), not the compute-dtype input.
- ``module/base.py`` ``get_weight_workspace(cache_name="weight")``: the fp8 weight, rowwise
  and columnwise, cached in ``_fp8_workspaces`` (Megatron passes ``is_first_microbatch``);
  ``init_fp8_meta_tensors``: 3 forward and 2 backward quantizers per GEMM; ``quantization.py``
  ``DelayedScalingRecipeState``: an fp32 scale and ``amax_history_len`` fp32 amaxes each;
  the current-scaling quantizer holds none at b9d690e.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan import api
from memplan.config_import import megatron
from memplan.errors import LayoutError, MemplanError
from memplan.model import linear, te_fp8
from memplan.model.dims import Dims
from memplan.model.linear import Linear, Split
from memplan.parallel import ParallelConfig, validate
from memplan.spec import ModelSpec, load_model
from memplan.workload import TeFp8Recipe as R
from memplan.workload import Workload

ROOT = Path(__file__).resolve().parents[2]
# 2 x 1024 tokens at TP 2 with sequence parallelism (1,024 rows of the residual stream)
DM = Dims(b=2, s=1024, s_kv=1024, tokens=2048, res_tokens_div=2, tp=2, e=2, vocab_shard=64,
          stream_e=2)
QKV = (Linear("q", "attn", 512, 512), Linear("k", "attn", 512, 512),
       Linear("v", "attn", 512, 512), Linear("o", "attn_out", 512, 512, split=Split.ROW))


@pytest.mark.parametrize(("recipe", "rows", "cols", "usage", "weight", "expected"), [
    # one orientation of 256 x 512: 131,072 data bytes + one fp32 scale
    (R.TENSORWISE, 256, 512, (True, False), False, 131_076),
    # both: 2 * 131,072 + 4, the scale shared
    (R.DELAYED, 256, 512, (True, True), False, 262_148),
    # mxfp8 columnwise: 131,072 + roundup(256/32 = 8, 4) * roundup(512, 128) = 8 * 512
    (R.MXFP8, 256, 512, (False, True), False, 135_168),
    # mxfp8 rowwise: 131,072 + roundup(256, 128) * roundup(512/32 = 16, 4) = 256 * 16
    (R.MXFP8, 256, 512, (True, False), False, 135_168),
    # blockwise activation columnwise: 131,072 + ceil(256/128) * roundup(512, 4) * 4 = 4,096
    (R.BLOCKWISE, 256, 512, (False, True), False, 135_168),
    # blockwise weight 1536 x 512, both: 2 * 786,432 + rowwise 12 * roundup(4, 4) * 4 = 192
    # + columnwise 4 * roundup(12, 4) * 4 = 192
    (R.BLOCKWISE, 1536, 512, (True, True), True, 1_573_248),
    (R.NONE, 256, 512, (True, True), False, 0),
])
def test_quantized_bytes(recipe: R, rows: int, cols: int, usage: tuple[bool, bool],
                         weight: bool, expected: int) -> None:
    assert te_fp8.quantized_bytes(recipe, rows, cols, rowwise=usage[0], columnwise=usage[1],
                                  weight=weight) == expected


def test_module_state() -> None:
    """Delayed, 1,024 history rows: 5 quantizers * (1,024 amaxes + 1 scale) * 4 = 20,500;
    the other recipes' quantizers hold no tensor (b9d690e's ``Float8CurrentScalingQuantizer``
    ignores ``scale`` and ``amax``)."""
    assert te_fp8.module_state_bytes(R.DELAYED, 1024) == 20_500
    assert te_fp8.module_state_bytes(R.TENSORWISE, 1024) == 0
    assert te_fp8.module_state_bytes(R.MXFP8, 1) == te_fp8.module_state_bytes(R.BLOCKWISE, 1) == 0


def test_saved_inputs_one_per_module() -> None:
    """q, k and v are one TE module (linear_qkv) reading the norm's output: its fp8 copy of
    the local shard, 1,024 rows x 512 = 524,288 + 4 (tensorwise); o (row-parallel) saves all
    2,048 tokens x 512 / 2 = 524,288 + 4. Total 1,048,584. mxfp8 (columnwise copies): qkv
    524,288 + roundup(1024/32, 4) * roundup(512, 128) = 32 * 512 = 16,384; o 524,288 +
    roundup(2048/32, 4) * roundup(256, 128) = 64 * 256 = 16,384: 1,081,344."""
    terms = linear.saved_terms("attn", QKV, DM._replace(te_fp8=R.TENSORWISE))
    assert terms == [("attn.fp8_inputs", 1_048_584)]
    assert linear.saved_bytes(QKV, DM._replace(te_fp8=R.MXFP8)) == 1_081_344


def test_weight_caches() -> None:
    """Tensorwise at TP 2: qkv's local weight 768 x 512 = 393,216 elements, o's 512 x 256 =
    131,072. Cached rowwise and columnwise: 2 * 393,216 + 4 = 786,436 and 2 * 131,072 + 4 =
    262,148: 1,048,584. With fp8 parameters the rowwise data is the parameter: 1,048,584 -
    393,216 - 131,072 = 524,296. Delayed, 16 history rows: each module also keeps 5 * 17 * 4
    = 340 B of scales and amaxes: 1,048,584 + 680 = 1,049,264."""
    dm = DM._replace(te_fp8=R.TENSORWISE)
    assert linear.te_fp8_weight_bytes(QKV, dm, 1, False) == 1_048_584
    assert linear.te_fp8_weight_bytes(QKV, dm, 1, True) == 524_296
    assert linear.te_fp8_weight_bytes(QKV, dm._replace(te_fp8=R.DELAYED), 16,
                                      False) == 1_049_264


SPEC = ModelSpec.model_validate({
    "name": "te-fp8-test", "hidden_size": 512, "num_layers": 2, "num_attention_heads": 8,
    "num_kv_heads": 8, "head_dim": 64, "tied_embeddings": False,
    "ffn_hidden_size": 2048, "vocab_size": 1024, "mlp": "gelu", "norm": "rmsnorm",
    "position": "rope", "max_seq_len": 1024, "source": "hand-made for this test"})
KW = dict(gpus=2, tp=2, sequence_parallel=True, framework="megatron", micro_batch_size=2,
          seq_len=1024, precision="bf16-fp32-grads")


def test_stage_saved_kept_and_params() -> None:
    """Two layers, h 512, ffn 2048 (GeLU), 2 x 1024 tokens, TP 2 with SP, flash attention.
    Per layer, saved in bf16 and dropped under fp8: the two norms' outputs (1,024 rows x 512 x
    2 = 1,048,576 each) and the GeLU output fc2 reads (2,048 x 1,024 x 2 = 4,194,304); the
    attention output stays (the fused core saves it). Saved instead, tensorwise: qkv and o
    1,048,584 (``test_saved_inputs_one_per_module``), fc1 1,024 x 512 + 4 = 524,292, fc2
    2,048 x 1,024 + 4 = 2,097,156: per layer 3,670,032 - 6,291,456 = -2,621,424, two layers
    -5,242,848. Kept: per layer qkv and o 1,048,584, fc1 (1,024 x 512 local) 2 * 524,288 + 4
    = 1,048,580, fc2 (512 x 1,024) the same: 3,145,744, two layers 6,291,488; with fp8
    parameters 6,291,488 - 2 * (393,216 + 131,072 + 2 * 524,288) = 3,145,760, and the
    parameters 2 * 1,572,864 = 3,145,728 bytes fewer (one byte in place of two)."""
    plain = api.estimate(SPEC, **KW).stages[0]
    fp8 = api.estimate(SPEC, te_fp8="tensorwise", **KW).stages[0]
    gathered = api.estimate(SPEC, te_fp8="tensorwise", te_fp8_param_gather=True,
                            **KW).stages[0]
    assert fp8.activations_bytes - plain.activations_bytes == -5_242_848
    assert fp8.buffers_bytes - plain.buffers_bytes == 6_291_488
    assert gathered.buffers_bytes - plain.buffers_bytes == 3_145_760
    assert plain.params_bytes - gathered.params_bytes == 3_145_728


@pytest.mark.parametrize(("model", "update", "why"), [
    ("mixtral-8x7b", {}, "MoE layers"),
    ("tiny", {"compile": True}, "compile"),
    ("tiny", {"lora_rank": 8}, "lora_rank 8"),
    ("tiny", {"precision": "amp-bf16"}, "precision amp-bf16"),
    ("tiny", {"mtp_layers": 1}, "mtp_layers 1"),
])
def test_refuses_what_is_not_modelled(model: str, update: dict, why: str) -> None:
    wl = Workload.model_validate({"te_fp8": "mxfp8", **update})
    with pytest.raises(LayoutError, match=f"te_fp8 mxfp8 with {why}: not modelled"):
        validate(load_model(model), ParallelConfig(), wl)


def test_param_gather_needs_a_recipe() -> None:
    with pytest.raises(LayoutError, match="te_fp8_param_gather with te_fp8 none"):
        validate(load_model("tiny"), ParallelConfig(), Workload(te_fp8_param_gather=True))


def test_megatron_reads_the_fp8_flags() -> None:
    """Megatron-LM's weekly fp8 functional test: --fp8-format hybrid, --fp8-recipe tensorwise,
    --fp8-param-gather."""
    imp = megatron.read(str(ROOT / "benchmarks/data/heldout/megatron/gpt3_weekly_mcore_tp2_pp2_"
                                   "current_scaling_native_fp8_tp_pp_sp_tp_overlap.yaml"), 8)
    assert (imp.inputs["te_fp8"], imp.inputs["te_fp8_param_gather"]) == ("tensorwise", True)


@pytest.mark.parametrize(("args", "flag"), [
    ("--fp8-format e5m2", "--fp8-format"),
    ("--fp8-format hybrid --fp8-recipe custom", "--fp8-recipe"),
    ("--fp8-format hybrid --no-fp8-wgrad", "--no-fp8-wgrad"),
    ("--fp8-format hybrid --transformer-impl local", "--fp8-format"),
    ("--fp8-recipe delayed", "--fp8-recipe"),
    ("--fp8-format e4m3 --fp8-param-gather", "--fp8-param-gather"),
])
def test_megatron_refuses_by_name(args: str, flag: str) -> None:
    base = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
            "--max-position-embeddings 1024 --vocab-size 1024 --bf16 ")
    with pytest.raises(MemplanError, match=flag):
        megatron.read(base + args, 8)


@pytest.mark.parametrize(("extra", "expected"), [
    ("", 33_555_456), (" --tp-comm-overlap", 4 * 33_555_456),
    (" --transformer-impl local", 0)])
def test_te_gemm_workspaces(extra: str, expected: int) -> None:
    """Transformer Engine's layers run their GEMMs on TE's own workspace (b9d690e
    ``cpp_extensions/gemm.py`` ``get_cublas_workspace(device, ub, grouped_gemm)``, kept by
    ``functools.lru_cache``): 32 MiB + 1,024 B = 33,555,456 B on an H100, beside PyTorch's
    32 MiB; with --tp-comm-overlap also the Userbuffers GEMMs' one,
    ``_NUM_MAX_UB_STREAMS`` (3) x 33,555,456; none with Megatron's own layers."""
    base = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
            "--max-position-embeddings 1024 --vocab-size 1024 --bf16 "
            "--tensor-model-parallel-size 2 --sequence-parallel")
    imp = megatron.read(base + extra, 2)
    stage = api.estimate(imp.model, gpus=2, gpu="h100", **imp.inputs).stages[0]
    assert stage.workspace_bytes - 32 * 2**20 == expected


def test_blackwell_keeps_no_transposes() -> None:
    """From compute capability 10 TE's fp8 GEMMs take non-TN layouts
    (``nvte_is_non_tn_fp8_gemm_supported``): a per-tensor fp8 tensor's rowwise data serves its
    columnwise use too (``Float8TensorStorage.update_usage``, ``Float8Quantizer::
    create_tensor``: no transpose). On a B200, ``test_stage_saved_kept_and_params``'s
    tensorwise run keeps per layer one copy of each weight, 393,216 + 131,072 + 2 * 524,288
    = 1,572,864 B plus four 4-byte scales, 3,145,760 B for two layers (half Hopper's
    6,291,488 B less 16 B of scales); with fp8 parameters only the scales, 32 B; the saved
    copies are the same bytes (one orientation either way)."""
    h100 = api.estimate(SPEC, te_fp8="tensorwise", **KW).stages[0]
    b200 = api.estimate(SPEC, te_fp8="tensorwise", **{**KW, "gpu": "b200"}).stages[0]
    plain = api.estimate(SPEC, **{**KW, "gpu": "b200"}).stages[0]
    gathered = api.estimate(SPEC, te_fp8="tensorwise", te_fp8_param_gather=True,
                            **{**KW, "gpu": "b200"}).stages[0]
    assert b200.buffers_bytes - plain.buffers_bytes == 3_145_760
    assert gathered.buffers_bytes - plain.buffers_bytes == 32
    assert b200.activations_bytes == h100.activations_bytes
    forced = api.estimate(SPEC, te_fp8="tensorwise", te_fp8_transposes=True,
                          **{**KW, "gpu": "b200"}).stages[0]
    assert forced.buffers_bytes == h100.buffers_bytes
