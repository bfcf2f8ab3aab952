"""DeepSpeed's ZeRO-2 as memplan models it (``memplan.model.deepspeed_zero``, the deepspeed
preset) and a ds_config.json read as written (``memplan.config_import.deepspeed_config``).

Every expected number is derived by hand from DeepSpeed 0.19.8's source in the docstring;
tests/traced/test_deepspeed_trace.py checks the same against DeepSpeed's own code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan import api
from memplan.cli import app, main
from memplan.config_import import deepspeed_config
from memplan.errors import MemplanError
from memplan.model.deepspeed_zero import (
    bucket_buffers,
    estimate_zero2,
    estimate_zero3,
    first_reduce,
    partition_numel,
    stage1_offload_reduce_bytes,
    stage1_reduce_bytes,
    sub_groups,
    weight_grads_at,
    zero3_gathers,
    zero3_states,
    zero3_step_bytes,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
LLAMA_7B_PARAMS = 6_738_415_616  # tests/unit/test_hf_config.py: Llama-2-7B's published count
GIB = 2**30


# --- DeepSpeed's own estimators, as written ------------------------------------------------

def test_zero2_estimator_by_hand() -> None:
    """estimate_zero2_model_states_mem_needs (stage_1_and_2.py), P = 1e9:
    - 8 GPUs, 1 node, no offload: GPU 2P + int(18P / 8) = 2e9 + 2.25e9 = 4.25e9;
      CPU P x 4 x 8 x 1.5 = 48e9.
    - the same with offload: GPU 2P = 2e9; CPU P x max(4 x 8, 16) x 1.5 = 48e9.
    - 2 nodes of 8, offload: CPU P x max(64, 16) x 1.5 = 96e9; no offload: GPU 2e9 +
      int(18e9 / 16) = 3.125e9, CPU P x 4 x 8 x 1.5 = 48e9 (per node's GPUs).
    - one GPU, offload: CPU P x max(4, 16) x 1.5 = 24e9."""
    p = 1_000_000_000
    assert estimate_zero2(p, 8, 1, cpu_offload=False) == (48_000_000_000, 4_250_000_000, 0)
    assert estimate_zero2(p, 8, 1, cpu_offload=True) == (48_000_000_000, 2_000_000_000, 0)
    assert estimate_zero2(p, 8, 2, cpu_offload=True).cpu_bytes == 96_000_000_000
    assert estimate_zero2(p, 8, 2, cpu_offload=False) == (48_000_000_000, 3_125_000_000, 0)
    assert estimate_zero2(p, 1, 1, cpu_offload=True).cpu_bytes == 24_000_000_000


def test_zero3_estimator_by_hand() -> None:
    """estimate_zero3_model_states_mem_needs (stage3.py), P = 1e9, largest layer 1e8 (4 B each:
    4e8), 8 GPUs on 1 node (gpus_factor 1):
    - no offload: GPU 4e8 + int(18e9 / 8) = 2.65e9; CPU (zero_init) 1e8 x 4 x 8 x 1.5 = 4.8e9,
      (no zero_init) 1e9 x 4 x 8 x 1.5 = 48e9.
    - optimizer offloaded: GPU 4e8 + int(2e9 / 8) = 6.5e8; CPU 1e9 x 16 x 1.5 = 24e9.
    - both offloaded: GPU 4e8; CPU 1e9 x 18 x 1.5 = 27e9; without zero_init
      1e9 x max(32, 18) x 1.5 = 48e9."""
    p, big = 1_000_000_000, 100_000_000
    assert estimate_zero3(p, big, 8, 1, cpu_offload=False) == (
        4_800_000_000, 2_650_000_000, 400_000_000)
    assert estimate_zero3(p, big, 8, 1, cpu_offload=False, zero_init=False).cpu_bytes == (
        48_000_000_000)
    assert estimate_zero3(p, big, 8, 1, cpu_offload=True, cpu_offload_params=False) == (
        24_000_000_000, 650_000_000, 400_000_000)
    assert estimate_zero3(p, big, 8, 1) == (27_000_000_000, 400_000_000, 400_000_000)
    assert estimate_zero3(p, big, 8, 1, zero_init=False).cpu_bytes == 48_000_000_000


def test_model_states_equal_deepspeeds_zero2_estimator() -> None:
    """Llama-2-7B (P = 6,738,415,616; P / 8 = 842,301,952 exactly) on 8 GPUs, ZeRO-2, bf16:
    DeepSpeed's estimator gives 2P + int(18P / 8) = 13,476,831,232 + 15,161,435,136 =
    28,638,266,368 B ("2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit
    + 8_optimizer_states_32bit"). memplan holds the same pieces: weights 2P, the gradient
    partition 2P/8, the fp32 partition and its two states 12P/8 plus one fp32 step count of the
    one flat partition (4 B, torch's fused AdamW; DeepSpeed's FusedAdam keeps it in Python), and
    in the step the fp32 gradient 4P/8 = 3,369,207,808 B (3.14 GiB: the out-of-memory report's
    request) beside the flat copy of the gradient partition 2P/8 = 1,684,603,904 B."""
    est = api.estimate("llama-7b", gpus=8, zero=2, framework="deepspeed")
    st = est.stages[0]
    part = LLAMA_7B_PARAMS // 8
    assert st.params_bytes == 13_476_831_232
    assert st.grads_bytes == 2 * part == 1_684_603_904
    assert st.optimizer_bytes == 12 * part + 4 == 10_107_623_428
    fp32_grad = 4 * part
    assert fp32_grad == 3_369_207_808 and round(fp32_grad / GIB, 2) == 3.14
    assert st.optimizer_temp_bytes == fp32_grad + 2 * part == 5_053_811_712
    model_states = st.params_bytes + st.grads_bytes + st.optimizer_bytes - 4 + fp32_grad
    assert model_states == estimate_zero2(LLAMA_7B_PARAMS, 8, 1, cpu_offload=False).gpu_bytes
    assert model_states == 28_638_266_368


def test_reduce_bucket_is_whole_from_the_first_gradient() -> None:
    """DeepSpeed's default bucket: 5e8 elements of bf16, one buffer (overlap_comm off below
    stage 3): 1e9 B, however few gradients are not this rank's (a 1-rank job holds it too);
    overlap_comm doubles it; contiguous_gradients off allocates none."""
    assert (bucket_buffers(True, False), bucket_buffers(True, True),
            bucket_buffers(False, True)) == (1, 2, 0)
    for gpus in (1, 8):
        st = api.estimate("llama-7b", gpus=gpus, zero=2, framework="deepspeed").stages[0]
        assert st.sharding_buffers_bytes == 1_000_000_000
    two = api.estimate("llama-7b", gpus=8, zero=2, framework="deepspeed",
                       zero_bucket_buffers=2).stages[0]
    assert two.sharding_buffers_bytes == 2_000_000_000


def test_backward_holds_the_bucket_forward_does_not() -> None:
    """The bucket exists from the first gradient hook (the head's weight gradient) to the end
    of backward: where a moment with it is the backward's peak, the peak rises by its bytes
    (5e8 x 2 B against 4e8 x 2 B: 2e8 B; the partition is made at the same block with both,
    ``test_first_reduce_by_hand``), the forward peak does not move."""
    big = api.estimate("llama-7b", gpus=8, zero=2, framework="deepspeed").stages[0]
    less = api.estimate("llama-7b", gpus=8, zero=2, framework="deepspeed",
                        zero_bucket_numel=400_000_000).stages[0]
    assert big.steady.forward == less.steady.forward
    assert big.steady.backward - less.steady.backward == 200_000_000


def test_first_reduce_by_hand() -> None:
    """Llama-2-7B in backward order: the head (lm_head 32,000 x 4,096 = 131,072,000 and the
    final norm 4,096: 131,076,096 elements), then layers of 4 x 4096^2 + 3 x 4096 x 11008 +
    2 x 4096 = 202,383,360 each. A 5e8 bucket is passed within the second layer in backward
    (131,076,096 + 2 x 202,383,360 = 535,842,816 > 5e8): index 1; 4e8 the same; 1e8 within the
    head (-1); a bucket larger than all 6,738,415,616 elements: the epilogue (32 + 1 = 33)."""
    head, layer, emb = 131_076_096, 202_383_360, 131_072_000
    layers = (layer,) * 32
    assert first_reduce(head, layers, emb, 500_000_000) == 1
    assert first_reduce(head, layers, emb, 400_000_000) == 1
    assert first_reduce(head, layers, emb, 100_000_000) == -1
    assert first_reduce(head, layers, emb, 7_000_000_000) == 33
    # 131,076,096 + 32 x 202,383,360 = 6,607,343,616: the embedding's gradient passes 6.7e9
    assert first_reduce(head, layers, emb, 6_700_000_000) == 32


def test_weight_grads_at_moments_by_hand() -> None:
    """A layer's moments making gradients of 0, 400, 0, 100, 300 elements, bf16, bucket 250:
    each at its own moment (800, 200, 600 B); the 400-element one is larger than the bucket and
    stays until the next weight's hook: also at the two moments after it (800 B at the second,
    (100 + 400) x 2 = 1,000 B at the fourth); the 300-element one would stay beyond the layer."""
    assert weight_grads_at((0, 400, 0, 100, 300), 250, 2) == (0, 800, 800, 1_000, 600)
    assert weight_grads_at((0, 400, 0, 100, 300), 500, 2) == (0, 800, 0, 200, 600)


def test_deepspeed_refuses_what_it_does_not_model() -> None:
    for kwargs, name in ((dict(zero=0), "--zero 0"),
                         (dict(zero=1, zero_bucket_buffers=2), "--zero 1 with overlap_comm"),
                         (dict(zero=1, global_batch_size=16), "--zero 1 with overlap_comm"),
                         (dict(zero=2, precision="fp32"), "precision"),
                         (dict(zero=1, offload="activations"), "--offload"),
                         (dict(zero=2, offload="activations"), "--offload"),
                         (dict(zero=2, tp=2), "--tp, --pp"), (dict(zero=2, pp=2), "--tp, --pp")):
        with pytest.raises(MemplanError, match=name):
            api.estimate("llama-7b", gpus=8, framework="deepspeed", **kwargs)


# --- ZeRO stage 3 (stage3.py), the pieces -----------------------------------------------------

# The toy Llama of tests/traced (hf_configs.LLAMA3_TOY: vocabulary 1,000, hidden 256, MLP 896,
# 8 heads of 32, 2 KV heads, 2 layers, untied head) on 2 ranks, each parameter's partition
# ceil(numel / 2) in named_parameters() order: embedding 256,000 / 2 = 128,000; per layer q and o
# 65,536 / 2 = 32,768, k and v 16,384 / 2 = 8,192, gate, up, down 229,376 / 2 = 114,688, two
# norms 128; the final norm 128; the head 128,000. P / 2 = 1,108,608.
_LAYER = (32_768, 8_192, 8_192, 32_768, 114_688, 114_688, 114_688, 128, 128)
TOY_PARTITIONS = (128_000, *_LAYER, *_LAYER, 128, 128_000)


def test_zero3_partition_and_sub_groups_by_hand() -> None:
    """partition_numel: ceil(numel / N) (partition_parameters.py _aligned_size); 7 elements on
    2 ranks: 4. Sub-groups (stage3.py _create_fp16_sub_groups) of the toy's partitions,
    sub_group_size 5e5: the embedding and layer 0 up to its down projection make
    128,000 + 32,768 + 8,192 + 8,192 + 32,768 + 3 x 114,688 = 553,984 >= 5e5, closed there;
    the rest (layer 0's two norms 256, layer 1's 425,984 + 256, the final norm 128, the head
    128,000) is 554,624, closed by the last parameter. The default 1e9: one sub-group of
    1,108,608 (traced: tests/traced/test_deepspeed_trace.py)."""
    assert partition_numel(7, 2) == 4 and partition_numel(65_536, 2) == 32_768
    assert sum(TOY_PARTITIONS) == 1_108_608
    assert sub_groups(TOY_PARTITIONS, 500_000) == (553_984, 554_624)
    assert sub_groups(TOY_PARTITIONS) == (1_108_608,)


def test_zero3_states_by_hand() -> None:
    """The toy on 2 ranks, bf16, reduce bucket 3e5: bf16 partition 1,108,608 x 2 =
    2,217,216 B; the kept gradient partition (grad accumulation dtype = bf16) the same; the
    bucket 3e5 x 2 = 600,000 B; fp32 partition 4,434,432 B; Adam 8,868,864 B. Persistent
    parameters (threshold 1e5): the 5 norms (256 each) and the 4 q/o (65,536) and 4 k/v
    (16,384) projections = 1,280 + 262,144 + 65,536 = 328,960 elements, 657,920 B."""
    st = zero3_states(TOY_PARTITIONS, 328_960, 300_000, 2, 2)
    assert st == (2_217_216, 657_920, 2_217_216, 600_000, 4_434_432, 8_868_864)
    assert zero3_states(TOY_PARTITIONS, 0, 300_000, 2, 2, contiguous=False).bucket == 0


def test_zero3_step_by_hand() -> None:
    """stage3.py step, one sub-group at a time. One sub-group g = 1,108,608: step 1 makes the
    fp32 gradient (4g) and then exp_avg, exp_avg_sq (8g) beside it: 12g = 13,303,296 B
    (the flat bf16 copy, 2g, is dropped before: 6g is less); later steps: the states 8g and
    the flat copy with the fp32 gradient 6g = 15,520,512 B. Two sub-groups 553,984 and
    554,624: step 1's peak is at the second, the first's states made: 8 x 553,984 +
    12 x 554,624 = 4,431,872 + 6,655,488 = 11,087,360 B; later: 8 x 1,108,608 +
    6 x 554,624 = 8,868,864 + 3,327,744 = 12,196,608 B."""
    assert zero3_step_bytes((1_108_608,), 2, first=True) == 13_303_296
    assert zero3_step_bytes((1_108_608,), 2, first=False) == 15_520_512
    assert zero3_step_bytes((553_984, 554_624), 2, first=True) == 11_087_360
    assert zero3_step_bytes((553_984, 554_624), 2, first=False) == 12_196_608


def test_zero3_gathers_by_hand() -> None:
    """The toy Llama (hidden 256, MLP 896, 8 heads of 32 with 2 key/value heads, vocabulary
    1000, 2 layers), bf16, each module gathered for its own run: in a layer the largest
    module is an MLP projection, 256 x 896 = 229,376 elements (q 65,536, k and v 16,384)
    = 458,752 B; the head 1000 x 256 = 256,000 elements = 512,000 B, the embedding the
    same. Registration order: embedding; per layer q, k, v, o, gate, up, down, two norms;
    final norm, head."""
    layer = (65_536, 16_384, 16_384, 65_536, 229_376, 229_376, 229_376, 256, 256)
    sizes = (256_000, *layer, *layer, 256, 256_000)
    assert tuple(zero3_gathers(sizes, 1, 2, 2)) == (458_752, 512_000, 512_000)
    # no head on the stage: nothing gathered for it
    assert zero3_gathers((256_000, *layer), 1, 0, 2).head == 0


def test_zero3_plain_gathers_estimated() -> None:
    """--zero 3 under the deepspeed preset with the coordinator gathering each module for its
    own run only (zero3_plain_gathers)."""
    est = api.estimate("llama-2-7b", gpus=8, zero=3, framework="deepspeed",
                       zero3_plain_gathers=True)
    # Llama-2-7B's states on 8 ranks: the bf16 partition and the kept gradient partition
    # 2 x 2P/8, the fp32 partition and Adam 12P/8 (P / 8 = 842,301,952)
    assert est.worst.params_bytes == 2 * 842_301_952


def test_zero3_states_against_deepspeeds_estimator() -> None:
    """estimate_zero3_model_states_mem_needs without offload: 4 B x the largest module's own
    parameters + int(18P / N). Its 18P/N is the bf16 partition (2), the fp32 gradient (4),
    the fp32 partition (4) and Adam (8): memplan's pieces give the same 18P/N for Llama-2-7B
    on 8 GPUs (P / 8 = 842,301,952: 15,161,435,136 B); the kept bf16 gradient partition
    (grad_partitions_flat_buffer, 2P/N = 1,684,603,904 B) is beyond it."""
    part = LLAMA_7B_PARAMS // 8
    st = zero3_states((part,), 0, 0, 2, 2)
    fp32_grad = 4 * part
    est = estimate_zero3(LLAMA_7B_PARAMS, 0, 8, 1, cpu_offload=False)
    assert st.weights + fp32_grad + st.master + st.states == est.gpu_bytes == 15_161_435_136
    assert st.gradients == 1_684_603_904


def test_stage1_reduce_by_hand() -> None:
    """The toy on 2 ranks, bucket 3e5, bf16, forward order (the flat buffer's): embedding
    256,000, per layer q 65,536, k and v 16,384, o 65,536, gate/up/down 229,376, norms 256;
    final norm 256; head 256,000 (P = 2,217,216, a multiple of 4: partitions of 1,108,608).
    Rank 0's partition covers the embedding to layer 1's q projection, which starts at
    1,108,480 < 1,108,608: 1,174,016 elements. The first reduce (q does not fit beside the
    embedding's 256,000) holds the embedding, rank 0's: there (2,217,216 - 256,000) whole
    gradients + the bucket 300,000 + 1,174,016 = 3,435,232 elements, 6,870,464 B. Rank 1's
    partition overlaps from layer 1's q on: 2,217,216 - 1,108,480 = 1,108,736 elements.
    Buckets: [embedding] (q does not fit), [q k v o] = 163,840 (gate does not fit), [gate],
    [up], [down, 2 norms, layer 1's q] = 295,424 (k does not fit): that reduce holds rank
    1's first parameter. Moved by then 256,000 + 163,840 + 3 x 229,376 + 512 + 65,536 =
    1,174,016; alive 1,043,200 + 300,000 + 1,108,736 = 2,451,936 elements, 4,903,872 B."""
    layer = (65_536, 16_384, 16_384, 65_536, 229_376, 229_376, 229_376, 256, 256)
    numels = (256_000, *layer, *layer, 256, 256_000)
    assert stage1_reduce_bytes(numels, 300_000, 2, 0, 2) == 6_870_464
    assert stage1_reduce_bytes(numels, 300_000, 2, 1, 2) == 4_903_872


def test_stage1_offload_reduce_by_hand() -> None:
    """ZeRO-1 with offload_optimizer, the toy on 2 ranks, rank 0, bf16, in the engine's order
    (per layer q, k, v, o, gate, up, down, then the two norms: transformers' registration).
    Bucket 3e5: the first reduce (q does not fit beside the embedding's 256,000) holds the
    embedding, all rank 0's: (2,217,216 - 256,000) whole gradients + the bucket 300,000 =
    2,261,216 elements, 4,522,432 B, and the embedding slice's fp64 copy 256,000 x 8 =
    2,048,000 B: 6,570,432 B (traced: 11,517,524 B with the weights 4,434,432, the host
    buffer's device twin 512,000 and 660 B of the loss and buffers). Bucket 1e5: the
    embedding is larger than the bucket: cloned (2,217,216 + 256,000 + 100,000 elements,
    5,146,432 B), then reduced alone at q with every gradient alive: (2,217,216 + 100,000) x 2
    + 2,048,000 = 6,682,432 B. Bucket 65,536: q still does not fit: (2,217,216 + 65,536) x 2
    + 2,048,000 = 6,613,504 B (traced 112,000 and 43,072 B above the 3e5 case)."""
    layer = (65_536, 16_384, 16_384, 65_536, 229_376, 229_376, 229_376, 256, 256)
    numels = (256_000, *layer, *layer, 256, 256_000)
    assert stage1_offload_reduce_bytes(numels, 300_000, 2, 0, 2) == 6_570_432
    assert stage1_offload_reduce_bytes(numels, 100_000, 2, 0, 2) == 6_682_432
    assert stage1_offload_reduce_bytes(numels, 65_536, 2, 0, 2) == 6_613_504


def test_stage1_offload_estimate() -> None:
    """ZeRO-1 with offload_optimizer on the device: the whole gradients through backward
    (P x 2 B, as without offload), no fp32 partition, state or gradient at the step (the host
    steps), the weights and the largest parameter's buffer (temp_grad_buffer_for_gpu_offload,
    the embedding's 131,072,000 x 2 B) in every phase; the host: stage 2's ZeRO-Offload
    host bytes for the same 1/8 partition."""
    kw = dict(gpus=8, framework="deepspeed", micro_batch_size=1, seq_len=2048)
    one = api.estimate("llama-7b", zero=1, offload="optimizer", **kw).stages[0]
    two = api.estimate("llama-7b", zero=2, offload="optimizer", **kw).stages[0]
    assert one.steady.optimizer == two.steady.optimizer
    assert one.host_bytes == two.host_bytes
    assert one.steady.backward > two.steady.backward


def test_stage1_estimate_by_hand() -> None:
    """Llama-2-7B on 8 GPUs, ZeRO-1, DeepSpeed's default bucket 5e8, in memplan's parameter
    order (embedding 131,072,000; per layer a norm 4,096, q k v o 16,777,216 each, a norm,
    gate up down 45,088,768 each): the reduce after backward in forward order fills the
    bucket with the embedding, layer 0 (202,383,360) and layer 1 up to its up projection
    (490,749,952 elements; the down projection would pass 5e8) and reduces: rank 0's
    partition is made there. The flat buffer, 6,738,415,616 elements, is a multiple of 16:
    partitions of 842,301,952; rank 0's overlaps up to layer 3's gate projection, which starts
    at 805,339,136 and ends at 850,427,904. Alive then: 6,738,415,616 - 490,749,952 =
    6,247,665,664 whole gradients + 5e8 + 850,427,904 = 7,598,093,568 elements, 15,196,187,136
    B, beside the bf16 weights 13,476,831,232 B and the fp32 partition 3,369,207,808 B (step
    1): 32,042,226,176 B; later steps add the states, 6,738,415,616 + 4 B. The step sees the
    partition alone: gradients P/8 x 2 B at the optimizer phase, as at stage 2."""
    est = api.estimate("llama-7b", gpus=8, zero=1, framework="deepspeed", micro_batch_size=1,
                       seq_len=2048).stages[0]
    assert est.first_step.backward == 13_476_831_232 + 3_369_207_808 + 15_196_187_136
    assert est.steady.backward == 32_042_226_176 + 6_738_415_616 + 4
    two = api.estimate("llama-7b", gpus=8, zero=2, framework="deepspeed", micro_batch_size=1,
                       seq_len=2048).stages[0]
    assert est.steady.optimizer == two.steady.optimizer


# --- ds_config.json as written --------------------------------------------------------------

def test_trainer_auto_bucket_is_hidden_squared() -> None:
    """reduce_bucket_size "auto": the Trainer fills hidden x hidden (transformers/integrations/
    deepspeed.py trainer_config_finalize): Llama-2-7B's 4096^2 = 16,777,216 elements; with
    overlap_comm two bf16 buckets: 16,777,216 x 2 x 2 = 67,108,864 B."""
    imp = deepspeed_config.read(DATA / "ds_config_zero2_hf.json", 8, "llama-7b")
    assert imp.inputs == {"framework": "deepspeed", "optimizer": "adamw", "zero": 2,
                          "zero_bucket_numel": 16_777_216, "zero_bucket_buffers": 2}
    line = next(m.line() for m in imp.mapping if m.target == "zero_bucket_numel")
    assert "auto: hidden x hidden = 4096 x 4096" in line
    assert any("bf16.enabled = auto" in n for n in imp.notes)
    est = api.estimate("llama-7b", gpus=8, **imp.inputs)
    assert est.stages[0].sharding_buffers_bytes == 67_108_864


def test_published_deberta_config_reads_as_written() -> None:
    """microsoft/deberta-v2-xxlarge-mnli's ds_config.json: fp16, stage 2, reduce bucket 5e7,
    overlap_comm and contiguous gradients (two buckets), allgather bucket 1.25e9 (no buffer)."""
    imp = deepspeed_config.read(DATA / "deberta_v2_xxlarge_mnli.json", 8, "llama-7b")
    assert imp.inputs == {"framework": "deepspeed", "precision": "fp16-mixed", "zero": 2,
                          "zero_bucket_numel": 50_000_000, "zero_bucket_buffers": 2}
    assert any("allgather_bucket_size" in n and "holds nothing" in n for n in imp.notes)


def test_zero3_hf_example_read_with_its_offload() -> None:
    """The Trainer's documented ZeRO-3 example offloads the optimizer and the parameters to the
    CPU: --offload optimizer,params at zero 3 (memplan.model.deepspeed_zero.zero3_offload);
    no optimizer state, gradient partition or bf16 partition on the device."""
    imp = deepspeed_config.read(DATA / "ds_config_zero3_hf.json", 8, "llama-7b")
    assert imp.inputs["offload"] == "optimizer,params" and imp.inputs["zero"] == 3
    est = api.estimate("llama-7b", gpus=8, **imp.inputs)
    s = est.stages[0]
    assert (s.params_bytes, s.grads_bytes, s.optimizer_bytes) == (0, 0, 0)
    # S = 6,738,415,616 / 8 = 842,301,952 (every tensor of Llama-7B divides by 8):
    # 18 B (fp32 partition 4, its gradient 4, Adam 8, bf16 gradient partition 2) + 2 B (the
    # bf16 partition) = 16,846,039,040 B on the host
    assert s.host_bytes == 842_301_952 * 20 == 16_846_039_040


@pytest.mark.parametrize(("offload", "why"), [
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "NVMe"),
    ({"offload_param": {"device": "cpu"}}, "without offload_optimizer"),
])
def test_zero3_offload_refused_where_not_traced(offload: dict, why: str) -> None:
    zero = {"stage": 3, **offload}
    with pytest.raises(MemplanError, match=why):
        deepspeed_config._zero(deepspeed_config.Imported(source="x", model=None), zero, 4096)


def test_zero3_offload_by_hand() -> None:
    """ZeRO-3 with offload_optimizer on the traced toy (2 ranks, bf16, S = 1,108,608 elements
    per rank: every tensor's ceil(numel / 2), all even): host 4 (fp32 partition) + 4 (its
    fp32 gradient, subgroup_gradient_buffer) + 8 (Adam) + 2 (grad_partitions_flat_buffer)
    = 18 B x S = 19,954,944 B (traced 19,954,948: AdamW's step count); the bf16 partition
    2,217,216 B on the device, or with offload_param on the host: 22,172,160 B (traced
    22,172,164)."""
    from memplan.model.deepspeed_zero import zero3_offload

    assert zero3_offload(1_108_608, False, 2, 2, 8) == (2_217_216, 19_954_944)
    assert zero3_offload(1_108_608, True, 2, 2, 8) == (0, 22_172_160)


# the toy's tensors in the order their gradient hooks run (the registration order reversed):
# head, final norm, per layer down, up, gate, norm, o, v, k, q, norm, then the embedding
_TOY_LAYER_BACKWARD = (229_376, 229_376, 229_376, 256, 65_536, 16_384, 16_384, 65_536, 256)
_TOY_HOOKS = (256_000, 256, *_TOY_LAYER_BACKWARD, *_TOY_LAYER_BACKWARD, 256_000)


def test_zero3_reduce_by_hand() -> None:
    """The bucket reduces of the toy at reduce_bucket_size 3e5, 2 ranks, bf16: [head, final
    norm] (256,256 elements; the down projection's 229,376 would pass 3e5), [down], [up],
    [gate, norm, o] (295,168), [v, k, q, norm, down of layer 0]... and [embedding] at the
    epilogue. The flat copy (reduce_scatter_coalesced) of [head, norm] is 2 x (128,000 + 128)
    x 2 B = 512,512 B (traced at the down projection's hook), of [gate, norm, o] 590,336 B,
    none for one tensor divisible by 2 ([down], [embedding]). With offload_optimizer each
    reduce adds its largest partition's device copy and fp64 copy, 10 B per element: the
    first reduce 512,512 + 128,000 x 10 = 1,792,512 B; of the later ones [gate, norm, o]
    590,336 + 114,688 x 10 = 1,737,216 B the most ([embedding] 1,280,000)."""
    from memplan.model.deepspeed_zero import zero3_reduce_bytes

    assert zero3_reduce_bytes(_TOY_HOOKS, 300_000, 2, 2, offload=False) == (512_512, 590_336)
    assert zero3_reduce_bytes(_TOY_HOOKS, 300_000, 2, 2, offload=True) == (1_792_512,
                                                                            1_737_216)
    # one tensor alone, divisible: reduced in place; odd: padded and copied
    assert zero3_reduce_bytes((1_000,), 300_000, 2, 2, offload=False) == (0, 0)
    assert zero3_reduce_bytes((1_001,), 300_000, 2, 2, offload=False) == (1_002 * 2, 0)


def test_zero3_auto_coordinator_values_resolved() -> None:
    """The same example without offload: "auto" as the Trainer fills it from hidden 4096:
    prefetch 0.9 x 4096^2 = 15,099,494 elements, persistence 10 x 4096 = 40,960; the live
    parameters and reuse distance as written (1e9)."""
    data = json.loads((DATA / "ds_config_zero3_hf.json").read_text())
    zero = {k: v for k, v in data["zero_optimization"].items() if not k.startswith("offload")}
    imp = deepspeed_config.Imported(source="x", model=None)
    deepspeed_config._zero(imp, zero, 4096)
    assert {k: v for k, v in imp.inputs.items() if k.startswith("zero3")} == {
        "zero3_prefetch_numel": 15_099_494, "zero3_max_live_numel": 1_000_000_000,
        "zero3_reuse_distance_numel": 1_000_000_000, "zero3_persistence_numel": 40_960}


def test_documented_offload_example_read() -> None:
    """The Trainer's ZeRO-2 offload example: offload_optimizer cpu is --offload optimizer
    (DeepSpeed's ZeRO-Offload); the same at stage 1 (traced, stage1_offload_reduce_bytes);
    to NVMe it is refused by name (not traced)."""
    imp = deepspeed_config.read(DATA / "ds_config_zero2_offload_hf.json", 8, "llama-7b")
    assert imp.inputs["offload"] == "optimizer" and imp.inputs["zero"] == 2
    api.estimate("llama-7b", gpus=8, **imp.inputs)
    data = json.loads((DATA / "ds_config_zero2_offload_hf.json").read_text())
    zero = data["zero_optimization"]
    one = deepspeed_config.Imported(source="x", model=None)
    deepspeed_config._zero(one, {**zero, "stage": 1}, 4096)
    assert one.inputs["offload"] == "optimizer" and one.inputs["zero"] == 1
    with pytest.raises(MemplanError, match=r"zero_optimization.offload_optimizer"):
        deepspeed_config._zero(deepspeed_config.Imported(source="x", model=None),
                               {**zero, "stage": 1, "offload_optimizer": {"device": "nvme"}},
                               4096)


def test_zero_offload_by_hand() -> None:
    """DeepSpeed's ZeRO-Offload on the traced toy (tests/traced/hf_configs.LLAMA3_TOY, 2 ranks,
    bf16; tensors embedding 256,000, per layer q/o 65,536, k/v 16,384, MLP 3 x 229,376, norms
    256, final norm 256, head 256,000: 2,217,216 elements). The last rank's partition is the
    flat buffer's second half, 1,108,608 elements, holding the whole head: its largest slice
    256,000 elements, an fp64 copy of 2,048,000 B at a reduce (traced). Host: fp32 partition,
    fp32 gradient, Adam (16 B) and a bf16 copy (2 B) of 1,108,608 elements, and a bf16 buffer of
    the largest parameter (512,000 B): 20,466,944 B (traced 20,466,952: the AdamW step count)."""
    from memplan.model.deepspeed_zero import estimate_zero2  # noqa: F401 (the module loads)
    from memplan.model.model_states import deepspeed_offload_host_bytes
    from memplan.model.optimizer import optimizer_policy
    from memplan.workload import Optimizer

    assert deepspeed_offload_host_bytes(1_108_608, 256_000, 2,
                                        optimizer_policy(Optimizer.ADAMW)) == 20_466_944


@pytest.mark.parametrize(("config", "key"), [
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}},
     "zero_optimization.zero_quantized_gradients"),
    ({"zero_optimization": {"stage": 2, "no_such_key": 1}}, "zero_optimization.no_such_key"),
    ({"zero_optimization": {"stage": 2}, "pipeline": {"stages": 2}}, "pipeline"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb"}}, "optimizer.type"),
    ({"zero_optimization": {"stage": 2},
      "activation_checkpointing": {"partition_activations": True}},
     "activation_checkpointing.partition_activations"),
    ({"zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "fp32"}},
     "data_types.grad_accum_dtype"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1.5}},
     "zero_optimization.reduce_bucket_size"),
    ({"bf16": {"enabled": True}}, "zero_optimization"),
])
def test_unsupported_keys_refused_by_name(tmp_path: Path, config: dict, key: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(MemplanError, match=key.replace(".", r"\.")):
        deepspeed_config.read(path, 8, "llama-7b")


def test_cli_prints_the_mapping_then_the_estimate() -> None:
    result = CliRunner().invoke(app, ["estimate", "-m", "llama-7b", "-n", "8",
                                      "--deepspeed-config", str(DATA / "ds_config_zero2_hf.json")])
    assert result.exit_code == 0, result.output
    assert "zero_optimization.reduce_bucket_size = 'auto' -> (reduce bucket elements) " \
           "16777216" in result.output
    assert "zero=2" in result.output


def test_cli_refusal_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "-m", "llama-7b", "-n", "8", "--deepspeed-config",
                 str(DATA / "ds_config_zero2_offload_nvme.json")])
    err = capsys.readouterr().err
    assert code == 2 and "zero_optimization.offload_optimizer" in err and err.count("\n") == 1


def test_cli_plan_takes_a_deepspeed_config() -> None:
    result = CliRunner().invoke(app, ["plan", "-m", "llama-7b", "-n", "8", "--top", "1",
                                      "--json", "--zero", "2", "--deepspeed-config",
                                      str(DATA / "ds_config_zero2_hf.json")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["candidates"]


def test_accumulation_gives_the_global_batch(tmp_path: Path) -> None:
    """train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 4 x 8 GPUs = 64
    sequences per step (DeepSpeed's train_batch_size); the estimate then holds two gradient
    partitions in a later micro-batch's backward."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 2}}))
    imp = deepspeed_config.read(path, 8, "llama-7b")
    assert imp.inputs["global_batch_size"] == 64 and imp.inputs["micro_batch_size"] == 2
    est = api.estimate("llama-7b", gpus=8, **imp.inputs)
    assert est.stages[0].grads_bytes == 2 * (LLAMA_7B_PARAMS // 8)


def test_diagnose_proposes_deepspeeds_bucket_levers() -> None:
    """Llama-2-7B on 8 V100s, ZeRO-2 under DeepSpeed's defaults (one 5e8-element bucket):
    diagnose re-estimates a hidden^2 = 16,777,216-element bucket (the Trainer's "auto"). The
    bucket shrinks by (5e8 - 16,777,216) x 2 B = 966,445,568 B, but the gradient partition
    (2 x 842,301,952 = 1,684,603,904 B) is then made at the head's backward (131,076,096 >
    16,777,216) instead of the second layer's: the re-estimated saving is what the estimate
    says, less than the bucket alone. With overlap_comm (two buckets) one bucket is proposed
    too: 5e8 x 2 B = 1e9 B off the backward peak (the analytic peak counts no allocator
    bytes)."""
    from memplan.diagnose import diagnose

    r = diagnose("llama-7b", gpus=8, zero=2, framework="deepspeed", gpu="v100-sxm2-32gb",
                 micro_batch_size=1, seq_len=2048)
    fix = next(f for f in r.fixes.ranked if "reduce bucket of hidden^2" in f.name)
    assert fix.change == {"zero_bucket_numel": 16_777_216}
    assert 0 < fix.saved_bytes < 966_445_568
    two = diagnose("llama-7b", gpus=8, zero=2, framework="deepspeed", gpu="v100-sxm2-32gb",
                   micro_batch_size=1, seq_len=2048, zero_bucket_buffers=2)
    one = next(f for f in two.fixes.ranked if "one reduce bucket" in f.name)
    # the bucket's 1e9 B
    assert one.saved_bytes == 1_000_000_000


def test_diagnose_proposes_stage_2_from_stage_1() -> None:
    """From DeepSpeed's ZeRO-1, diagnose re-estimates stage 2 (the gradients partitioned in
    backward: no whole gradients at the reduce after it, 15,196,187,136 B at stage 1 by
    test_stage1_estimate_by_hand), and stage 3 (the preset models it: DeepSpeed's default
    coordinator)."""
    from memplan.diagnose import diagnose

    r = diagnose("llama-7b", gpus=8, zero=1, framework="deepspeed", gpu="v100-sxm2-32gb",
                 micro_batch_size=1, seq_len=2048)
    names = {f.name: f for f in r.fixes.ranked}
    assert names["ZeRO stage 2"].change == {"zero": 2}
    assert names["ZeRO stage 2"].saved_bytes > 0
    assert names["ZeRO stage 3"].change == {"zero": 3}


def test_stage1_config_reads_and_overlap_is_refused(tmp_path: Path) -> None:
    """A stage-1 ds_config maps to --zero 1 with one bucket of reduce_bucket_size elements;
    with overlap_comm (two buckets) the preset refuses it by name, not traced at stage 1."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 1, "reduce_bucket_size": 2e8}}))
    imp = deepspeed_config.read(path, 8, "llama-7b")
    assert imp.inputs == {"framework": "deepspeed", "precision": "bf16-mixed", "zero": 1,
                          "zero_bucket_numel": 200_000_000, "zero_bucket_buffers": 1}
    api.estimate("llama-7b", gpus=8, **imp.inputs)
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 1, "overlap_comm": True}}))
    imp = deepspeed_config.read(path, 8, "llama-7b")
    with pytest.raises(MemplanError, match="--zero 1 with overlap_comm"):
        api.estimate("llama-7b", gpus=8, **imp.inputs)


def test_zero3_plain_config_read_and_estimated() -> None:
    """The ZeRO-3 example with the coordinator memplan models (tests/data/deepspeed/README.md):
    stage 3 with zero3_plain_gathers, reduce_bucket_size "auto" = hidden^2 = 4096^2 =
    16,777,216 elements in one bucket (overlap_comm true adds none at stage 3); the estimate
    holds Llama-2-7B's bf16 partition, 2P/8 = 2 x 842,301,952 B (P = 6,738,415,616)."""
    imp = deepspeed_config.read(DATA / "ds_config_zero3_plain.json", 8, "llama-2-7b")
    assert imp.inputs["zero"] == 3 and imp.inputs["zero3_plain_gathers"] is True
    assert imp.inputs["zero_bucket_numel"] == 16_777_216
    assert imp.inputs["zero_bucket_buffers"] == 1
    code = main(["estimate", "-m", "llama-2-7b", "--gpus", "8", "--deepspeed-config",
                 str(DATA / "ds_config_zero3_plain.json"), "--json"])
    assert code == 0


def test_zero3_absent_coordinator_keys_read_as_defaults() -> None:
    """A stage 3 table leaving the prefetch bucket out reads DeepSpeed's default, 5e7, and is
    no longer the plain coordinator."""
    data = json.loads((DATA / "ds_config_zero3_plain.json").read_text())
    del data["zero_optimization"]["stage3_prefetch_bucket_size"]
    imp = deepspeed_config.Imported(source="x", model=None)
    deepspeed_config._zero(imp, data["zero_optimization"], 4096)
    assert imp.inputs["zero3_prefetch_numel"] == 50_000_000
    assert "zero3_plain_gathers" not in imp.inputs


def test_zero3_reduces_placed_by_hook() -> None:
    """Where the toy's reduces fall (bucket 3e5, 2 ranks, bf16), each layer's hooks in
    backward order (down, up, gate, norm, o, v, k, q, norm): [head, norm] at the last layer's
    down projection (512,512 B, the first); [down] at up and [up] at gate (one divisible
    tensor: none); [gate, norm, o] at v (295,168 elements: 590,336 B); [v, k, q, norm] at the
    next layer's down (98,560: 197,120 B) and at the embedding's hook after the first layer
    (the end), [embedding] at the epilogue (none). With offload_optimizer + 10 B x each
    bucket's largest partition: 128,000 (head), 114,688 (an MLP weight), 32,768 (q)."""
    from memplan.model.deepspeed_zero import zero3_reduces_at

    layer = _TOY_LAYER_BACKWARD
    at = zero3_reduces_at((256_000, 256), (layer, layer), (256_000,), 300_000, 2, 2, False)
    assert at == (0, 0, 512_512, (197_120, 0, 0, 0, 0, 590_336, 0, 0, 0), 197_120, 0)
    at = zero3_reduces_at((256_000, 256), (layer, layer), (256_000,), 300_000, 2, 2, True)
    assert at == (0, 0, 1_792_512,
                  (524_800, 1_146_880, 1_146_880, 0, 0, 1_737_216, 0, 0, 0), 1_280_000, 0)


def test_hook_moments_of_a_llama_layer() -> None:
    """A Llama layer's backward moments (memplan.model.mlp / attention: the down projection's,
    the activation's, the gate and up projections', the norm's, attention's, the q/k/v/o
    projections', the norm's; fresh gradients at the three projection moments): the down
    projection's hook runs at its moment; up's at the input projections' (its weight, 229,376
    elements, is that moment's fresh one), gate's and the norm's there too; o's at the
    attention projections' (65,536), v, k, q and the norm's there too."""
    from memplan.model.layer import LayerMoment
    from memplan.model.sharding import hook_moments

    moments = tuple(LayerMoment(name, 0, 0, (), fresh) for name, fresh in (
        ("mlp", 229_376), ("mlp_act", 0), ("mlp_in", 229_376), ("mlp_norm", 0),
        ("attention.0", 0), ("attn_in", 65_536), ("attn_norm", 0)))
    assert hook_moments(moments, _TOY_LAYER_BACKWARD) == (0, 2, 2, 2, 5, 5, 5, 5, 5)
    # a layer whose weights match no moment: every hook at the first with a fresh gradient
    assert hook_moments(moments, (7, 7)) == (0, 0)


def test_zero2_offload_reduces_by_hand() -> None:
    """ZeRO-Offload at stage 2 on the toy, 2 ranks, bucket 3e5, memplan's order (per layer
    norm, q, k, v, o, norm, gate, up, down: 852,480 elements; layer 0 from 256,000, layer 1 from
    1,108,480, the final norm at 1,960,960, the head at 1,961,216); the last rank owns
    [1,108,608, 2,217,216). Hooks in backward order: [head, final norm] (256,256) is reduced at
    layer 1's down projection's hook (hook 0 of the first layer in backward): the head's
    256,000-element slice, 8 B each, 2,048,000 B. Later: [down] at the up projection's hook
    and [up] at the gate's, 229,376 x 8 = 1,835,008 B each; [gate, norm, o] at v's (hook 5),
    the gate's 1,835,008; [v, k, q, norm] at layer 0's down hook (hook 0), q's 65,536 x 8 =
    524,288 B; layer 0 and the embedding are rank 0's (nothing owned), so 0 at the end."""
    from memplan.model.deepspeed_zero import zero2_offload_reduces_at

    layer = (256, 65_536, 16_384, 16_384, 65_536, 256, 229_376, 229_376, 229_376)
    sizes = (256_000, *layer, *layer, 256, 256_000)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    items = tuple(zip(starts, sizes))
    layers = (tuple(reversed(items[10:19])), tuple(reversed(items[1:10])))
    at = zero2_offload_reduces_at(tuple(reversed(items[19:])), layers, (items[0],), 300_000,
                                  1_108_608, 2_217_216, 2)
    assert (at.first_layer, at.first_hook, at.first, at.kept) == (0, 0, 2_048_000, 0)
    assert at.later == (524_288, 1_835_008, 1_835_008, 0, 0, 1_835_008, 0, 0, 0)
    assert at.end == 0


def test_zero2_offload_reduces_bucket_smaller_than_a_weight() -> None:
    """The same toy and rank with a bucket of 1e5 elements, smaller than the head (256,000)
    and the MLP weights (229,376): each is cloned in its hook, counted in the bucket's
    elements, and reduced alone at the next hook (stage_1_and_2.py reduce_independent_p_g_
    buckets_and_remove_grads -> reduce_ipg_grads: extra_large_param_to_reduce). [head] at the
    final norm's hook (the head's hooks: first_layer -1), its owned slice 256,000 x 8 B =
    2,048,000 B, its clone (kept) 256,000 x 2 B = 512,000 B beside it; in the last layer
    [final norm] at down's hook (256 x 8 = 2,048), [down] at up's, [up] at gate's, [gate] at
    the norm's (1,835,008 each), [norm, o, v, k] (98,560 elements) at q's (o's 65,536 x 8 =
    524,288); in layer 0 [q, norm] at down's (q's: 524,288), the larger of hook 0; nothing of
    layer 0 or the embedding owned (traced: tests/traced/test_deepspeed_trace.py, every
    reduce's fp64 copy at these hooks)."""
    from memplan.model.deepspeed_zero import zero2_offload_reduces_at

    layer = (256, 65_536, 16_384, 16_384, 65_536, 256, 229_376, 229_376, 229_376)
    sizes = (256_000, *layer, *layer, 256, 256_000)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    items = tuple(zip(starts, sizes))
    layers = (tuple(reversed(items[10:19])), tuple(reversed(items[1:10])))
    at = zero2_offload_reduces_at(tuple(reversed(items[19:])), layers, (items[0],), 100_000,
                                  1_108_608, 2_217_216, 2)
    assert (at.first_layer, at.first_hook, at.first, at.kept) == (-1, 0, 2_048_000, 512_000)
    assert at.later == (524_288, 1_835_008, 1_835_008, 1_835_008, 0, 0, 0, 524_288, 0)
    assert at.end == 0


def test_final_norm_hook_by_hand() -> None:
    """The toy's final norm (transformers' RMSNorm, bf16, 64 rows, h 256) at its weight's
    gradient hook: its fp32 input (64 x 256 x 4 = 65,536 B) and rstd (64 x 4 = 256 B) still
    saved, the gradient of its normalised input (64 x 256 x 2 = 32,768 B) and its weight's
    (256 x 2 = 512 B): 99,072 B (traced at that hook under ZeRO-Offload: 98,704 B beside
    what the layers saved, 368 B less)."""
    from memplan.model.dims import Dims
    from memplan.model.head import final_norm_hook
    from memplan.spec import ModelSpec

    spec = ModelSpec(name="toy", source="test", num_layers=2, hidden_size=256,
                     ffn_hidden_size=896, num_attention_heads=4, num_kv_heads=1, head_dim=64,
                     vocab_size=1000, max_seq_len=64, norm="rmsnorm", mlp="swiglu",
                     position="rope", tied_embeddings=False)
    dm = Dims(b=1, s=64, s_kv=64, tokens=64, res_tokens_div=1, tp=1, e=2, vocab_shard=1000,
              stream_e=2)
    assert final_norm_hook(spec, dm, 65_792) == 99_072


# --- peft's LoRA under DeepSpeed ----------------------------------------------------------------

# Llama-2-7B's adapters at rank 8 on every projection (peft's all-linear; h 4,096, MLP 11,008,
# 32 layers): q, k, v, o 8 x (4,096 + 4,096) = 65,536 each; gate, up, down 8 x (4,096 +
# 11,008) = 120,832 each: 624,640 a layer, 19,988,480 in all; on 8 ranks 2,498,560 each (every
# lora_A and lora_B divides by 8: 32,768, 88,064 elements)
_LORA_7B = dict(gpus=8, framework="deepspeed", lora_rank=8, lora_targets="all-linear")


@pytest.mark.parametrize("zero", [2, 3])
def test_lora_states_by_hand(zero: int) -> None:
    """DeepSpeed casts peft's fp32 adapters to bf16 (engine.py _cast_module_mixed_precision)
    and the Trainer's optimizer holds them alone (requires_grad only), so the ZeRO optimizer's
    partitions are the adapters': bf16 gradient partition 2,498,560 x 2 = 4,997,120 B; fp32
    partition 9,994,240 B and Adam 19,988,480 B, with the fused AdamW's step count (4 B):
    29,982,724 B. Weights: ZeRO-2 keeps the frozen base whole (6,738,415,616 x 2 =
    13,476,831,232 B) and the adapters whole (19,988,480 x 2 = 39,976,960 B):
    13,516,808,192 B; ZeRO-3 partitions both (parameter_offload.py
    _convert_to_zero_parameters: every module parameter): 842,301,952 x 2 + 4,997,120 =
    1,689,601,024 B."""
    extra = {"zero3_plain_gathers": True} if zero == 3 else {}
    w = api.estimate("llama-2-7b", zero=zero, **_LORA_7B, **extra).worst
    assert w.grads_bytes == 4_997_120
    assert w.optimizer_bytes == 29_982_724
    assert w.params_bytes == {2: 13_516_808_192, 3: 1_689_601_024}[zero]


def test_lora_adapters_in_the_models_dtype() -> None:
    """The deepspeed preset sets adapters_in_model_dtype (engine.py's cast): an adapter
    element is 2 B under bf16-mixed; the hf preset keeps peft's fp32 adapters (4 B)."""
    from memplan.model.adapters import adapter_bytes, adapters_of

    ds = api.resolve(api.load_model("llama-2-7b"), gpus=8, zero=2, framework="deepspeed",
                     lora_rank=8)[2]
    hf = api.resolve(api.load_model("llama-2-7b"), gpus=8, zero=2, framework="hf",
                     lora_rank=8)[2]
    assert ds.adapters_in_model_dtype and not hf.adapters_in_model_dtype
    assert adapter_bytes(ds) == adapters_of(ds).weight_bytes == 2
    assert adapter_bytes(hf) == adapters_of(hf).weight_bytes == 4


@pytest.mark.parametrize(("extra", "match"), [
    (dict(zero=3, zero3_plain_gathers=True, base_quant="nf4"), "quantized base"),
    (dict(zero=2, lora_targets="all-linear,output"), "output projection"),
    (dict(zero=1), "stage 1"),
    (dict(zero=2, offload="optimizer"), "offload"),
    (dict(zero=3, zero3_plain_gathers=True, zero_bucket_numel=1_000_000),
     "exceed the reduce bucket"),
    (dict(zero=2, optimizer="adamw8bit"), "optimizer other than AdamW"),
])
def test_lora_refusals(extra: dict, match: str) -> None:
    """What of LoRA under DeepSpeed is not traced is refused with one line naming it: a
    quantized base, the head's adapter, stage 1, offload, adapters beyond one reduce bucket
    at stage 3 (19,988,480 elements of gradients > 1e6), and an optimizer other than
    AdamW."""
    args = {**_LORA_7B, **extra}
    with pytest.raises(MemplanError, match=match):
        api.estimate("llama-2-7b", **args)
