"""FSDP1 (``fsdp_version`` 1, ``memplan.model.fsdp1``): each moment's bytes derived by hand.

The stage: two decoder layers of L = 1,001 elements, an embedding of 300 and a head (with its
final norm) of 301, on a data-parallel group of 4 (``--zero 3``: FULL_SHARD).

- A unit's shard is ceil(1001 / 4) = 251 elements, its padded unsharded flat parameter
  251 x 4 = 1,004 elements (``FlatParamHandle._get_shard`` pads the last ranks' chunks); the
  root's 601 elements pad to 151 x 4 = 604.
- ``fsdp-bf16`` (MixedPrecision(param_dtype=bf16, reduce_dtype=fp32), fp32 weights): gathered
  in bf16, a layer 1,004 x 2 = 2,008 B, the root 604 x 2 = 1,208 B; the low-precision shard
  (``_mp_shard``) 251 x 2 = 502 B; a unit's unsharded gradient before its reduce 1,001 x 4 =
  4,004 B in the reduce dtype.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from typer.testing import CliRunner

from memplan.api import make_layout, make_workload
from memplan.cli import app, main
from memplan.errors import MemplanError
from memplan.model.fsdp1 import fsdp1_buffers, last_reduce, lazy_init, padded
from memplan.model.grad_sync import accumulator_bytes
from memplan.model.model_states import StageParams
from memplan.model.trainable import TrainablePolicy
from memplan.model.sharding import DataParallel, Held, flat_reduce, run_positions
from memplan.spec import load_model

TINY = load_model("tiny")
L, EMB, HEAD = 1001, 300, 301
PARAMS = StageParams(dense=2 * L + EMB + HEAD, expert=0, layers=(L, L), embedding=EMB, head=HEAD,
                     tensor_sizes=(), largest_unit=L, num_tensors=0)


def _buffers(dp: int = 4, **fields):
    return fsdp1_buffers(PARAMS, make_layout(dp, zero=3),
                         make_workload(TINY, fsdp_version=1, **fields))


def test_padding_rounds_up_to_a_multiple_of_the_world_size() -> None:
    """1,001 over 4 ranks: 251 each, 1,004 gathered; 1,000 divides: no padding."""
    assert padded(1001, 4) == 1004 and padded(1000, 4) == 1000 and padded(601, 4) == 604


def test_full_shard_with_backward_pre() -> None:
    """torch's default BACKWARD_PRE, no forward prefetch, fsdp-bf16:

    - forward: the root and one block, 1,208 + 2,008 = 3,216 B; at the loss the root alone,
      1,208; at a block's gather its low-precision shard too, 3,216 + 502 = 3,718;
    - backward: the root and two blocks (the running one and the one prefetched),
      1,208 + 2 x 2,008 = 5,224; at the head the root and the last block it prefetches,
      3,216; the stage's first block prefetches nothing, 3,216; at the embedding, 1,208;
      at a block's reduce its weights freed, the prefetched one still gathered, 3,216;
    - the first forward's lazy init: the largest padded flat parameter in fp32 (the
      full-precision copy ``_full_prec_full_param_padded``), 1,004 x 4 = 4,016."""
    b = _buffers(precision="fsdp-bf16")
    assert (b.gathered_bytes, b.gathered_at_loss_bytes, b.grad_bytes) == (3216, 1208, 4004)
    assert (b.forward_start_bytes, b.forward_first_start_bytes) == (3718, 3718)
    assert (b.backward_block_bytes, b.backward_head_bytes, b.backward_last_block_bytes,
            b.backward_end_bytes, b.backward_reduce_bytes) == (5224, 3216, 3216, 1208, 3216)
    assert b.lazy_init_bytes == 4016 and b.flat_units and not b.window_units


@pytest.mark.parametrize(("prefetch", "block", "head", "reduce"),
                         [("none", 3216, 1208, 1208), ("post", 3216, 1208, 3216)])
def test_backward_prefetch_none_and_post(prefetch: str, block: int, head: int,
                                         reduce: int) -> None:
    """Without BACKWARD_PRE one block runs its backward gathered (1,208 + 2,008 = 3,216) and
    the root's hook at the loss gathers nothing more (1,208); BACKWARD_POST gathers the next
    block in the post-backward hook before the reduce (3,216 at the reduce), none does not
    (the root alone, 1,208)."""
    b = _buffers(precision="fsdp-bf16", backward_prefetch=prefetch)
    assert (b.backward_block_bytes, b.backward_head_bytes, b.backward_reduce_bytes) == (
        block, head, reduce)


def test_fp32_has_no_low_precision_shard() -> None:
    """fp32 weights gathered in fp32: 604 x 4 + 1,004 x 4 = 6,432 B beside a block, no
    ``_mp_shard`` (no start moment above it), lazy init 1,004 x 4 = 4,016."""
    b = _buffers(precision="fp32")
    assert (b.gathered_bytes, b.forward_start_bytes, b.lazy_init_bytes) == (6432, 0, 4016)


def test_lazy_init_takes_the_largest_unit_in_the_wider_dtype() -> None:
    """A root of 5,000 elements over 4 ranks outweighs the layers: 5,000 x 4 B = 20,000."""
    params = PARAMS._replace(embedding=2500, head=2500)
    assert lazy_init(params, 4, 4, 2) == 20000 and lazy_init(params, 4, 2, 2) == 10000


def test_flat_reduce() -> None:
    """A unit whose held (fp32) shard is 1,000 B over 4 ranks: 1,000 elements, unsharded in
    bf16 (2,000 B). Reduced in fp32: its fp32 copy 4,000 B and the output shard 1,000 B;
    in one dtype (fp32 weights and reduce) the gradient is the input itself: the shard alone."""
    mixed = DataParallel(flat=True, unsharded_ratio=4, unsharded_dtype=Fraction(1, 2))
    assert flat_reduce(mixed, 1000) == 5000
    assert flat_reduce(mixed._replace(unsharded_dtype=1), 1000) == 1000


def test_flat_positions_after_each_block() -> None:
    """Three blocks of 1,000 held bytes each (above), ending with the stage's first block; the
    gradient of a block's input 100 B. Beside the other blocks' backward the root and two
    blocks (5,224); after each, the larger of
    - the flat gradient made: the views' gradients and their concatenation, 2 x 2,000, with
      the blocks still gathered, 4,000 + 5,224 = 9,224;
    - the reduce: 2,000 + 5,000 (``flat_reduce``) + 3,216 gathered = 10,216;
    plus the input's gradient: 10,316. The stage's first block: 3,216 gathered beside its
    backward; 4,000 + 3,216 = 7,216 against 2,000 + 5,000 + 1,208 (the root alone) = 8,208:
    8,308. No reduce-scatter input is carried to the next block."""
    dp = DataParallel(flat=True, per_unit=True, unsharded_ratio=4,
                      unsharded_dtype=Fraction(1, 2), in_block=5224, in_first_block=3216,
                      at_embedding=1208, at_reduce=3216, boundary_grad=100)
    positions, held = run_positions(dp, Held(0, 0, 0, 0), 1000, 1000, 3, True, True)
    assert [(p.repeat, p.beside, p.after.transient) for p in positions] == [
        (2, 5224, 10316), (1, 3216, 8308)]
    assert held.prev_input == 0 and held.made == 3000


def test_unsynced_blocks_make_their_flat_gradient_beside_the_accumulators() -> None:
    """Under no_sync() a block of 2,000 accumulator bytes (bf16) makes its views' gradients
    and their concatenation, 2 x 2,000, beside the blocks gathered (5,224) and its input's
    gradient (100): 9,324; nothing reduced."""
    dp = DataParallel(flat=True, in_block=5224, in_first_block=3216, boundary_grad=100)
    positions, _ = run_positions(dp, Held(0, 0, 0, 0), 2000, 2000, 2, False, False)
    assert [(p.repeat, p.beside, p.after.transient) for p in positions] == [(2, 5224, 9324)]


def test_no_sync_accumulators_and_the_last_reduce() -> None:
    """FSDP1's accumulators are the flat gradients in the gathered dtype: fsdp-bf16, 2,603
    elements x 2 B = 5,206 (FSDP2's, in the reduce dtype, would be 10,412). At the last
    micro-batch's reduce of a 1,001-element unit (4,004 B in fp32, over 4 ranks its shard
    1,001 B): the fp32
    copy 4,004, the shard 1,001 and the incoming bf16 flat gradient 2,002 = 7,007 made, the
    bf16 accumulator 2,002 dropped; fp32: no copy, 1,001 + 4,004 = 5,005, 4,004 dropped."""
    assert accumulator_bytes(PARAMS, make_workload(TINY, fsdp_version=1,
                                                   precision="fsdp-bf16"), True) == 5206
    assert accumulator_bytes(PARAMS, make_workload(TINY, precision="fsdp-bf16")) == 10412
    flat = DataParallel(flat=True, unsharded_ratio=4)
    assert last_reduce(flat, 4004, make_workload(TINY, fsdp_version=1,
                                                 precision="fsdp-bf16")) == (7007, 1001, 2002)
    assert last_reduce(flat, 4004, make_workload(TINY, fsdp_version=1,
                                                 precision="fp32")) == (5005, 1001, 4004)
    # FSDP2: its reduce-dtype input replaces the accumulator
    assert last_reduce(flat._replace(flat=False), 4004,
                       make_workload(TINY, precision="fsdp-bf16")) == (4004, 1001, 0)


def test_fsdp1_changes_only_zero_3_with_data_parallelism() -> None:
    """At zero 2 or one rank FSDP1's buffers are not used: the estimate is FSDP2's / ZeRO's."""
    from memplan.api import estimate

    for layout in (dict(gpus=2, zero=2), dict(gpus=1, zero=3)):
        one = estimate("tiny", **layout, fsdp_version=1, seq_len=64)
        two = estimate("tiny", **layout, fsdp_version=2, seq_len=64)
        assert one.peak_bytes == two.peak_bytes


