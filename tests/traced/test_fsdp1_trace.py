"""FSDP1 (``FullyShardedDataParallel``, ``fsdp_version=1``) against real training steps.

Rank 0 of each layout runs on torch's fake process group with real CPU tensors
(``memplan.profile.fsdp1``: every block a unit through ``ModuleWrapPolicy``, the root holding the
embedding, the final norm and the head, as Accelerate's transformer-based wrap does), two steps,
and is compared with the estimate without fixed overheads: parameters, gradients and optimizer
states to the byte, every phase peak of the first step and of the steady state within 1% (in
practice within a few hundred bytes: tensors of a few elements, such as AdamW's step counters
and the loss, that the model does not count).

The cases are those where FSDP1 holds memory differently from FSDP2, each found in a trace
before it was modelled (``memplan.model.fsdp1``, ``memplan.model.sharding`` ``flat``):

- one block gathered in forward and the root alone at the loss (no forward prefetch), where
  FSDP2's estimate read a block more: +8% (tiny, fp32), +26% in step 1 (tiny-wide);
- the first forward's lazy init, each unit's padded flat parameter made and freed in turn (in
  the weights' dtype too under mixed precision): step 1's forward peak of weight-heavy models
  (-3.5% to -12% before it was counted);
- backward prefetch none (Accelerate's default) or BACKWARD_POST: one block gathered while a
  block's backward runs (FSDP2's estimate: +10% on tiny-wide at 4 ranks);
- the flat gradient: the views' gradients and their concatenation alive together, and a
  unit's reduce (reduce-dtype copy, output shard) in its own post-backward hook (-15% on
  tiny-wide fp32 before);
- ``use_orig_params``: the flat sharded gradients alive at the next step's forward start;
- ``no_sync()`` accumulation: flat accumulators in the gathered dtype (bf16 under
  ``MixedPrecision(param_dtype=bf16)``), the last micro-batch's reduce beside the incoming flat
  gradient the ``AccumulateGrad`` post-hook still references (-5% before);
- LoRA as peft's FSDP recipe wraps it (peft's own model, ``test_peft_lora_under_fsdp1``): the
  frozen decoder-layer units resharded by a hook on their inputs' gradients, after the block
  before is gathered (-23% before), and a backward prefetch that gathers the block before
  from the first adapter's hook;
- QLoRA (bitsandbytes NF4 stored as bf16, FSDP-QLoRA): the packed data in the decoder
  layer's flat parameter, the quant_state whole on every rank (FSDP2's units in its place:
  +35% forward, +21% backward on llama-wide), on the fake group and on two real gloo ranks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from memplan.api import make_layout, make_workload  # noqa: E402
from recorded import compare  # noqa: E402 (tests/traced/recorded.py)
from memplan.spec import ModelSpec, load_model  # noqa: E402

TOLERANCE_PCT = 1.0
TINY = load_model("tiny")  # 2 layers, h 64, f 176, 4 heads / 2 KV heads, V 128


def _variant(**update) -> ModelSpec:
    return ModelSpec.model_validate({**TINY.model_dump(), **update})


# weights outweigh activations at 32 tokens: gathers, lazy init and reduces decide the peaks
WIDE = _variant(name="tiny-wide", hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8,
                num_kv_heads=8, head_dim=64, num_layers=3, vocab_size=256)
# six identical blocks: the runs' middle blocks repeat
DEEP = _variant(name="tiny-deep6", hidden_size=256, ffn_hidden_size=688, num_attention_heads=8,
                num_kv_heads=2, head_dim=32, num_layers=6, vocab_size=512)
SPECS = {"tiny": TINY, "wide": WIDE, "deep": DEEP}

CASES = [
    # FULL_SHARD with torch's default BACKWARD_PRE
    ("tiny", 2, dict(seq_len=64, micro_batch_size=2, precision="fp32")),
    ("tiny", 4, dict(seq_len=256, micro_batch_size=2, precision="fsdp-bf16")),
    ("wide", 2, dict(seq_len=32, micro_batch_size=1, precision="fp32")),
    ("wide", 2, dict(seq_len=32, micro_batch_size=1, precision="fsdp-bf16")),
    ("deep", 2, dict(seq_len=32, micro_batch_size=1, precision="fsdp-bf16")),
    ("tiny", 4, dict(seq_len=256, micro_batch_size=2, precision="bf16-pure")),
    ("wide", 4, dict(seq_len=32, micro_batch_size=1, precision="fsdp-bf16", recompute="full")),
    # Accelerate's and the Trainer's default: no backward prefetch; and BACKWARD_POST
    ("wide", 4, dict(seq_len=32, micro_batch_size=1, precision="fsdp-bf16",
                     backward_prefetch="none")),
    ("deep", 2, dict(seq_len=64, micro_batch_size=1, precision="fp32", backward_prefetch="none")),
    ("wide", 4, dict(seq_len=32, micro_batch_size=1, precision="fsdp-bf16",
                     backward_prefetch="post")),
    ("deep", 4, dict(seq_len=32, micro_batch_size=1, precision="fsdp-bf16",
                     backward_prefetch="post")),
    # gradient accumulation under no_sync() (grad_sync last)
    ("deep", 2, dict(seq_len=32, micro_batch_size=1, global_batch_size=4,
                     precision="fsdp-bf16", grad_sync="last")),
    ("wide", 2, dict(seq_len=32, micro_batch_size=1, global_batch_size=4,
                     precision="fsdp-bf16", grad_sync="last")),
    ("deep", 4, dict(seq_len=32, micro_batch_size=1, global_batch_size=12, precision="fp32",
                     grad_sync="last", backward_prefetch="none")),
    # the last micro-batch's first reduce beside the root alone without a prefetch (+6.6%
    # before), beside the block BACKWARD_POST gathered
    ("deep", 4, dict(seq_len=32, micro_batch_size=1, global_batch_size=8,
                     precision="fsdp-bf16", grad_sync="last", backward_prefetch="none")),
    ("deep", 4, dict(seq_len=32, micro_batch_size=1, global_batch_size=8,
                     precision="fsdp-bf16", grad_sync="last", backward_prefetch="post")),
    # use_orig_params (the Trainer's default): the sharded gradients live into the next
    # step's forward (-10% before, tiny-wide), the rest the same bytes
    ("wide", 2, dict(seq_len=32, micro_batch_size=1, precision="fsdp-bf16",
                     use_orig_params=True)),
    ("wide", 4, dict(seq_len=32, micro_batch_size=1, precision="fp32", use_orig_params=True,
                     backward_prefetch="post")),
    ("deep", 2, dict(seq_len=32, micro_batch_size=1, global_batch_size=4,
                     precision="fsdp-bf16", grad_sync="last", use_orig_params=True,
                     backward_prefetch="none")),
    # SHARD_GRAD_OP: every block kept gathered from its forward to its post-backward
    ("wide", 2, dict(seq_len=32, micro_batch_size=1, precision="fsdp-bf16",
                     reshard_after_forward=False)),
    ("wide", 4, dict(seq_len=32, micro_batch_size=1, precision="fp32",
                     reshard_after_forward=False, backward_prefetch="none")),
    ("deep", 2, dict(seq_len=32, micro_batch_size=1, precision="fsdp-bf16",
                     reshard_after_forward=False)),
    ("tiny", 4, dict(seq_len=256, micro_batch_size=2, precision="fsdp-bf16",
                     reshard_after_forward=False, recompute="full")),
    ("deep", 4, dict(seq_len=32, micro_batch_size=1, precision="bf16-pure",
                     reshard_after_forward=False, use_orig_params=True)),
]


def _id(case) -> str:
    name, dp, fields = case
    return f"{name}-dp{dp}-" + "-".join(f"{k}={v}" for k, v in fields.items())


@pytest.mark.parametrize(("name", "dp", "fields"), CASES, ids=[_id(c) for c in CASES])
def test_fsdp1_rank_matches_trace(name: str, dp: int, fields: dict) -> None:
    spec = SPECS[name]
    wl = make_workload(spec, fsdp_version=1, **fields)
    result = compare(spec, make_layout(dp, zero=3), wl)
    for row in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes"):
        assert result.row(row).diff_bytes == 0, result.row(row)
    bad = [r for r in result.rows if abs(r.diff_pct) > TOLERANCE_PCT]
    assert not bad, "\n".join(f"{r.name}: measured {r.measured_bytes:,} estimated "
                              f"{r.estimated_bytes:,} ({r.diff_pct:+.3f}%)" for r in bad)


def test_limit_all_gathers_changes_no_allocated_byte() -> None:
    """``limit_all_gathers=False`` (torch's rate limiter off): the same allocations and frees
    in the same order on the CPU thread, so the same estimate holds (on a GPU it changes when
    freed blocks become reusable: reserved memory, not modelled)."""
    from memplan.profile.fsdp1 import extra_options

    wl = make_workload(WIDE, fsdp_version=1, seq_len=32, micro_batch_size=1,
                       precision="fsdp-bf16")
    with extra_options(limit_all_gathers=False):
        result = compare(WIDE, make_layout(4, zero=3), wl)
    assert all(abs(r.diff_pct) <= TOLERANCE_PCT for r in result.rows)


# --- real gloo, two processes, against the fake group -----------------------------------------

GLOO_FIELDS = [dict(seq_len=64, micro_batch_size=2, precision="fsdp-bf16"),
               dict(seq_len=64, micro_batch_size=2, global_batch_size=8, precision="fp32",
                    grad_sync="last", backward_prefetch="none")]


def _gloo_rank(rank: int, folder: str) -> None:
    """One worker: every case on one gloo group met through a file store in ``folder``."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from memplan.profile.distributed import leave_rank, trace_rank

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=2)
    try:
        out = [_summary(trace_rank(TINY, make_layout(2, zero=3),
                                   make_workload(TINY, fsdp_version=1, **fields), fake=False))
               for fields in GLOO_FIELDS]
    finally:
        dist.destroy_process_group()
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    leave_rank()  # gloo's threads must not race the interpreter's teardown (see leave_rank)


