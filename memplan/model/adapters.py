"""LoRA adapters on frozen (optionally quantized) base weights: the policy the linears read.

peft 0.21.2 (``peft/tuners/lora/layer.py``, ``Linear.forward``) wraps each targeted projection:
``result = base_layer(x)``, then ``x = _cast_input_dtype(x, lora_A.weight.dtype)``, ``result =
result + lora_B(lora_A(dropout(x))) * scaling`` and ``result.to(<base output dtype>)``. What
that holds, per adapted projection and micro-batch (the counts ``memplan.model.linear``
makes from here):

- the adapters ``lora_A`` (r x d_in) and ``lora_B`` (d_out x r) in fp32 whatever the base
  dtype: ``get_peft_model(..., autocast_adapter_dtype=True)`` (its default) runs
  ``cast_adapter_dtype`` (``peft/tuners/tuners_utils.py``), which upcasts bf16/fp16 adapter
  parameters to fp32;
- saved for backward: ``lora_A``'s input, the fp32 cast of x (its own copy per projection when
  the base dtype is lower: ``x.to(fp32)`` per call; x itself, shared by the projections that
  read it, when the base is fp32), with dropout P > 0 instead ``native_dropout``'s bool mask
  and output (lora_A's input); ``lora_B``'s input, the rank-r intermediate (fp32);
- the base linear, its weight frozen, saves no input: ``linear``'s autograd saves the input
  only for the weight's gradient (``derivatives.yaml``: ``mm`` saves ``self`` when ``mat2``
  requires grad).

Default targets: peft's ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``
(``peft/utils/constants.py``) gives ``["q_proj", "v_proj"]`` for every family memplan reads
with separate q/k/v projections (llama, mistral, mixtral, qwen2, qwen3, gemma, gemma2,
gemma3_text) and the one fused projection for gpt2 (``["c_attn"]``); ``DEFAULT_TARGETS``
states that as a rule of the model's shape (q and v, or the fused qkv).

Quantized base weights (bitsandbytes 0.50.2, ``bitsandbytes/functional.py``
``quantize_4bit``, ``nn/modules.py`` ``Int8Params``): ``nf4_bytes`` and ``int8_bytes``.

torchao 0.1's ``NF4Tensor`` (``torchao/dtypes/nf4tensor.py``; torchtune pinned
``torchao==0.1`` from its first QLoRA recipe, commit 0914d5cf, ``pyproject.toml``), what
``--base-quant nf4-torchao-0.1`` counts, traced on CPU (``tests/traced/test_torchao_nf4.py``):

- stored (``nf4_torchao_01_bytes``): the packed nibbles (``quantized_data``, uint8, n / 2), an
  int8 scale per block of 64 (``quantized_scalers``), the scales' bf16 quantization factors
  per 256 blocks, kept as a view (``quantization_factor[:, 0]`` in ``double_quantize_scalers``)
  of the whole expanded (n / 64 / 256, 256) bf16 tensor, so n / 64 bf16 elements; the bf16
  mean of the scales and the 16-entry bf16 code (``nf4``), one per weight;
- dequantized (``torchao_dequant_bytes``): ``LinearNF4`` runs ``F.linear(input,
  weight.to(input.dtype))`` in forward and ``grad_output @ weight.to(grad_output.dtype)`` in
  backward; ``.to`` runs ``get_original_weight``, which holds at once both nibbles of every
  byte as int64 indices (8 bytes per weight), the two halves looked up in the code and the two
  scaled by their block's scale (bf16, 2 + 2 bytes per weight), the stacked bf16 result (2)
  and the dequantized block scales (bf16, one per 64 weights): 14 n + n / 32 bytes;
- quantized at load (``torchao_quantize_bytes``): torchtune's ``copy_`` for ``NF4Tensor``
  (``torchtune/utils/_register_nf4_dispatch_ops.py``, ``inplace_copy``) moves the checkpoint's
  bf16 weight to the GPU and runs ``to_nf4`` on it whole: ``quantize_tensor_nearest`` takes
  ``(value.unsqueeze(-1) - nf4).abs()`` over the 16 code values, two (n, 16) bf16 tensors at
  once (64 bytes per weight), beside the bf16 source (2) and the block-scaled copy
  (``convert_to_norm_float_weight``'s ``blocks / scales``, 2), the new scales (int8 and their
  factors' expanded bf16 tensor) and the blocks' bf16 absmax: 68 n + 5 n / 64 + 34 bytes while
  the old weight is still held (later torchao quantizes in chunks of 1024**2 weights, torchao
  commit 6081796b, "This can cause a large memory spike").

torchao's ``NF4Tensor`` as released since 0.3, what ``--base-quant nf4-torchao`` counts
(``torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py`` of torchao 0.18; torchtune's
QLoRA ran it from mid-2024, e.g. torchao 0.5 and 0.6 with its September and November 2024
READMEs), traced on CPU with torchao 0.18 (``tests/traced/test_torchao_nf4_current.py``):

- stored (``nf4_torchao_bytes``): as 0.1's, but ``double_quantize_scalers`` returns the
  factors' first column made contiguous (``quantization_factor.view(n_scaler_blocks)
  .contiguous()``, torchao commit 9dbc5542, in 0.3; 0.2 still kept 0.1's view): one bf16
  element per 256 blocks, n / 8192 bytes;
- dequantized: ``get_original_weight`` and ``LinearNF4`` as 0.1's (``torchao_dequant_bytes``,
  the same bytes traced);
- quantized at load (``torchao_copy_pieces``): ``copy_`` of a bf16 tensor into an
  ``NF4Tensor`` (torchao's ``aten.copy_`` handler since 0.2; torchtune registers its own
  ``inplace_copy`` only for older torchao, ``_register_nf4_dispatch_ops.py``) moves it to
  the device and runs ``from_tensor`` on it, then copies the new pieces into the old ones in
  place; ``convert_to_norm_float_weight``
  takes the nearest code value ``CHUNK_SIZE`` (1024**2) weights at a time into a uint8 buffer
  of one byte per weight, so at once: the source and its block-scaled copy (bf16), that
  buffer, one chunk's two (c, 16) bf16 distance tensors, the block absmax (bf16), the int8
  scales and the factors, the mean and the code: 5 n + 64 c + 3 n / 64 + n / 8192 + 34 bytes;
- sharded by FSDP2 (since 0.2): ``fsdp_pre_all_gather`` gathers the int8 scales, the factors
  and the nibbles (``quant_data_bytes``); the mean and the code are every shard's own.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from memplan.units import FP32_BYTES, DType, ceil_div
from memplan.workload import ALL_LINEAR, LORA_HEAD, BaseQuant, Precision, PrecisionPolicy, Workload

# (the projections a fused one stands for: --lora-targets names the parts)
PARTS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
DEFAULT_TARGETS = ("q", "v")  # peft's mapping for llama, mistral, qwen2, ... (module doc)
ADAPTED_NAMES = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")
HEAD = "head"  # memplan's name of the output projection (memplan.model.head.head_linear)
ADAPTER_BYTES = FP32_BYTES  # autocast_adapter_dtype=True: fp32 adapters (module docstring)

# bitsandbytes 4-bit (functional.py quantize_4bit, blocksize 64 as Params4bit's default and
# QLoRA's; compress_statistics=True: double quantization): two weights per byte, a uint8
# absmax per 64-element block, those absmax quantized blockwise by 256 with an fp32 absmax per
# 256 blocks, an fp32 offset (their mean) and the 16-entry fp32 NF4 code (get_4bit_type makes
# one per weight); the 256-entry dynamic map of the nested quantization is one tensor per
# process (name2qmap["dynamic"]), not counted per weight
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
NF4_CODE_VALUES = 16
# torchao 0.1's NF4Tensor takes bf16 weights only (from_tensor asserts it) and keeps its code,
# scale factors and mean in bf16; get_original_weight indexes the code with int64 indices
BF16_BYTES = DType.BF16.itemsize
# torchao's nf4_tensor.py ``CHUNK_SIZE``: the weights ``convert_to_norm_float_weight`` compares
# with the code at once (since torchao commit 6081796b, in 0.2)
TORCHAO_NF4_CHUNK = 1024**2
# torchtune's ``LoRALinear(quantize_base=True)`` holds torchao's ``NF4Tensor``: either release
TORCHAO_NF4 = (BaseQuant.NF4_TORCHAO_01, BaseQuant.NF4_TORCHAO)
INDEX_BYTES = DType.INT64.itemsize
NF4_CODE_BYTES = NF4_CODE_VALUES * FP32_BYTES
NF4_OFFSET_BYTES = FP32_BYTES


class Projection(Protocol):
    name: str
    d_in: int
    d_out: int
    stack: int


class Adapters(NamedTuple):
    """LoRA on one model: its rank, the projections it adapts (memplan's names, fused ones
    included), its dropout rate and how the frozen base weights are stored."""

    rank: int
    targets: frozenset[str]
    dropout: float = 0.0
    quant: BaseQuant = BaseQuant.NONE
    # compiled layers (``Workload.compile``): the projections reading one tensor share one
    # fp32 cast of it (``linear.adapter_terms``)
    shared_casts: bool = False
    # bytes of an adapter element: fp32 (``ADAPTER_BYTES``), or the model's dtype where the
    # engine casts the adapters (``Workload.adapters_in_model_dtype``: DeepSpeed)
    weight_bytes: int = ADAPTER_BYTES

    def adapts(self, lin: Projection) -> bool:
        """Whether ``lin`` gets an adapter: a targeted projection, or a fused one of which a
        part is targeted (peft adapts the whole module: gpt2's ``c_attn``). Stacked experts
        and routers are no ``nn.Linear``: never."""
        return lin.stack == 1 and lin.name in self.targets

    def quantizes(self, lin: Projection) -> bool:
        """Whether ``lin``'s base weight is stored quantized: bitsandbytes (``load_in_4bit``,
        ``load_in_8bit``) replaces every linear of the decoder; torchtune quantizes only the
        base of a ``LoRALinear(quantize_base=True)`` (its builders at 0914d5cf, ``lora_llama2``:
        "Only applied to base weights within linear layers LoRA is applied to")."""
        if self.quant is BaseQuant.NONE:
            return False
        return self.adapts(lin) if self.quant in TORCHAO_NF4 else True

    def params(self, lin: Projection, d_in: int, d_out: int) -> int:
        """Elements of ``lin``'s adapters at local widths ``d_in`` x ``d_out``: ``lora_A``
        r x d_in and ``lora_B`` d_out x r (0 when not adapted)."""
        return self.rank * (d_in + d_out) if self.adapts(lin) else 0


def adapters_of(wl: Workload, fused_qkv: bool = False) -> Adapters | None:
    """The adapters ``wl`` asks for (None: no LoRA)."""
    if wl.lora_rank == 0:
        return None
    names = wl.lora_targets or (("qkv",) if fused_qkv else DEFAULT_TARGETS)
    if ALL_LINEAR in names:  # peft's "all-linear": every nn.Linear but the output layer
        names = (*ADAPTED_NAMES, *(n for n in names if n in LORA_HEAD))
    # the output projection (memplan.model.head.head_linear, named "head"): torchtune's
    # apply_lora_to_output, peft's target "lm_head"
    targets = {HEAD if n in LORA_HEAD else n for n in names}
    targets |= {fused for fused, parts in PARTS.items() if targets & set(parts)}
    return Adapters(wl.lora_rank, frozenset(targets), wl.lora_dropout, wl.base_quant,
                    wl.compile, adapter_bytes(wl))


def adapter_bytes(wl: Workload) -> int:
    """Bytes of one adapter element: the model's dtype where the engine casts the adapters
    (``Workload.adapters_in_model_dtype``: DeepSpeed's engine.py
    ``_cast_module_mixed_precision``), else fp32 (peft's ``autocast_adapter_dtype``)."""
    return wl.precision.policy.param_bytes if wl.adapters_in_model_dtype else ADAPTER_BYTES


def nf4_bytes(elements: int) -> int:
    """Bytes of one weight of ``elements`` stored as NF4 with double quantization (the
    constants above): packed nibbles, uint8 block absmax, fp32 nested absmax, offset, code."""
    blocks = ceil_div(elements, NF4_BLOCK)
    return (ceil_div(elements, 2) + blocks + ceil_div(blocks, NF4_NESTED_BLOCK) * FP32_BYTES
            + NF4_OFFSET_BYTES + NF4_CODE_BYTES)


def nf4_torchao_01_bytes(elements: int) -> int:
    """Bytes of one weight of ``elements`` as torchao 0.1's ``NF4Tensor`` stores it (module
    docstring): nibbles, int8 block scales, their factors' whole bf16 tensor (one element per
    block), the bf16 mean and the 16-entry bf16 code."""
    blocks = ceil_div(elements, NF4_BLOCK)
    return ceil_div(elements, 2) + blocks + blocks * BF16_BYTES + BF16_BYTES + 16 * BF16_BYTES


def nf4_torchao_bytes(elements: int) -> int:
    """Bytes of one weight of ``elements`` as torchao's ``NF4Tensor`` stores it since 0.3
    (module docstring): nibbles, int8 block scales, one bf16 factor per 256 blocks, the bf16
    mean and the 16-entry bf16 code. 1024 x 1024 by hand: 524,288 + 16,384 + 128 + 2 + 32 =
    540,834."""
    blocks = ceil_div(elements, NF4_BLOCK)
    return (ceil_div(elements, 2) + blocks + ceil_div(blocks, NF4_NESTED_BLOCK) * BF16_BYTES
            + BF16_BYTES + NF4_CODE_VALUES * BF16_BYTES)


def torchao_copy_pieces(elements: int) -> list[int]:
    """The tensors alive at once while ``copy_`` quantizes a bf16 weight of ``elements`` into
    an ``NF4Tensor`` on the device (torchao since 0.3; module docstring), in the order they
    are made: the moved source, the code, the int8 scales, their factors, the mean, the
    block absmax, the block-scaled copy, the uint8 index buffer and one chunk's two distance
    tensors. Their sum is the working set traced at its peak."""
    blocks = ceil_div(elements, NF4_BLOCK)
    chunk = min(elements, TORCHAO_NF4_CHUNK)
    return [elements * BF16_BYTES, NF4_CODE_VALUES * BF16_BYTES, blocks,
            ceil_div(blocks, NF4_NESTED_BLOCK) * BF16_BYTES, BF16_BYTES, blocks * BF16_BYTES,
            elements * BF16_BYTES, elements,
            chunk * NF4_CODE_VALUES * BF16_BYTES, chunk * NF4_CODE_VALUES * BF16_BYTES]


def torchao_chunked_quantize_bytes(elements: int) -> int:
    """Bytes ``copy_`` holds at once while it quantizes a bf16 weight of ``elements`` (torchao
    since 0.3): ``torchao_copy_pieces`` summed. 1024 x 1024 by hand: 5 x 1,048,576 + 64 x
    1,048,576 + 3 x 16,384 + 128 + 34 = 72,401,058."""
    return sum(torchao_copy_pieces(elements))


def torchao_dequant_bytes(elements: int) -> int:
    """Bytes alive at the end of torchao's ``get_original_weight`` for a weight of
    ``elements`` (module docstring): int64 indices of both nibbles (8 per weight), the looked-up
    and the scaled halves (2 + 2), the stacked bf16 weight (2), the bf16 block scales."""
    return (INDEX_BYTES + 3 * BF16_BYTES) * elements + ceil_div(elements, NF4_BLOCK) * BF16_BYTES


def torchao_quantize_bytes(elements: int) -> int:
    """Bytes ``to_nf4`` holds at once, torchao 0.1, for a bf16 weight of ``elements`` on the
    device (module docstring): the source and its block-scaled copy (bf16), the two (n, 16)
    bf16 distance tensors, the int8 scales, their factors' expanded bf16 tensor and the blocks'
    bf16 absmax, the scales' mean and the code."""
    blocks = ceil_div(elements, NF4_BLOCK)
    return ((2 + 2 * NF4_CODE_VALUES) * BF16_BYTES * elements
            + blocks + 2 * blocks * BF16_BYTES + BF16_BYTES + NF4_CODE_VALUES * BF16_BYTES)


def int8_bytes(d_in: int, d_out: int) -> int:
    """Bytes of one ``Linear8bitLt`` weight (d_out x d_in): int8 rows (``Int8Params.CB`` is
    the weight's data) and an fp32 absmax scale per output row (``SCB``,
    ``int8_vectorwise_quant``)."""
    return d_in * d_out + d_out * FP32_BYTES


def base_weight_bytes(quant: BaseQuant, d_in: int, d_out: int, dtype_bytes: int) -> int:
    """Bytes of one frozen d_out x d_in base weight as stored."""
    if quant is BaseQuant.NF4:
        return nf4_bytes(d_in * d_out)
    if quant is BaseQuant.INT8:
        return int8_bytes(d_in, d_out)
    if quant is BaseQuant.NF4_TORCHAO_01:
        return nf4_torchao_01_bytes(d_in * d_out)
    if quant is BaseQuant.NF4_TORCHAO:
        return nf4_torchao_bytes(d_in * d_out)
    return d_in * d_out * dtype_bytes


def quant_data_bytes(quant: BaseQuant, d_in: int, d_out: int) -> int:
    """Of ``base_weight_bytes`` of a quantized weight, the parameter's own data, which FSDP
    shards and gathers: NF4's packed nibbles (``bnb_4bit_quant_storage=torch.bfloat16``, as
    FSDP-QLoRA sets it, types the same bytes as bf16 so that a unit flattens as one dtype;
    ``Params4bit`` data of shape (n / 4, 1)), LLM.int8's int8 rows. The rest, the
    ``quant_state`` (absmax, nested absmax, offset, code) or ``SCB``, are attributes of the
    parameter, not parameters: FSDP neither shards nor gathers them, every rank keeps them
    whole on its device (``Linear4bit.quant_state`` is kept on the module for that:
    ``fix_4bit_weight_quant_state_from_module``, bitsandbytes/nn/modules.py), and
    ``CPUOffloadPolicy``, which moves parameters only, leaves them on the device. torchao's
    ``NF4Tensor`` since 0.3 shards and gathers its int8 scales and their factors with the
    nibbles (``fsdp_pre_all_gather``); its mean and code are each shard's own."""
    if quant in (BaseQuant.NF4, BaseQuant.NF4_TORCHAO_01):
        return ceil_div(d_in * d_out, 2)
    if quant is BaseQuant.NF4_TORCHAO:  # all it stores but the mean and the code
        return nf4_torchao_bytes(d_in * d_out) - BF16_BYTES - NF4_CODE_VALUES * BF16_BYTES
    if quant is BaseQuant.INT8:
        return d_in * d_out
    return 0


def assumptions(wl: Workload) -> tuple[str, ...]:
    """The estimate's assumption lines for LoRA and quantized base weights (none without)."""
    if wl.lora_rank == 0:
        return ()
    targets = ",".join(wl.lora_targets) if wl.lora_targets else (
        "peft's default (q,v; a fused qkv whole)")
    base = {BaseQuant.NONE: f"in {wl.precision.policy.params.value}",
            BaseQuant.NF4: "NF4 with double quantization (bitsandbytes Linear4bit, blocks of "
                           "64, absmax quantized by 256); embedding, norms and head in "
                           f"{wl.precision.policy.params.value}",
            BaseQuant.INT8: "int8 with an fp32 scale per row (bitsandbytes Linear8bitLt); "
                            "embedding, norms and head in "
                            f"{wl.precision.policy.params.value}",
            BaseQuant.NF4_TORCHAO_01: "NF4 as torchao 0.1's NF4Tensor (blocks of 64, scales "
                                      "quantized by 256; dequantized by PyTorch ops in "
                                      "forward and backward; each weight quantized whole on "
                                      "the GPU at load); embedding, norms and head in "
                                      f"{wl.precision.policy.params.value}",
            BaseQuant.NF4_TORCHAO: "NF4 as torchao's NF4Tensor since 0.3 (blocks of 64, "
                                   "scales quantized by 256; dequantized by PyTorch ops in "
                                   "forward and backward; each weight quantized at load "
                                   "1024**2 weights at a time, its working set replayed "
                                   "once per weight after the weights are made, the "
                                   "model's construction not replayed: torchtune's FSDP2 "
                                   "recipes load into a model built on the meta device, "
                                   "where fewer weights are alive then, so there the load's "
                                   "peak is an upper bound); only the adapted linears; "
                                   "embedding, norms and head in "
                                   f"{wl.precision.policy.params.value}"}[wl.base_quant]
    master = (", with fp32 master copies" if wl.precision.policy.master is not None else "")
    dtype = (f"adapters in the model's {wl.precision.policy.params.value}{master} (cast by "
             f"DeepSpeed's _cast_module_mixed_precision, or built in it as torchtune's "
             f"LoRALinear)" if wl.adapters_in_model_dtype
             else "adapters in fp32 (peft's autocast_adapter_dtype)")
    return (f"LoRA rank {wl.lora_rank} on {targets}, dropout {wl.lora_dropout:g}: {dtype}, "
            f"the only parameters with gradients and optimizer states; frozen base weights "
            f"{base}",)


def adapter_policy(wl: Workload) -> PrecisionPolicy:
    """The precision the adapters train in: fp32, updated directly (no master copy: peft's
    autocast_adapter_dtype); where the engine cast them to the model's dtype
    (``Workload.adapters_in_model_dtype``: DeepSpeed), or where they were built in it
    (torchtune), the workload's own, its gradients in
    that dtype beside an fp32 master copy and the states (the ZeRO optimizer's fp32
    partitions of the trainable parameters: stage3.py ``_create_fp32_partitions``,
    stage_1_and_2.py ``single_partition_of_fp32_groups``)."""
    return wl.precision.policy if wl.adapters_in_model_dtype else Precision.FP32.policy
