"""torchao's float8 grouped GEMM for routed experts, as torchtitan applies it to MoE layers.

torchtitan 0.3.0's ``Float8GroupedExpertsConverter`` (``components/quantization/float8.py``,
``_get_float8_grouped_experts_cls``) runs ``quantize_(experts, Float8TrainingOpConfig())``
on each ``GroupedExperts``: torchao 0.18's ``_moe_training_transform``
(``prototype/moe_training/config.py``) wraps the expert weights in a
``Float8TrainingWeightWrapperTensor`` (``prototype/moe_training/tensor.py``), whose
``__torch_function__`` sends each ``torch._grouped_mm(A, B_t, offs=...)`` with a 2D ``A`` to
``_quantize_then_scaled_grouped_mm``, i.e. ``_Float8GroupedMM``
(``prototype/moe_training/fp8_grouped_mm.py``), rowwise scales only
(``Float8TrainingRecipe.FP8_ROWWISE``), with ``pad_token_groups_for_grouped_mm`` False
(its ``forward`` asserts it).

What it holds, for a grouped matmul of ``A`` (M routed rows x K) by this rank's ``E``
experts' ``B_t`` (E x K x N), in ``_Float8GroupedMM``:

- saved for backward: ``padded_A`` (``A`` itself: no padding) and ``B_t`` (a view of the
  weight) and the offsets: the same tensors a bf16 ``_grouped_mm`` saves, so the block's
  saved terms do not change;
- at the forward's ``_scaled_grouped_mm``: ``A``'s float8 rows and fp32 scales (M, 1)
  (``triton_fp8_rowwise_2d_scale_and_cast``), ``B_t``'s float8 copy and fp32 scales (E, 1, N)
  (``triton_fp8_colwise_3d_scale_and_cast``), both scales' ``reciprocal()``, and the output;
  all locals freed when the forward returns;
- at the backward's weight-gradient ``_scaled_grouped_mm``, every local still alive (the
  function returns after it): ``grad_output``'s float8 rows and scales (M, 1), ``B_t``'s
  transposed float8 copy and scales (E, K) (``triton_fp8_rowwise_3d_transpose_rhs``), their
  reciprocals (unnamed arguments, freed when that call returns), ``grad_A`` (M x K in
  ``out_dtype`` bf16), then ``grad_output``'s and ``A``'s
  per-group column-wise float8 copies with G*N and G*K fp32 scales
  (``triton_fp8_per_group_colwise_scales_dual``, G the offsets' length: one group per local
  expert), their reciprocals, and ``grad_B`` (E x N x K, bf16).

The four Triton kernels do not run on CPU; the autograd function runs there under fake
tensors with each kernel standing in as the shapes its ``register_fake`` gives (traced:
tests/traced/test_float8_grouped.py). The FSDP2 all-gather of the wrapped weights is in the
parameters' dtype (``TrainingWeightWrapperBaseTensor.fsdp_pre_all_gather`` casts to
``mp_policy.param_dtype``): no float8 all-gather of experts.
"""

from __future__ import annotations

from memplan.model.linear import FLOAT8_BYTES, FLOAT8_SCALE_BYTES

# each scale is read through its reciprocal, a second fp32 tensor of its shape
# (``torch._scaled_grouped_mm(..., A_scales.reciprocal(), B_t_scales.reciprocal(), ...)``)
_SCALE_AND_RECIPROCAL = 2 * FLOAT8_SCALE_BYTES


def forward_bytes(rows: int, d_in: int, d_out: int, experts: int) -> int:
    """Bytes the float8 casts hold at a grouped matmul's forward ``_scaled_grouped_mm``,
    beyond its input, weight and output: ``A``'s float8 copy (rows x d_in) with one scale per
    row, the weights' (experts x d_in x d_out) with one per expert and output column, and each
    scale's reciprocal."""
    return (rows * d_in * FLOAT8_BYTES + rows * _SCALE_AND_RECIPROCAL
            + experts * d_in * d_out * FLOAT8_BYTES + experts * d_out * _SCALE_AND_RECIPROCAL)


def backward_bytes(rows: int, d_in: int, d_out: int, experts: int) -> int:
    """Bytes the float8 casts hold at a grouped matmul's weight-gradient ``_scaled_grouped_mm``
    (the backward's last op, its largest instant), beyond its saved tensors, the output's
    gradient and the two high-precision gradients it makes (``grad_A``, ``grad_B``): for the
    input's gradient ``grad_output``'s float8 rows (rows x d_out, a scale per row) and the
    weights' transposed float8 copy (a scale per expert and input column); for the weights'
    gradient ``grad_output``'s and ``A``'s column-wise float8 copies with a scale per group
    (one group per local expert) and column, with their reciprocals (arguments of the call;
    the first matmul's reciprocals, unnamed, were freed when it returned)."""
    grad_a_casts = (rows * d_out * FLOAT8_BYTES + rows * FLOAT8_SCALE_BYTES
                    + experts * d_in * d_out * FLOAT8_BYTES + experts * d_in * FLOAT8_SCALE_BYTES)
    grad_b_casts = (rows * (d_out + d_in) * FLOAT8_BYTES
                    + experts * (d_out + d_in) * _SCALE_AND_RECIPROCAL)
    return grad_a_casts + grad_b_casts
