"""LoRA and QLoRA under ZeRO-3 / FSDP2 (``memplan.model.model_states``): the sharded weights,
the gathered units, the unsharded gradients and ``CPUOffloadPolicy``, derived by hand.

QLoRA 70B as FSDP-QLoRA runs it: Llama-2-70B (hidden 8,192, 80 layers, FFN 28,672, 8 KV heads
of 128, vocabulary 32,000, untied head) on 2 GPUs, zero 3, bf16, LoRA rank 8 on every linear,
NF4 base. Per layer:

- linears: q, o 8,192 x 8,192 = 67,108,864 each; k, v 8,192 x 1,024 = 8,388,608 each;
  gate, up, down 8,192 x 28,672 = 234,881,024 each: 855,638,016 elements; norms 2 x 8,192;
- NF4 data (two weights a byte): 427,819,008 B; its quant_state per weight: a uint8 absmax per
  64 elements, an fp32 absmax per 256 of those, an fp32 offset and the 16-entry fp32 code:
  q, o 1,048,576 + 4,096 x 4 + 68 = 1,065,028; k, v 131,072 + 512 x 4 + 68 = 133,188;
  gate, up, down 3,670,016 + 14,336 x 4 + 68 = 3,727,428: 13,578,716 B;
- adapters r x (d_in + d_out): q, o 131,072; k, v 73,728; gate, up, down 294,912:
  1,294,336 elements (fp32).

The root: embedding and head 32,000 x 8,192 = 262,144,000 each, final norm 8,192.
"""

from __future__ import annotations

import memplan

LAYERS = 80
ROOT = 2 * 262_144_000 + 8_192  # 524,296,192 elements, bf16
NORMS = 2 * 8_192
NF4_DATA = 427_819_008
QUANT_STATE = 13_578_716
ADAPTERS = 1_294_336
QLORA_70B = dict(gpus=2, zero=3, precision="bf16-pure", recompute="full", lora_rank=8,
                 lora_targets="all-linear", base_quant="nf4", micro_batch_size=2,
                 seq_len=2048, global_batch_size=8)


