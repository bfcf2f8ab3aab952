"""LoRA and QLoRA against peft's and bitsandbytes' own code, traced on CPU.

Each case builds a transformers model cut to two layers (``memplan.profile.finetune.
build_peft``), wraps it with ``peft.get_peft_model`` (its defaults: fp32 adapters), optionally
quantizes the decoder's linears with bitsandbytes, and runs two training steps under the exact
tensor tracker (AdamW(fused) over the adapters, ``zero_grad(set_to_none=True)``, gradient
clipping, as ``transformers.Trainer`` steps). memplan's estimate is described only by the
recipe, the batch and the fine-tuning options (``lora_rank``, ``lora_targets``,
``lora_dropout``, ``base_quant``, full recompute for gradient checkpointing): weights,
gradients and optimizer states to the byte, saved activations and every phase peak of the
first and the steady step within 1% (``known.check``).

bitsandbytes on CPU: NF4 runs its CPU backend (``backends/cpu``, ``backends/default``): the
forward's ``gemm_4bit`` is one custom op there, as on CUDA, and the backward's
``dequantize_4bit`` a visible op; the int8 case runs ``MatMul8bitFp``, bitsandbytes' CPU/XPU
training path (``autograd/_functions.py``), which keeps the input as CUDA's ``MatMul8bitLt``
does (``ctx.A``; ``ctx.tensors = (CAt, subA, A)``); CUDA's outlier columns (``subA``, data
dependent, threshold 6.0) have no CPU counterpart and are not modelled.

Versions traced: peft 0.21.2, bitsandbytes 0.50.2, transformers 5.3.0, torch 2.13.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from hf_configs import LLAMA3_TOY, hf  # tests/traced/hf_configs.py
from known import check, param  # tests/traced/known.py
from memplan.profile import finetune  # noqa: F401 (registers the "peft" builder)
from memplan.profile.frameworks import FrameworkCase
from recorded import compare_framework  # tests/traced/recorded.py


# a wide MLP over a small vocabulary: the adapters' fp32 transients in the MLP are the forward
# and backward peaks, not the loss
LLAMA_WIDE = dict(LLAMA3_TOY, intermediate_size=4096, vocab_size=256)
GPT2_TOY = dict(n_layer=2, n_embd=256, n_head=4, vocab_size=1000, attn_pdrop=0.0)
LLAMA = hf("Meta-Llama-3-8B", **LLAMA3_TOY)
GPT2 = hf("gpt2", use_cache=False, **GPT2_TOY)


def case(config: dict, name: str, recipe: str, **options) -> FrameworkCase:
    return FrameworkCase("peft", name, config, recipe, 2, 128, options=options)


CASES = [
    # peft's default targets (q_proj, v_proj), bf16 base, fp32 adapters: each adapter saves
    # its own fp32 cast of the input
    case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8),
    # every linear, dropout: a bool mask and the fp32 dropout output per adapter, none in the
    # first layer's attention (its input does not require grad)
    case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8, lora_targets="all-linear",
         lora_dropout=0.1),
    # fp32 base: lora_A saves the base's input itself, one tensor for q and v
    case(LLAMA, "llama3-toy", "fp32", lora_rank=8, lora_targets="q,v,o"),
    # gradient checkpointing as transformers and peft enable it (enable_input_require_grads)
    case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8, gc=True),
    # peft's method_comparison loop: the model's output (bf16 logits) held through backward
    # and the step, replaced after the next model call (--logits-held output)
    case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8, hold_outputs=True),
    case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8, lora_targets="all-linear",
         hold_outputs=True),
    # QLoRA: NF4 with double quantization on the CPU backend
    case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=16, lora_targets="all-linear",
         base_quant="nf4"),
    case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8, base_quant="nf4", gc=True),
    # LLM.int8: the base keeps its input
    case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8, lora_targets="all-linear",
         base_quant="int8"),
    case(hf("Meta-Llama-3-8B", **LLAMA_WIDE), "llama-wide-mlp", "bf16-pure", lora_rank=8,
         lora_targets="all-linear"),
    # LoRA on the output projection (peft's "lm_head", --lora-targets output): the frozen
    # base head saves no input, lora_A its fp32 cast; the adapter's fp32 logits-sized sum in
    # forward and its fp32 gradient and scaled copy in backward; a larger vocabulary makes
    # them the peaks
    case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8, lora_targets="q,v,output"),
    case(hf("Meta-Llama-3-8B", **dict(LLAMA3_TOY, vocab_size=8000)), "llama3-toy-v8000",
         "bf16-pure", lora_rank=8, lora_targets="q,v,output"),
    # fp32 base: lora_A saves the final norm's output itself
    case(LLAMA, "llama3-toy", "fp32", lora_rank=8, lora_targets="q,v,lm_head"),
    # dropout: the mask and fp32 dropout output saved, the fp32 cast alive in forward
    case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8,
         lora_targets="q,k,v,o,gate,up,down,output", lora_dropout=0.1),
    # GPT-2: the one fused c_attn adapted (peft's default), Conv1D weights, LayerNorm
    case(GPT2, "gpt2-toy", "bf16-pure", lora_rank=8),
    case(GPT2, "gpt2-toy", "fp32", lora_rank=8, lora_dropout=0.05),
]


# peft's LoRA on every linear under gradient checkpointing (the usual LoRA/QLoRA recipe): the
# checkpointed forward holds each adapter's fp32 tensors beside the MLP's working set
# (``mlp._lora_working_bytes``: at up's adapter sum the activation's and up's outputs, x's fp32
# cast bound to peft's local x, lora_B's output and its scaled copy). Before it the forward
# read -3.87% (llama3-toy) and -23.54% (the wide MLP). The backward's peak is a layer's rerun
# at up's adapter sum (``Mlp.rebuild_moments``) beside the gradients of the down projection's
# adapter sum, made before the rerun starts (``mlp.rerun_pending_bytes``), and the
# post-attention residual: step 1's backward -2.92% -> +0.05% (toy), -0.70% -> +0.00% (wide)
LORA_GC = case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8, lora_targets="all-linear", gc=True)
# adapters on gate and up only: the frozen down projection's input gradient (the product's)
# is made before the rerun starts, then the rerun reaches up's adapter sum (it read -6.97%)
GATE_UP_GC = case(LLAMA, "llama3-toy", "bf16-pure", lora_rank=8, lora_targets="gate,up", gc=True)
GC_CASES = [
    (LORA_GC, None),
    (GATE_UP_GC, None),
    # fp32 base: the adapters share the input, no cast; the product saved by down's lora_A
    (case(LLAMA, "llama3-toy", "fp32", lora_rank=8, lora_targets="all-linear", gc=True), None),
    # dropout: the rerun stops at down's lora_B pack with the product, its fp32 cast and
    # dropout's output and mask alive (it read -6.72%)
    (case(hf("Meta-Llama-3-8B", **LLAMA_WIDE), "llama-wide-mlp", "bf16-pure", lora_rank=8,
          lora_targets="all-linear", lora_dropout=0.1, gc=True), None),
    (case(hf("Meta-Llama-3-8B", **LLAMA_WIDE), "llama-wide-mlp", "bf16-pure", lora_rank=8,
          lora_targets="all-linear", gc=True), None),
]


@pytest.mark.parametrize(("case", "known"), [param(c, None) for c in CASES]
                         + [param(c, k) for c, k in GC_CASES])
def test_peft_matches_estimate(case: FrameworkCase, known) -> None:
    if case.options.get("base_quant", "none") != "none":
        pytest.importorskip("bitsandbytes")
    check(compare_framework(case).rows, known)


def fsdp(dp: int, **options) -> FrameworkCase:
    return FrameworkCase("peft", "llama3-toy", LLAMA, "bf16-pure", 2, 128, dp=dp,
                         options=options)


# The peft model under FSDP2 (``fully_shard`` on each decoder layer, then the root), rank 0 of
# ``dp`` on the fake process group, estimated as zero 3 on ``dp`` GPUs: the shards of the bf16
# base, the NF4 data (bf16 storage, FSDP-QLoRA) and the fp32 adapters; the quant_state whole on
# every rank; units gathered as stored; only the adapters' gradients reduce-scattered.
# With every linear adapted under FSDP2 the forward peaks in the last layer's MLP (the down
# projection's adapter): there the layer's input stays alive beside the post-attention
# residual (memplan.model.layer.forward_moments; was -1.44%, 261,248 B under, as in the
# single-device llama-wide-mlp case above, -0.58%)
FSDP_CASES = [
    (fsdp(2, lora_rank=8), None),
    (fsdp(4, lora_rank=8), None),
    (fsdp(2, lora_rank=8, lora_targets="all-linear"), None),
    (fsdp(2, lora_rank=8, lora_targets="all-linear", base_quant="nf4"), None),
    (fsdp(4, lora_rank=16, lora_targets="all-linear", base_quant="nf4"), None),
]


@pytest.mark.parametrize(("case", "known"), [param(c, k) for c, k in FSDP_CASES])
def test_peft_fsdp2_matches_estimate(case: FrameworkCase, known) -> None:
    """LoRA and QLoRA under FSDP2 on CPU: bitsandbytes' ``Params4bit`` (bf16 storage) shards
    and gathers as a plain tensor; ``Linear4bit.forward`` restores its quant_state from the
    module (``fix_4bit_weight_quant_state_from_module``)."""
    if case.options.get("base_quant", "none") != "none":
        pytest.importorskip("bitsandbytes")
    check(compare_framework(case).rows, known)


def test_default_targets_are_peft_mapping() -> None:
    """memplan's default targets (q and v, or a fused qkv whole) are peft's
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for the families memplan reads."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as M

    for family in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2",
                   "gemma3_text"):
        assert M[family] == ["q_proj", "v_proj"], family
    assert M["gpt2"] == ["c_attn"]  # GPT-2's fused q/k/v projection