def test_forward_prefetch_is_refused_by_name() -> None:
    from memplan.api import estimate

    with pytest.raises(MemplanError, match="forward_prefetch"):
        estimate("tiny", gpus=4, zero=3, fsdp_version=1, seq_len=64, forward_prefetch=True)


@pytest.mark.parametrize(("option", "named"), [
    (dict(gpus=8, tp=2), "tp, pp, cp or ep > 1"),
    (dict(offload="params", precision="fsdp-bf16"), "offload params"),
    (dict(lora_rank=8, base_quant="int8"), "LoRA with a quantized base other than nf4"),
    (dict(lora_rank=8, base_quant="nf4", precision="fp32"), "nf4 base under precision fp32")])
def test_where_fsdp1_is_not_modelled_fsdp2_stands_for_it_and_says_so(option: dict,
                                                                    named: str) -> None:
    from memplan.api import estimate

    layout = {"gpus": 4, **option}
    one = estimate("tiny", zero=3, fsdp_version=1, seq_len=64, **layout)
    two = estimate("tiny", zero=3, fsdp_version=2, seq_len=64, **layout)
    assert one.peak_bytes == two.peak_bytes
    assert any(named in line and "FSDP2's units stand for" in line for line in one.assumptions)


def test_cli_fsdp_version_and_the_hf_default() -> None:
    """--framework hf runs FSDP1 without backward prefetch (Accelerate's defaults), printed
    with their sources; --fsdp-version 2 and --fsdp-backward-prefetch override them."""
    runner = CliRunner()
    out = runner.invoke(app, ["estimate", "-m", "tiny", "-n", "4", "--zero", "3", "--seq",
                              "64", "--framework", "hf", "--json"])
    assert out.exit_code == 0, out.output
    assert "fsdp_version = 1" in out.output and "backward_prefetch = none" in out.output
    two = runner.invoke(app, ["estimate", "-m", "tiny", "-n", "4", "--zero", "3", "--seq", "64",
                              "--framework", "hf", "--fsdp-version", "2", "--json"])
    assert two.exit_code == 0 and "fsdp_version = 1" not in two.output
    assert main(["estimate", "-m", "tiny", "-n", "4", "--fsdp-version", "3"]) == 2