def _summary(r) -> dict:
    return {"params": r.params_bytes,
            "steps": [{"grads": s.grads_bytes, "optimizer": s.optimizer_bytes,
                       "peaks": {ph: p.total_bytes for ph, p in s.phases.items()}}
                      for s in r.steps]}


def test_real_gloo_ranks_against_the_fake_group(tmp_path) -> None:
    """Two real gloo ranks of FSDP1 against the fake-group trace of rank 0 (tiny divides by 2:
    both ranks hold the same bytes): states exactly, every phase peak at least the fake
    group's and at most ``gloo_late_bytes`` more (gloo's worker threads may drop a finished
    collective's tensors late)."""
    import json

    import torch.multiprocessing as mp

    from memplan.profile.distributed import gloo_late_bytes, trace_parallel

    mp.start_processes(_gloo_rank, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for index, fields in enumerate(GLOO_FIELDS):
        wl = make_workload(TINY, fsdp_version=1, **fields)
        par = make_layout(2, zero=3)
        fake, late = _summary(trace_parallel(TINY, par, wl)), gloo_late_bytes(TINY, par, wl)
        for rank in ranks:
            real = rank[index]
            assert real["params"] == fake["params"]
            for got, want in zip(real["steps"], fake["steps"], strict=True):
                assert (got["grads"], got["optimizer"]) == (want["grads"], want["optimizer"])
                for phase, measured in got["peaks"].items():
                    assert 0 <= measured - want["peaks"][phase] <= late, (fields, phase)


# --- transformers' Llama under FSDP1 as Accelerate wraps it ------------------------------------

HF_CASES = [("fp32", 2, {}), ("bf16-pure", 4, {"backward_prefetch": "pre"}),
            ("fsdp-bf16", 2, {"use_orig_params": False})]


@pytest.mark.parametrize(("recipe", "dp", "fsdp1"), HF_CASES,
                         ids=[f"{r}-dp{d}-{o}" for r, d, o in HF_CASES])
def test_transformers_llama_under_fsdp1(recipe: str, dp: int, fsdp1: dict) -> None:
    """A two-layer transformers Llama (tests/traced/hf_configs.py LLAMA3_TOY) wrapped as
    accelerate 1.15.0 wraps FSDP1 with the hf preset's defaults (every LlamaDecoderLayer a
    unit, no backward prefetch, use_orig_params; ``memplan.profile.frameworks._fsdp1_wrap``),
    stepped as the Trainer steps (the model's loss, ``model.clip_grad_norm_``, fused AdamW),
    rank 0 of the fake group: parameters, gradients and saved activations exact, every row
    within 1% (in practice within 2.3 KB: the clip's per-tensor norms, AdamW's step
    counters)."""
    pytest.importorskip("transformers")
    from hf_configs import LLAMA3_TOY, hf  # tests/traced/hf_configs.py

    from memplan.profile.frameworks import FrameworkCase
    from recorded import compare_framework  # tests/traced/recorded.py

    case = FrameworkCase("transformers", "llama3-toy", hf("Meta-Llama-3-8B", **LLAMA3_TOY),
                         recipe, 2, 128, dp=dp, options={"fsdp1": fsdp1})
    result = compare_framework(case)
    for row in ("params_bytes", "grads_bytes", "activations_bytes"):
        assert result.row(row).diff_bytes == 0, result.row(row)
    assert all(abs(r.diff_pct) <= TOLERANCE_PCT for r in result.rows), result.rows


# --- LoRA under FSDP1: peft's wrap, each adapter linear a unit of its own ----------------------

def _lora_case(config: str, recipe: str, dp: int, b: int, s: int, **options):
    from hf_configs import LLAMA3_TOY, hf  # tests/traced/hf_configs.py

    from memplan.profile.frameworks import FrameworkCase

    shapes = {"llama3-toy": {},
              # weights outweigh activations at 32 tokens: the gathers decide the peaks
              "llama-wide": dict(intermediate_size=4096, vocab_size=256),
              "llama-deep5": dict(num_hidden_layers=5, intermediate_size=1024, vocab_size=256)}
    shape = hf("Meta-Llama-3-8B", **{**LLAMA3_TOY, **shapes[config]})
    return FrameworkCase("peft", config, shape, recipe, b, s, dp=dp,
                         options={"lora_rank": 8, **options})


# (config, recipe, dp, micro-batch, sequence, options); fsdp1: workload fields (no backward
# prefetch: Accelerate's and the Trainer's default; use_orig_params False unless set)
LORA_CASES = [
    # the block end: the block before gathered first (FSDP2's units read +15% on llama3-toy,
    # FSDP1's units without the reshard-only hook -23% on llama-wide)
    ("llama-wide", "bf16-pure", 2, 1, 32, dict(fsdp1={})),
    ("llama-wide", "fp32", 2, 1, 32, dict(fsdp1={})),
    ("llama-deep5", "bf16-pure", 2, 1, 32, dict(fsdp1={})),
    ("llama3-toy", "bf16-pure", 2, 2, 128, dict(fsdp1={})),
    # peft's gradient checkpointing (enable_input_require_grads: the first block's input
    # needs grad, so its reshard-only hook fires at its end)
    ("llama-wide", "bf16-pure", 4, 1, 32, dict(gc=True, fsdp1={})),
    ("llama-deep5", "fp32", 2, 1, 32, dict(gc=True, fsdp1={})),
    # the Trainer's use_orig_params with peft's policy (update_fsdp_plugin_peft)
    ("llama-wide", "bf16-pure", 2, 1, 32, dict(fsdp1={"use_orig_params": True})),
    # a backward prefetch: the block before, gathered from the hook of the block's first
    # adapter (q's lora_A) in its input projections' backward (-0.9% to -1.8% without it),
    # and under BACKWARD_PRE the last block at the loss; torchtune's recipe runs BACKWARD_PRE
    ("llama-wide", "bf16-pure", 2, 1, 32, dict(fsdp1={"backward_prefetch": "post"})),
    ("llama-deep5", "bf16-pure", 2, 1, 32, dict(fsdp1={"backward_prefetch": "post"})),
    ("llama-deep5", "bf16-pure", 2, 1, 32, dict(fsdp1={"backward_prefetch": "pre"})),
    ("llama-wide", "fp32", 4, 1, 32, dict(fsdp1={"backward_prefetch": "pre"})),
    ("llama-wide", "bf16-pure", 4, 1, 32, dict(gc=True, fsdp1={"backward_prefetch": "pre"})),
    # QLoRA (FSDP-QLoRA: bitsandbytes NF4, bnb_4bit_quant_storage=torch.bfloat16): a decoder
    # layer's flat parameter holds the packed data as bf16 elements beside its bf16 norms,
    # the quant_state whole on every rank (FSDP2's units in its place read +35% forward,
    # +21% backward on llama-wide)
    ("llama-wide", "bf16-pure", 2, 1, 32, dict(base_quant="nf4", fsdp1={})),
    ("llama-deep5", "bf16-pure", 2, 1, 32, dict(base_quant="nf4", fsdp1={})),
    ("llama-wide", "bf16-pure", 4, 1, 32, dict(base_quant="nf4",
                                               fsdp1={"backward_prefetch": "pre"})),
]


@pytest.mark.parametrize(("config", "recipe", "dp", "b", "s", "options"), LORA_CASES,
                         ids=[f"{c}-{r}-dp{d}-" + "-".join(f"{k}={v}" for k, v in o.items())
                              for c, r, d, _, _, o in LORA_CASES])
def test_peft_lora_under_fsdp1(config: str, recipe: str, dp: int, b: int, s: int,
                               options: dict) -> None:
    """peft's LoRA (fp32 adapters on q and v) on a transformers Llama under FSDP1 as peft's
    FSDP recipe and the Trainer wrap it (``memplan.profile.finetune._fsdp1_lora_wrap``:
    peft's ``fsdp_auto_wrap_policy``, each adapter linear a unit nested in its decoder
    layer's, whose flat parameter holds the frozen base alone), rank 0 of the fake group:
    weights, gradients, optimizer states and saved activations exact, every phase peak
    within 1% (``memplan.model.fsdp1._adapter_units``)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    if options.get("base_quant"):
        pytest.importorskip("bitsandbytes")
    from memplan.profile import finetune  # noqa: F401 (registers the "peft" builder)
    from recorded import compare_framework  # tests/traced/recorded.py

    result = compare_framework(_lora_case(config, recipe, dp, b, s, **options))
    for row in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert result.row(row).diff_bytes == 0, result.row(row)
    assert any("FSDP1 FULL_SHARD with LoRA" in line for line in result.estimate.assumptions)
    bad = [r for r in result.rows if abs(r.diff_pct) > TOLERANCE_PCT]
    assert not bad, "\n".join(f"{r.name}: measured {r.measured_bytes:,} estimated "
                              f"{r.estimated_bytes:,} ({r.diff_pct:+.3f}%)" for r in bad)


def test_the_reference_model_refuses_lora() -> None:
    """The reference model has no adapters: under LoRA it measured every weight's gradient
    (tiny-wide over 2 ranks, fp32, q and v at rank 8: 19,799,040 B of gradients and
    39,598,080 of AdamW states, where the adapters' shards are 98,304 and 196,608)."""
    from memplan.errors import MemplanError

    wl = make_workload(WIDE, fsdp_version=1, seq_len=32, micro_batch_size=1, precision="fp32",
                       lora_rank=8, lora_targets="q,v")
    with pytest.raises(MemplanError, match="no LoRA adapters"):
        compare(WIDE, make_layout(2, zero=3), wl)


# --- QLoRA under FSDP1 where a gap outside FSDP1's units shows -----------------------------

def _qlora_known():
    from known import Known, param  # tests/traced/known.py

    gc = Known(("first_step.backward_bytes", "steady.backward_bytes"),
               "QLoRA with gradient checkpointing on an MLP-heavy shape: memplan's backward "
               "reads over at the recomputed MLP's down projection (its dequantized weight "
               "beside the input gradient), +2.91% on one device too (llama-wide, no FSDP); "
               "FSDP1's units add nothing to it",
               {"first_step.backward_bytes": (200_070, 2.851),
                "steady.backward_bytes": (200_066, 2.830)})
    mlp = Known(("first_step.forward_bytes", "steady.forward_bytes",
                 "first_step.backward_bytes", "steady.backward_bytes"),
                "QLoRA on every linear, llama-wide: the backward over as on one device "
                "(+2.20%, no FSDP: the MLP's dequantized weights), the forward under by "
                "104,576 B as FSDP1 with LoRA on every linear reads unquantized (-0.58%)",
                {"first_step.forward_bytes": (-104_576, -1.293),
                 "steady.forward_bytes": (-104_580, -1.158),
                 "first_step.backward_bytes": (213_084, 2.197),
                 "steady.backward_bytes": (213_080, 2.003)})
    return [param(_lora_case("llama-wide", "bf16-pure", 2, 1, 32, base_quant="nf4", gc=True,
                             fsdp1={}), gc),
            param(_lora_case("llama-wide", "bf16-pure", 2, 1, 32, base_quant="nf4",
                             lora_targets="all-linear", fsdp1={}), mlp)]


@pytest.mark.parametrize(("case", "known"), _qlora_known())
def test_qlora_under_fsdp1_known_gaps(case, known) -> None:
    """QLoRA under FSDP1 where the estimate misses by what it misses without FSDP1's units
    (``known.py``: the size pinned): the weights, gradients and optimizer states exact."""
    pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    from known import check  # tests/traced/known.py

    from memplan.profile import finetune  # noqa: F401 (registers the "peft" builder)
    from recorded import compare_framework  # tests/traced/recorded.py

    check(compare_framework(case).rows, known)


def _gloo_qlora_rank(rank: int, folder: str) -> None:
    """One worker of ``test_qlora_real_gloo_ranks_against_the_fake_group``: the QLoRA case
    traced on a real two-rank gloo group met through a file store in ``folder``."""
    import contextlib
    import json
    from pathlib import Path

    import torch.distributed as dist

    from memplan.profile import finetune, frameworks  # noqa: F401 (the "peft" builder)
    from memplan.profile.distributed import leave_rank

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=2)
    try:
        # this process's real group stands for trace_case's fake one
        frameworks._process_group = lambda dp: contextlib.nullcontext()
        _, result = frameworks.trace_case(_qlora_gloo_case())
    finally:
        dist.destroy_process_group()
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(_library_summary(result)))
    leave_rank()


