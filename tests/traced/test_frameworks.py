"""The analytic model against other people's code: Hugging Face transformers, torchtitan, litgpt.

Each case builds a real model with the library (``memplan.profile.frameworks``), runs two
training steps as the library's own loop runs them (its loss, fused AdamW, gradients set to None)
under the exact tensor tracker, and compares with ``memplan.model.estimate.estimate`` (no fixed
overheads) of the matching spec and recipe: parameters, gradients and optimizer states to the
byte, saved activations and every phase peak of the first step and of the steady state within
1%.

Where the library does something memplan does not model, the case is ``xfail(strict=True)``
with the measured difference and its cause in the library's source. The test still checks every
row outside the known deviation (a new difference there fails the test), then raises
``KnownDeviation``; a known deviation that disappears fails too, so each one is re-examined when
a library or memplan changes. A case skips when its library is not installed.

Versions traced: transformers 5.3.0 (the newest 5.x that co-installs with litgpt 0.5.13, whose
huggingface-hub<1.4 pin rules out later 5.x; 5.24.0 traces the same bytes), torchtitan 0.3.0,
litgpt 0.5.13 with lightning 2.6.6, torch 2.13.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from known import Known, check, param, table  # tests/traced/known.py
from memplan.profile.frameworks import (
    FrameworkCase,
    compare_framework,
    fake_real_check,
)


HF_DIR = Path(__file__).resolve().parents[1] / "data" / "hf"
IMPORTS = {"transformers": ("transformers",), "torchtitan": ("torchtitan", "triton"),
           "litgpt": ("litgpt", "lightning")}


def hf(name: str, **overrides) -> dict:
    """A published config.json (tests/data/hf), cut down by ``overrides``."""
    data = json.loads((HF_DIR / name / "config.json").read_text())
    # ids beyond a cut vocabulary only draw a warning; drop them
    data.update({k: None for k in ("bos_token_id", "eos_token_id")}, **overrides)
    return data


# cut to two layers and narrowed; the head ratio (GQA 4:1) and the ffn ratio kept
LLAMA3_TOY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=896,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
# a shape in no catalog: odd widths, MQA, 3 heads of 32, vocabulary 777
ODD = dict(num_hidden_layers=2, hidden_size=96, intermediate_size=272, num_attention_heads=3,
           num_key_value_heads=1, vocab_size=777)
QWEN_TOY = dict(num_hidden_layers=2, hidden_size=224, intermediate_size=1184,
                num_attention_heads=7, num_key_value_heads=1, vocab_size=1000)
# attention dropout off: CPU's SDPA falls back to its math kernel with dropout, where CUDA's
# flash kernel drops inside the kernel; residual and embedding dropout stay (bool masks)
GPT2_TOY = dict(n_layer=2, n_embd=256, n_head=4, vocab_size=1000, attn_pdrop=0.0)
MIXTRAL_TOY = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                   vocab_size=512)
TITAN_TOY = dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=1000)
LITGPT_TOY = dict(n_layer=2, n_embd=256, n_head=4, intermediate_size=688, vocab_size=1000,
                  padded_vocab_size=1000, block_size=256)
LITGPT_GQA = dict(LITGPT_TOY, n_head=8, n_query_groups=2)

CASES: list[tuple[FrameworkCase, Known | None]] = [
    # --- Hugging Face transformers, SDPA ---------------------------------------------------
    (FrameworkCase("transformers", "Meta-Llama-3-8B-2l", hf("Meta-Llama-3-8B",
                                                             num_hidden_layers=2),
                   "fp32", 1, 128, fake=True), None),
    (FrameworkCase("transformers", "Mistral-7B-v0.1-2l", hf("Mistral-7B-v0.1",
                                                            num_hidden_layers=2),
                   "bf16-pure", 1, 128, fake=True), None),  # logits held: -0.55% here
    (FrameworkCase("transformers", "Qwen2.5-7B-2l", hf("Qwen2.5-7B", num_hidden_layers=2),
                   "fp32", 1, 128, fake=True), None),
    (FrameworkCase("transformers", "llama3-toy", hf("Meta-Llama-3-8B", **LLAMA3_TOY),
                   "fp32", 2, 128), None),
    (FrameworkCase("transformers", "llama3-toy", hf("Meta-Llama-3-8B", **LLAMA3_TOY),
                   "bf16-pure", 2, 128), None),  # hf preset: the logits held through the loss
    (FrameworkCase("transformers", "llama-h96-mqa", hf("Meta-Llama-3-8B", **ODD),
                   "fp32", 3, 96), None),
    (FrameworkCase("transformers", "llama-h96-mqa", hf("Meta-Llama-3-8B", **ODD),
                   "bf16-pure", 3, 96), None),  # hf preset: the logits held through the loss
    (FrameworkCase("transformers", "qwen2.5-toy", hf("Qwen2.5-7B", **QWEN_TOY),
                   "fp32", 2, 128), None),
    (FrameworkCase("transformers", "mistral-toy", hf("Mistral-7B-v0.1", **LLAMA3_TOY),
                   "fp32", 2, 128), None),
    # --- fp32 weights under torch.autocast (Trainer bf16=True on an fp32 model) -------------
    (FrameworkCase("transformers", "Meta-Llama-3-8B-2l", hf("Meta-Llama-3-8B",
                                                             num_hidden_layers=2),
                   "amp-bf16", 1, 128, fake=True), None),  # logits held: -0.43% here
    (FrameworkCase("transformers", "Qwen2.5-7B-2l", hf("Qwen2.5-7B", num_hidden_layers=2),
                   "amp-bf16", 1, 128, fake=True), None),  # qkv biases' casts cached
    (FrameworkCase("transformers", "llama3-toy", hf("Meta-Llama-3-8B", **LLAMA3_TOY),
                   "amp-bf16", 2, 128), None),  # hf: held logits, fp32 K/V cache copies
    (FrameworkCase("transformers", "llama3-toy", hf("Meta-Llama-3-8B", **LLAMA3_TOY),
                   "amp-bf16", 2, 128, options={"attn": "eager"}), None),  # hf: as SDPA
    (FrameworkCase("transformers", "llama-h96-mqa", hf("Meta-Llama-3-8B", **ODD),
                   "amp-bf16", 3, 96), None),  # hf: held logits, fp32 K/V cache copies
    # --- eager attention ---------------------------------------------------------------------
    (FrameworkCase("transformers", "llama3-toy", hf("Meta-Llama-3-8B", **LLAMA3_TOY),
                   "fp32", 2, 128, options={"attn": "eager"}), None),
    (FrameworkCase("transformers", "llama3-toy", hf("Meta-Llama-3-8B", **LLAMA3_TOY),
                   "bf16-pure", 2, 128, options={"attn": "eager"}),
     None),  # hf preset: the fp32 softmax and its bf16 copy saved
    # --- GPT-2 -----------------------------------------------------------------------------
    (FrameworkCase("transformers", "gpt2-toy-tanh", hf("gpt2", activation_function=
                                                       "gelu_pytorch_tanh", use_cache=False,
                                                       **GPT2_TOY), "fp32", 2, 128), None),
    (FrameworkCase("transformers", "gpt2-toy", hf("gpt2", use_cache=False, **GPT2_TOY),
                   "fp32", 2, 128), None),
    (FrameworkCase("transformers", "gpt2-toy-tanh-cache", hf("gpt2", activation_function=
                                                             "gelu_pytorch_tanh", **GPT2_TOY),
                   "fp32", 2, 128),
     None),  # hf: the DynamicCache's K/V copies, q's view pins the fused c_attn output
    # --- Mixtral: routing reads values, so small real tensors ---------------------------------
    (FrameworkCase("transformers", "mixtral-toy", hf("Mixtral-8x7B-v0.1", **MIXTRAL_TOY),
                   "fp32", 2, 64),
     Known(("optimizer_bytes", "activations_bytes", "first_step.forward_bytes",
            "first_step.backward_bytes", "steady.forward_bytes"),
           "MixtralExperts.forward (models/mixtral/modeling_mixtral.py) keeps the experts as "
           "stacked 3-D parameters (gate_up_proj, down_proj), runs each hit expert on "
           "`hidden_states[token_idx]` with one fused gate/up matmul chunked in two, and "
           "combines with an in-place `final_hidden_states.index_add_` (which saves no "
           "operand); memplan models the reference loop over separate expert MLPs combined "
           "out of place. Measured: activations +5.9% (estimate above), forward +2.9% / +1.5%, "
           "first-step backward -1.5%; and 2 expert parameter tensors per layer where memplan "
           "counts 3 per expert, so fused AdamW's 4-byte step counters are 80 B fewer "
           "(optimizer 8,139,860 B measured, 8,139,940 estimated).")),
    # --- torchtitan: Llama3 with its own FSDP2 on 2 ranks of the fake process group -----------
    # (the torchtitan preset: its FSDP units, fused AdamW, fused RMSNorm, kept gradients; the
    # cases set training.disable_cuda_graphs, i.e. set_to_none, as a user knob)
    # (torchtitan preset: its FSDP units, the per-layer RoPE cache buffers, `pred` held through
    # the loss, fused AdamW and RMSNorm, kept gradients)
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fsdp-bf16", 2, 128, dp=2), None),
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fp32", 2, 128, dp=2), None),
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fsdp-bf16", 2, 128, dp=2,
                   options={"ac": "full"}), None),
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fsdp-bf16", 2, 128, dp=2,
                   options={"ac": "selective"}), None),
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fsdp-bf16", 2, 128, dp=2,
                   options={"set_to_none": False}), None),
    # 8 ranks: the shards an eighth, the gathered units whole
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fsdp-bf16", 2, 128, dp=8), None),
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fp32", 2, 128, dp=8), None),
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fsdp-bf16", 2, 128, dp=8,
                   options={"ac": "selective"}), None),
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fsdp-bf16", 2, 128, dp=8,
                   options={"ac": "full"}),
     Known(("first_step.forward_bytes",),
           "FullAC (distributed/activation_checkpoint.py) at 8 ranks: 66,560 B more at the "
           "forward's peak than memplan's checkpointed layers hold, not attributed yet (the "
           "same bytes at 2 ranks, where they are under 1%). Measured: forward -1.14% first "
           "step, -0.85% steady; every other row within 1%.")),
    # one rank: parallelize_llama runs apply_fsdp_to_decoder at shard degree 1 too, where a
    # unit is gathered alone (no flat all-gather output) and its reduce holds three copies
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fsdp-bf16", 2, 128, dp=1), None),
    (FrameworkCase("torchtitan", "llama3-toy", TITAN_TOY, "fsdp-bf16", 2, 128, dp=1,
                   options={"ac": "full"}), None),
    # --- litgpt through Lightning Fabric, as litgpt/pretrain.py runs it ----------------------
    # (the lightning preset holds the loop's fp32 logits from the loss to the next forward)
    (FrameworkCase("litgpt", "Llama-2-7b-hf", LITGPT_TOY, "fp32", 2, 128), None),
    (FrameworkCase("litgpt", "Llama-2-7b-hf", LITGPT_TOY, "bf16-pure", 2, 128), None),
    (FrameworkCase("litgpt", "Llama-2-7b-hf", LITGPT_TOY, "amp-bf16", 2, 128), None),
    # grouped queries: k and v repeat_interleave'd to every head before SDPA, nothing pinned
    (FrameworkCase("litgpt", "Llama-2-7b-hf", LITGPT_GQA, "fp32", 2, 128), None),
    (FrameworkCase("litgpt", "Llama-2-7b-hf", LITGPT_GQA, "bf16-pure", 3, 96), None),
]



def _skip_without(library: str) -> None:
    for module in IMPORTS[library]:
        pytest.importorskip(module, reason=f"{library} case: {module} is not installed "
                                           "(pip install -e '.[test]')")



@pytest.mark.parametrize(("case", "known"), [param(c, k) for c, k in CASES])
def test_library_matches_estimate(case: FrameworkCase, known: Known | None) -> None:
    _skip_without(case.library)
    result = compare_framework(case)
    check(result.rows, known)


# --- fake tensors against real ones --------------------------------------------------------

FAKE_CHECKS = [
    pytest.param(FrameworkCase("transformers", "llama3-toy",
                               hf("Meta-Llama-3-8B", **LLAMA3_TOY), "fp32", 2, 64),
                 id="llama3-use_cache-default"),
    pytest.param(FrameworkCase("transformers", "mistral-toy",
                               hf("Mistral-7B-v0.1", **LLAMA3_TOY), "bf16-pure", 2, 64),
                 id="mistral-use_cache-default"),
    pytest.param(FrameworkCase("transformers", "qwen2.5-toy", hf("Qwen2.5-7B", **QWEN_TOY),
                               "fp32", 2, 64),
                 id="qwen2.5-use_cache-default"),
    pytest.param(FrameworkCase("transformers", "llama3-toy",
                               hf("Meta-Llama-3-8B", use_cache=False, **LLAMA3_TOY), "fp32",
                               2, 64),
                 id="llama3-use_cache-off",
                 marks=pytest.mark.xfail(strict=True, reason=(
                     "transformers takes fake tensors for tracing (utils/import_utils.py "
                     "is_tracing: is_fake_tensor), so masking_utils.find_packed_sequence_"
                     "indices cannot return 'not packed' and create_causal_mask builds a "
                     "4-D mask; sdpa_attention_forward then repeats K/V (use_gqa_in_sdpa "
                     "needs no mask). With use_cache on, a DynamicCache skips the packed "
                     "check. Measured on fake: activations +458,752 B (+6.7%); real tensors "
                     "never do this, so cases with use_cache off run on real tensors."))),
]


@pytest.mark.parametrize("case", FAKE_CHECKS)
def test_fake_tensors_trace_as_real(case: FrameworkCase) -> None:
    """The catalog-width cases above run on fake tensors: at toy width the same model and
    step on fake and on real tensors hold the same bytes in every row."""
    _skip_without(case.library)
    off = [r for r in fake_real_check(case) if r.diff_bytes]
    assert not off, "fake (estimated column) against real (measured):\n" + table(off)


def test_cases_cover_the_libraries() -> None:
    """Every library, both available recipes, a fake and a real case, FSDP ranks, a case that
    passes outright for transformers, and a shape in no catalog."""
    libraries = {c.library for c, _ in CASES}
    assert libraries == {"transformers", "torchtitan", "litgpt"}
    assert {c.recipe for c, _ in CASES} >= {"fp32", "bf16-pure", "fsdp-bf16", "amp-bf16"}
    assert {c.fake for c, _ in CASES} == {True, False}
    assert any(c.dp > 1 for c, _ in CASES)
    assert any(k is None for c, k in CASES if c.library == "transformers")
    assert any(c.name == "llama-h96-mqa" and k is None for c, k in CASES)