def test_use_orig_params_keeps_the_gradients_to_the_next_forward() -> None:
    """With use_orig_params the step's sharded gradients are alive at the next forward's
    start: from step 2 that moment is the weights, the optimizer states and the gradients.
    tiny over 2 ranks, fp32: 2 x 46,208 + 16,448 = 108,864 parameters, 54,432 per rank:
    217,728 B of weights, 217,728 of gradients, 435,456 of AdamW states: 870,912 B. In step 1
    the start holds the lazy init instead."""
    from memplan.api import estimate
    from memplan.model.model_states import ShardingBuffers

    b = ShardingBuffers(0, 0, 0, grads_to_forward=True, lazy_init_bytes=7)
    assert (b.forward_start(True, 217728), b.forward_start(False, 217728)) == (217728, 7)
    assert ShardingBuffers(0, 0, 0).forward_start(True, 217728) == 0
    kw = dict(gpus=2, zero=3, fsdp_version=1, seq_len=8, precision="fp32")
    orig = estimate("tiny", use_orig_params=True, **kw).stages[0]
    plain = estimate("tiny", use_orig_params=False, **kw).stages[0]
    assert orig.steady.forward == max(plain.steady.forward, 870912)
    assert orig.first_step.forward == plain.first_step.forward


def test_shard_grad_op_keeps_each_block_from_its_forward_to_its_post_backward() -> None:
    """SHARD_GRAD_OP (``reshard_after_forward`` False), fsdp-bf16 over 4 ranks (above): at a
    block's gather the root, the block and its low-precision shard, 1,208 + 2,008 + 502 =
    3,718, after which the block's 2,008 B stay alive (``kept_layer_bytes``); beside a block's
    compute the root alone, 1,208; at the head both blocks kept and the root, 1,208 + 2 x
    2,008 = 5,224; a backward prefetch finds them gathered: the root alone beside a block's
    backward and at its reduce."""
    b = _buffers(precision="fsdp-bf16", reshard_after_forward=False)
    assert (b.forward_start_bytes, b.kept_layer_bytes, b.kept_layers_bytes) == (3718, 2008, 4016)
    assert (b.gathered_bytes, b.gathered_at_loss_bytes, b.backward_head_bytes) == (
        1208, 1208, 5224)
    assert (b.backward_block_bytes, b.backward_reduce_bytes, b.backward_end_bytes) == (
        1208, 1208, 1208)


