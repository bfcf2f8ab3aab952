"""Transformer Engine's quantized tensors under each fp8 recipe (``Workload.te_fp8``): the
bytes of one rows x cols tensor cast to fp8, per orientation, and what a TE module keeps of
its recipe's state. Which tensors a projection saves and keeps is ``memplan.model.linear``'s
(``te_fp8_saved_terms``, ``te_fp8_weight_bytes``); this module is the tensors' layouts alone.

Read from Transformer Engine v2.9 (tag v2.9, commit 70f536662ae10a62a54f4ed1ba92e3314c5cfd69),
``transformer_engine/pytorch/``, and checked against the commit Megatron-LM's functional tests
ran with when their golden values were last recorded (uv.lock at Megatron-LM 4828d651:
transformer-engine 2.16.0+4220403e, commit b9d690e042b1c4e455214e7dab65d6d3512c05d6), where
the same layouts are made in C++ (``csrc/quantizer.cpp``, ``Float8Quantizer::create_tensor``:
``uint8`` data, a ``uint8`` transpose unless ``nvte_is_non_tn_fp8_gemm_supported()``, an fp32
``scale_inv`` of shape {1}) and ``get_scale_shape`` of the mxfp8 and blockwise quantizers:

- delayed and tensorwise (``tensor/float8_tensor.py``, ``Float8Quantizer.make_empty`` and
  ``Float8CurrentScalingQuantizer.make_empty``): the data, ``torch.uint8`` in the tensor's
  shape; the columnwise copy a separate transposed ``uint8`` tensor (``data_transpose``); one
  fp32 ``scale_inv`` of shape (1,) shared by both. On Hopper (sm_90) the GEMM takes only
  "TN" layouts, so the columnwise copy is a real transpose
  (``tensor/storage/float8_tensor_storage.py`` ``update_usage``: without
  ``is_non_tn_fp8_gemm_supported()`` it creates ``_transpose``); from Blackwell (sm_100) on
  the rowwise data serves both and no transpose is made. memplan models the Hopper layout.
- mxfp8 (``tensor/mxfp8_tensor.py`` ``MXFP8Quantizer.make_empty``): rowwise data and
  ``uint8`` scales of (roundup(rows, 128), roundup(cols / 32, 4)); columnwise data in the
  same shape and scales of (roundup(rows / 32, 4), roundup(cols, 128)).
- blockwise (``tensor/float8_blockwise_tensor.py`` ``Float8BlockQuantizer.get_scale_shape``
  and ``make_empty``): data per orientation (the columnwise transposed) and fp32 scales: for
  weights 128x128 blocks (``block_scaling_dim`` 2, the recipe's ``w_block_scaling_dim``)
  (ceil(rows / 128), roundup(ceil(cols / 128), 4)) rowwise and (ceil(cols / 128),
  roundup(ceil(rows / 128), 4)) columnwise; for activations and gradients 1x128 blocks
  (``x_block_scaling_dim`` 1) (ceil(cols / 128), roundup(rows, 4)) rowwise and
  (ceil(rows / 128), roundup(cols, 4)) columnwise (GEMM-ready; the compact all-gather format
  drops the padding of 4).
"""

from __future__ import annotations

from memplan.hardware import GpuSpec
from memplan.units import FP32_BYTES
from memplan.workload import TeFp8Recipe, Workload

FP8_BYTES = 1  # every fp8 cast is torch.uint8 data (make_empty of each quantizer)
MXFP8_BLOCK = 32  # MXFP8_BLOCK_SCALING_SIZE (tensor/mxfp8_tensor.py)
MXFP8_SCALE_BYTES = 1  # an E8M0 scale, torch.uint8
BLOCK_LEN = 128  # Float8BlockQuantizer.block_len
# per-tensor recipes: one scale_inv for the tensor, whichever copies it holds
PER_TENSOR = (TeFp8Recipe.DELAYED, TeFp8Recipe.TENSORWISE)
# quantizers of one TE module of one GEMM: input, weight and output in forward, grad_output
# and grad_input in backward (module/base.py ``init_fp8_meta_tensors``: ``num_gemms * 3``
# forward, ``num_gemms * 2`` backward)
FORWARD_QUANTIZERS, BACKWARD_QUANTIZERS = 3, 2