def test_peft_fsdp2_cpu_offload_policy() -> None:
    """LoRA (q, v) under FSDP2 with ``CPUOffloadPolicy`` on 2 ranks: the sharded bf16 base, the
    fp32 adapters' shards, their gradients and AdamW's states and step counts are host memory;
    the device holds the gathered units, activations and buffers. Forward and backward peaks
    within 1%; the host exactly what the trace put there (sharded weights 2,243,840 B,
    gradients 26,624, states and the 8 step counts 53,280: 2,323,744). The optimizer phase
    holds only the loss's and buffers' few bytes on the device (2,176), which the estimate
    does not place in it."""
    c = compare_framework(fsdp(2, lora_rank=8, offload="params"))
    rows = {r.name: r for r in c.rows}
    for step in ("first_step", "steady"):
        for phase in ("forward", "backward"):
            assert abs(rows[f"{step}.{phase}_bytes"].diff_pct) <= 1.0, rows
        assert rows[f"{step}.optimizer_bytes"].measured_bytes <= 4096
    host = c.trace.steady.phases["optimizer"].by_category
    stage = c.estimate.stages[0]
    assert stage.params_bytes == stage.grads_bytes == stage.optimizer_bytes == 0
    assert stage.host_bytes == host["parameters"] + host["gradients"] + host["optimizer"]
    assert stage.host_bytes == 2_323_744