def test_shard_grad_op_blocks_free_their_weights_at_their_reduce() -> None:
    """A kept block (2,008 B alive) after its backward: the flat gradient made beside the
    root (1,208), 2 x 2,000 + 1,208 = 5,208; its reduce after its weights are freed,
    2,000 + 5,000 + 1,208 - 2,008 = 6,200; with the input's gradient (100) 6,300, and the
    2,008 B leave the alive bytes."""
    dp = DataParallel(flat=True, per_unit=True, unsharded_ratio=4,
                      unsharded_dtype=Fraction(1, 2), in_block=1208, in_first_block=1208,
                      at_embedding=1208, at_reduce=1208, boundary_grad=100, kept_layer=2008)
    positions, _ = run_positions(dp, Held(0, 0, 0, 0), 1000, 1000, 2, True, False)
    assert [(p.repeat, p.beside, p.after.delta, p.after.transient) for p in positions] == [
        (2, 1208, -2008, 6300)]


def test_shard_grad_op_with_accumulation_is_refused_by_name() -> None:
    from memplan.api import estimate

    with pytest.raises(MemplanError, match="SHARD_GRAD_OP"):
        estimate("tiny", gpus=4, zero=3, fsdp_version=1, reshard_after_forward=False,
                 grad_sync="last", global_batch_size=8, seq_len=64)