# the first compute capability whose fp8 GEMMs take non-TN layouts (TE's
# ``nvte_is_non_tn_fp8_gemm_supported``, common/util: sm_100 and above): no transposes kept
NON_TN_MAJOR = 10


def for_gpu(wl: Workload, gpu: GpuSpec) -> Workload:
    """``wl`` with ``te_fp8_transposes`` decided by ``gpu`` where left None: TE keeps
    transposed columnwise copies of per-tensor fp8 tensors below compute capability 10
    (Hopper), none from Blackwell on."""
    if wl.te_fp8 is TeFp8Recipe.NONE or wl.te_fp8_transposes is not None:
        return wl
    major = int(gpu.compute_capability.split(".")[0])
    return wl.model_copy(update={"te_fp8_transposes": major < NON_TN_MAJOR})


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _ceil(n: int, m: int) -> int:
    return -(-n // m)


def scale_bytes(recipe: TeFp8Recipe, rows: int, cols: int, *, columnwise: bool,
                weight: bool) -> int:
    """Bytes of the scales of one orientation of a rows x cols fp8 tensor (a per-tensor
    recipe's one scale counted by ``quantized_bytes``, not here)."""
    if recipe is TeFp8Recipe.MXFP8:
        if columnwise:
            return _up(rows // MXFP8_BLOCK, 4) * _up(cols, 128) * MXFP8_SCALE_BYTES
        return _up(rows, 128) * _up(cols // MXFP8_BLOCK, 4) * MXFP8_SCALE_BYTES
    if recipe is TeFp8Recipe.BLOCKWISE:
        if weight:
            outer, inner = (cols, rows) if columnwise else (rows, cols)
            return _ceil(outer, BLOCK_LEN) * _up(_ceil(inner, BLOCK_LEN), 4) * FP32_BYTES
        if columnwise:
            return _ceil(rows, BLOCK_LEN) * _up(cols, 4) * FP32_BYTES
        return _ceil(cols, BLOCK_LEN) * _up(rows, 4) * FP32_BYTES
    return 0


def quantized_bytes(recipe: TeFp8Recipe, rows: int, cols: int, *, rowwise: bool,
                    columnwise: bool, weight: bool = False, transposes: bool = True) -> int:
    """Bytes of a rows x cols tensor cast to fp8 holding the copies asked for: one byte an
    element per copy, with its scales (``scale_bytes``; one fp32 ``scale_inv`` for a
    per-tensor recipe, whose columnwise use needs a transposed copy only with
    ``transposes``: else its data serves both, ``Float8TensorStorage.update_usage``)."""
    copies = int(rowwise) + int(columnwise)
    if copies == 0 or recipe is TeFp8Recipe.NONE:
        return 0
    if recipe in PER_TENSOR:
        copies = copies if transposes else 1
        return copies * rows * cols * FP8_BYTES + FP32_BYTES
    data = copies * rows * cols * FP8_BYTES
    return (data + (scale_bytes(recipe, rows, cols, columnwise=False, weight=weight)
                    if rowwise else 0)
            + (scale_bytes(recipe, rows, cols, columnwise=True, weight=weight)
               if columnwise else 0))


def module_state_bytes(recipe: TeFp8Recipe, amax_history_len: int) -> int:
    """What one TE module of one GEMM keeps of its recipe's state, on the device for the whole
    run. delayed (``quantization.py`` ``DelayedScalingRecipeState``): per direction an fp32
    ``scale`` per quantizer and an fp32 ``amax_history`` of ``amax_history_len`` rows per
    quantizer. The other recipes' quantizers hold no tensor at b9d690e
    (``Float8CurrentScalingQuantizer.__init__`` ignores ``scale`` and ``amax``; v2.9 still
    kept an fp32 scale and amax of shape (1,) per quantizer, 40 B a module)."""
    if recipe is TeFp8Recipe.DELAYED:
        return (FORWARD_QUANTIZERS + BACKWARD_QUANTIZERS) * (amax_history_len + 1) * FP32_BYTES
    return 0