def test_qlora_70b_sharded_weights() -> None:
    """Each of 2 ranks holds half of the bf16 weights that are not quantized (root and norms:
    (524,296,192 + 80 x 16,384) / 2 x 2 B = 525,606,912), half of the NF4 data
    (80 x 427,819,008 / 2 = 17,112,760,320), half of the fp32 adapters
    (80 x 1,294,336 / 2 x 4 = 207,093,760), and the whole quant_state, no parameter FSDP
    shards (80 x 13,578,716 = 1,086,297,280): 18,931,758,272 B. Gradients: the adapters'
    shard in fp32, 207,093,760; AdamW's two fp32 states, 414,187,520."""
    w = memplan.estimate("llama-2-70b", **QLORA_70B).worst
    unquantized = (ROOT + LAYERS * NORMS) // 2 * 2
    assert unquantized == 525_606_912
    assert w.params_bytes == (unquantized + LAYERS * NF4_DATA // 2
                              + LAYERS * ADAPTERS // 2 * 4 + LAYERS * QUANT_STATE)
    assert w.params_bytes == 18_931_758_272
    assert w.grads_bytes == LAYERS * ADAPTERS // 2 * 4 == 207_093_760
    assert w.optimizer_bytes == LAYERS * ADAPTERS // 2 * 8 == 414_187_520


def test_qlora_70b_gathered_units() -> None:
    """A decoder-layer unit gathers what its parameters store: its norms in bf16 (32,768),
    the NF4 data (427,819,008) and the fp32 adapters (5,177,344): 433,029,120 B; the root
    1,048,592,384. Beside a block in forward the root and two units: 1,914,650,624; a unit's
    unsharded gradients before their reduce-scatter are the adapters' alone, fp32: 5,177,344.
    ``sharding_buffers_bytes`` is their sum, 1,919,827,968."""
    w = memplan.estimate("llama-2-70b", **QLORA_70B).worst
    unit = NORMS * 2 + NF4_DATA + ADAPTERS * 4
    assert unit == 433_029_120
    assert w.sharding_buffers_bytes == ROOT * 2 + 2 * unit + ADAPTERS * 4 == 1_919_827_968


def test_lora_bf16_units_without_quantization() -> None:
    """LoRA on a bf16 base (no quantization), the same model: a unit gathers the layer's
    855,654,400 bf16 elements (1,711,308,800 B) and the fp32 adapters (5,177,344):
    1,716,486,144; with the root 1,048,592,384, two units and the adapters' unsharded
    gradients: 4,486,742,016. The weights: (524,296,192 + 80 x 855,654,400) / 2 x 2 B
    = 68,976,648,192 and the adapters' shard 207,093,760: 69,183,741,952."""
    opts = dict(QLORA_70B, base_quant="none")
    w = memplan.estimate("llama-2-70b", **opts).worst
    unit = (855_638_016 + NORMS) * 2 + ADAPTERS * 4
    assert unit == 1_716_486_144
    assert w.sharding_buffers_bytes == ROOT * 2 + 2 * unit + ADAPTERS * 4 == 4_486_742_016
    assert w.params_bytes == (ROOT + LAYERS * 855_654_400) // 2 * 2 + 207_093_760
    assert w.params_bytes == 69_183_741_952


def test_qlora_70b_cpu_offload_policy() -> None:
    """``--offload params`` (FSDP2's CPUOffloadPolicy moves the sharded parameters): the host
    holds the bf16 shards (525,606,912), the NF4 data's (17,112,760,320), the adapters'
    (207,093,760), their fp32 gradients (207,093,760) and AdamW states (414,187,520) and a
    step count per adapter tensor (80 x 7 x 2 x 4 B = 4,480): 18,466,746,752. The quant_state
    is no parameter: it stays on the GPU, 1,086,297,280."""
    w = memplan.estimate("llama-2-70b", offload="params", **QLORA_70B).worst
    assert w.params_bytes == LAYERS * QUANT_STATE == 1_086_297_280
    assert w.grads_bytes == w.optimizer_bytes == 0
    assert w.host_bytes == (525_606_912 + 17_112_760_320 + 207_093_760 + 207_093_760
                            + 414_187_520 + LAYERS * 7 * 2 * 4) == 18_466_746_752


def test_one_rank_unchanged() -> None:
    """Without ZeRO-3 nothing is sharded: the whole stored base (root and norms in bf16,
    NF4 data and state) and the adapters, as before sharding was modelled:
    (524,296,192 + 80 x 16,384) x 2 = 1,051,213,824, then 34,225,520,640, 1,086,297,280 and
    414,187,520: 36,777,219,264."""
    opts = dict(QLORA_70B, gpus=1, zero=0, global_batch_size=4)
    w = memplan.estimate("llama-2-70b", **opts).worst
    assert w.params_bytes == ((ROOT + LAYERS * NORMS) * 2 + LAYERS * NF4_DATA
                              + LAYERS * QUANT_STATE + LAYERS * ADAPTERS * 4)
    assert w.params_bytes == 36_777_219_264


def test_qlora_70b_zero2_reduce_bucket() -> None:
    """ZeRO-2 on 2 ranks: the reduce bucket holds at most the gradients this rank does not
    own, and only the adapters make gradients: 80 x 1,294,336 = 103,546,880 elements, half
    not owned, 51,773,440 (under the 5e8-element bucket), in fp32: 207,093,760 B. The weights
    stay whole (no ZeRO-3): the one-rank bytes of ``test_one_rank_unchanged``."""
    w = memplan.estimate("llama-2-70b", **dict(QLORA_70B, zero=2)).worst
    assert w.sharding_buffers_bytes == LAYERS * ADAPTERS // 2 * 4 == 207_093_760
    assert w.params_bytes == 36_777_219_264