def test_cli_shard_grad_op() -> None:
    """--no-fsdp-reshard-after-forward is SHARD_GRAD_OP: the estimate of the API's
    reshard_after_forward False."""
    import json

    out = CliRunner().invoke(app, ["estimate", "-m", "tiny", "-n", "4", "--zero", "3", "--seq",
                                   "64", "--fsdp-version", "1",
                                   "--no-fsdp-reshard-after-forward", "--json"])
    assert out.exit_code == 0, out.output
    from memplan.api import estimate

    same = estimate("tiny", gpus=4, zero=3, fsdp_version=1, reshard_after_forward=False,
                    seq_len=64)
    assert json.loads(out.output)["stages"][0]["peak_bytes"] == same.stages[0].peak_bytes


# --- LoRA: the adapters' linears units of their own (peft's and torchtune's wrap) ------------

LORA = TrainablePolicy(adapters=(48, 24, 48, 24), layer_adapters=(72, 72))


def test_lora_adapter_units_by_hand() -> None:
    """bf16-pure over 4 ranks, two blocks of 1,001 elements of which 72 are adapters (a lora_A
    of 48 and a lora_B of 24 each, fp32, units of their own): a block's unit gathers its
    929 frozen base elements, padded to 932, x 2 B = 1,864; the root 604 x 2 = 1,208; the
    largest adapter's unit 48 x 4 = 192 B.

    - forward and a block's backward: root, block and the adapter running, 3,264; at the
      loss and at the head the root alone, 1,208 (no prefetch);
    - a block's end: the previous block gathered by its pre-backward hook before this one's
      reshard-only hook frees it, 1,208 + 2 x 1,864 = 4,936; the backward's end: the stage's
      first block (its input needs no grad) and the root, freed by the final callback,
      3,072;
    - the adapters' flat gradient, one tensor a unit: 48 x 4 = 192 B at most;
    - lazy init: the largest unit, 932 x 2 = 1,864 B."""
    b = fsdp1_buffers(PARAMS, make_layout(4, zero=3),
                      make_workload(TINY, fsdp_version=1, precision="bf16-pure", lora_rank=8,
                                    backward_prefetch="none"), LORA)
    assert (b.gathered_bytes, b.gathered_at_loss_bytes, b.grad_bytes) == (3264, 1208, 192)
    assert (b.backward_block_bytes, b.backward_last_block_bytes, b.backward_head_bytes,
            b.backward_end_bytes, b.backward_reduce_bytes) == (3264, 3264, 1208, 3072, 4936)
    assert (b.forward_start_bytes, b.lazy_init_bytes) == (0, 1864)
    assert b.flat_units and not b.grads_to_forward and not b.window_units


QLORA = TrainablePolicy(adapters=(48, 24, 48, 24), layer_adapters=(72, 72),
                        layer_quantized=(896, 896), layer_quant_data_bytes=(448, 448),
                        quant_state_bytes=100)


def test_qlora_block_units_gather_the_bf16_stored_nf4_data_by_hand() -> None:
    """QLoRA under FSDP1 (bf16-pure, 4 ranks): of a block's 1,001 elements 72 are adapters
    and 896 an NF4 base, whose packed data is 448 B (two weights a byte), stored as 224 bf16
    elements (``bnb_4bit_quant_storage=torch.bfloat16``); the block's flat parameter holds
    1,001 - 72 - 896 + 224 = 257 elements (the data and 33 bf16 norm elements), padded to
    260 over 4 ranks, x 2 B = 520 B gathered (the quant_state, 100 B, never); the root 604 x 2
    = 1,208; the largest adapter's unit 48 x 4 = 192.

    - forward and a block's backward: 1,208 + 520 + 192 = 1,920; at the loss the root alone;
    - a block's end: the block before gathered first, 1,208 + 2 x 520 = 2,248; the
      backward's end: the first block and the root, 1,728;
    - lazy init: the largest unit, the root's 604 x 2 = 1,208."""
    b = fsdp1_buffers(PARAMS, make_layout(4, zero=3),
                      make_workload(TINY, fsdp_version=1, precision="bf16-pure", lora_rank=8,
                                    base_quant="nf4", backward_prefetch="none"), QLORA)
    assert (b.gathered_bytes, b.gathered_at_loss_bytes, b.grad_bytes) == (1920, 1208, 192)
    assert (b.backward_block_bytes, b.backward_end_bytes, b.backward_reduce_bytes) == (
        1920, 1728, 2248)
    assert b.lazy_init_bytes == 1208