def _qlora_gloo_case():
    return _lora_case("llama-wide", "bf16-pure", 2, 1, 32, base_quant="nf4", fsdp1={})


def _library_summary(r) -> dict:
    return {"params": r.params_bytes,
            "steps": [{"grads": s.grads_bytes, "optimizer": s.optimizer_bytes,
                       "saved": s.saved_activations_bytes,
                       "peaks": {ph: p.total_bytes for ph, p in s.phases.items()}}
                      for s in r.steps]}


def test_qlora_real_gloo_ranks_against_the_fake_group(tmp_path) -> None:
    """QLoRA under FSDP1 on two real gloo ranks (bitsandbytes' CPU backend) against rank 0 on
    the fake group: both ranks hold the same weights, gradients, optimizer states and saved
    activations, and every phase peak is at least the fake group's and at most
    ``gloo_late_bytes`` more (measured: equal to the byte on both ranks)."""
    pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    import json

    import torch.multiprocessing as mp

    from memplan.profile import finetune  # noqa: F401 (registers the "peft" builder)
    from memplan.profile.distributed import gloo_late_bytes
    from memplan.profile.frameworks import make_workload as library_workload
    from memplan.profile.frameworks import trace_case

    mp.start_processes(_gloo_qlora_rank, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    built, fake_result = trace_case(_qlora_gloo_case())
    fake = _library_summary(fake_result)
    late = gloo_late_bytes(built.spec, built.layout, library_workload(built))
    for r in range(2):
        real = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert real["params"] == fake["params"]
        for got, want in zip(real["steps"], fake["steps"], strict=True):
            assert (got["grads"], got["optimizer"], got["saved"]) == (
                want["grads"], want["optimizer"], want["saved"])
            for phase, measured in got["peaks"].items():
                assert 0 <= measured - want["peaks"][phase] <= late, (r, phase)