def test_qlora_under_fsdp1_is_modelled_and_said() -> None:
    """With an NF4 base under bf16 weights FSDP1's LoRA units hold (not FSDP2's), and a
    block's unit gathers less than FSDP2's stand-in did: no more than it."""
    from memplan.api import estimate

    kw = dict(gpus=4, zero=3, seq_len=64, lora_rank=8, base_quant="nf4",
              precision="bf16-pure", backward_prefetch="none")
    one = estimate("tiny", fsdp_version=1, **kw)
    assert any("FSDP1 FULL_SHARD with LoRA" in line and "quant_state whole on every rank"
               in line for line in one.assumptions)
    assert not any("FSDP2's units stand for" in line for line in one.assumptions)


@pytest.mark.parametrize(("prefetch", "head"), [("pre", 3072), ("post", 1208)])
def test_lora_backward_prefetch_gathers_the_block_before_from_the_first_adapter(
        prefetch: str, head: int) -> None:
    """A prefetch takes the unit before in the post-forward order: before a block's first
    adapter (q's lora_A), the block before, 1,864 B more at the block's input projections
    and norm (``prefetch_tail_bytes``); before the root, the last block, which BACKWARD_PRE
    gathers at the loss: 1,208 + 1,864 = 3,072 (BACKWARD_POST: the root alone, 1,208). A
    block's own backward otherwise as without prefetch, 3,264."""
    b = fsdp1_buffers(PARAMS, make_layout(4, zero=3),
                      make_workload(TINY, fsdp_version=1, precision="bf16-pure", lora_rank=8,
                                    backward_prefetch=prefetch), LORA)
    assert (b.prefetch_tail_bytes, b.backward_head_bytes, b.backward_block_bytes) == (
        1864, head, 3264)


@pytest.mark.parametrize(("option", "named"), [
    (dict(backward_prefetch="none", precision="fsdp-bf16"), "MixedPrecision(param_dtype)"),
    (dict(backward_prefetch="none", base_quant="int8", precision="bf16-pure"),
     "quantized base other than nf4"),
    (dict(backward_prefetch="none", base_quant="nf4", precision="fp32"),
     "nf4 base under precision fp32"),
    (dict(backward_prefetch="none", lora_targets="q,v,output"), "output projection"),
    (dict(backward_prefetch="none", reshard_after_forward=False), "SHARD_GRAD_OP")])
def test_lora_layouts_not_traced_are_refused_by_name(option: dict, named: str) -> None:
    from memplan.api import estimate

    one = estimate("tiny", gpus=4, zero=3, fsdp_version=1, seq_len=64, lora_rank=8, **option)
    assert any(named in line and "FSDP2's units stand for" in line for line in one.assumptions)


def test_lora_without_prefetch_is_modelled_and_said() -> None:
    from memplan.api import estimate

    kw = dict(gpus=4, zero=3, seq_len=64, lora_rank=8, backward_prefetch="none")
    one = estimate("tiny", fsdp_version=1, **kw)
    two = estimate("tiny", fsdp_version=2, **kw)
    assert one.peak_bytes != two.peak_bytes
    assert any("FSDP1 FULL_SHARD with LoRA" in line for line in one.assumptions)


def test_lora_accumulation_under_no_sync_is_said_untraced() -> None:
    """The states are built without the batch, so accumulation cannot refuse the units: the
    estimate keeps FSDP1's LoRA units and says that no_sync() accumulation is not traced."""
    from memplan.api import estimate

    kw = dict(gpus=4, zero=3, seq_len=64, lora_rank=8, backward_prefetch="none",
              micro_batch_size=1, grad_sync="last")
    many = estimate("tiny", fsdp_version=1, global_batch_size=8, **kw)
    one = estimate("tiny", fsdp_version=1, global_batch_size=4, **kw)
    assert any("no_sync() accumulation not traced with LoRA" in line for line in many.assumptions)
    assert not any("no_sync()" in line for line in one.assumptions)
