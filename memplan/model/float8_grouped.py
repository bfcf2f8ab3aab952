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
tests/traced/test_torchao_float8_grouped.py). The FSDP2 all-gather of the wrapped weights is in the
parameters' dtype (``TrainingWeightWrapperBaseTensor.fsdp_pre_all_gather`` casts to
``mp_policy.param_dtype``): no float8 all-gather of experts.

The MoE block (``memplan.model.moe``, grouped experts) reads ``forward_moments``,
``working_bytes`` and ``backward_moments``, over its balanced T*k routed rows and this rank's
num_experts / ep experts. Not counted: the shared experts' and a router's ``Float8Linear``
casts (torchtitan converts the linears of an MoE layer too, unless ``filter_fqns`` names
them: its DeepSeek-V3 float8 config filters ``router.gate``), transients of a few bytes a
token beside the experts'; under EP, the padding of each expert's rows to a multiple of 16
(``components/quantization/utils.py`` ``swap_token_dispatcher``: ``TorchAOTokenDispatcher``
with ``pad_multiple`` 16, at most 15 rows an expert).
"""

from __future__ import annotations

from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import Dims, Term
from memplan.model.linear import FLOAT8_BYTES, FLOAT8_SCALE_BYTES
from memplan.spec import ModelSpec, MoESpec
from memplan.workload import Float8Recipe

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


def _moe(spec: ModelSpec) -> MoESpec:
    assert spec.moe is not None, "grouped experts need spec.moe"
    return spec.moe


def _mms(spec: ModelSpec, dm: Dims) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Grouped experts under float8: the (input, output)
    widths on this rank of the input projections' grouped matmuls (gate and up fused with
    ``stacked_experts``, else each its own) and of the down projection's."""
    moe, h = _moe(spec), spec.hidden_size
    f = moe.expert_ffn_hidden_size // dm.experts().tp
    if not spec.mlp.gated:
        return [(h, f)], (f, h)
    return ([(h, 2 * f)] if moe.stacked_experts else [(h, f), (h, f)]), (f, h)


def forward_moments(spec: ModelSpec, dm: Dims, terms: list[Term]) -> list[Moment]:
    """Grouped experts as torchao's float8 grouped GEMMs, forward: at the last input
    projection's matmul its casts (``forward_bytes``) and output beside what
    the block saved by then (through the dispatched rows, and the gate's terms where gate and
    up are two matmuls); at the down projection's, its casts and output beside every expert
    term. None without float8."""
    if dm.float8 is Float8Recipe.NONE:
        return []
    moe, e = _moe(spec), dm.e
    rows, local = dm.tokens * moe.top_k, moe.num_experts // dm.ep
    ins, (f, h) = _mms(spec, dm)
    names = [t.name for t in terms]
    dispatched = sum(t.size_bytes for t in terms[:names.index("moe.dispatched") + 1])
    gate = sum(t.size_bytes for t in terms if t.name in ("moe.expert.gate", "moe.expert.act"))
    experts = sum(t.size_bytes for t in terms if t.name.startswith("moe.expert."))
    d_in, d_out = ins[-1]
    return [Moment("moe_f8_in", dispatched + (gate if len(ins) > 1 else 0),
                   forward_bytes(rows, d_in, d_out, local) + rows * d_out * e),
            Moment("moe_f8_down", dispatched + experts,
                   forward_bytes(rows, f, h, local) + rows * h * e)]


def working_bytes(spec: ModelSpec, dm: Dims) -> int:
    """The grouped experts' checkpointed forward (``memplan.model.moe._grouped_working``,
    nothing saved) at the float8 grouped GEMMs: the gathered rows and their sorted copy,
    and at the input projections' matmul its casts and output (the
    gate's output and activation beside it where gate and up are two), at the down
    projection's its input (the product), casts and output. 0 without float8."""
    if dm.float8 is Float8Recipe.NONE:
        return 0
    moe, e = _moe(spec), dm.e
    rows, local = dm.tokens * moe.top_k, moe.num_experts // dm.ep
    ins, (f, h) = _mms(spec, dm)
    d_in, d_out = ins[-1]
    inner = rows * f * e
    first = forward_bytes(rows, d_in, d_out, local) + rows * d_out * e \
        + (2 * inner if len(ins) > 1 else 0)
    down = inner + forward_bytes(rows, f, h, local) + rows * h * e
    return 2 * rows * h * e + max(first, down)


def backward_moments(spec: ModelSpec, dm: Dims,
                     moments: list[BackwardMoment]) -> list[BackwardMoment]:
    """Grouped experts' backward moments with torchao's float8 grouped GEMMs: the down
    projection's casts at its weight-gradient matmul (``backward_bytes``) on
    top of its moment, the largest of the input projections' (run one after another, each
    freeing its own) on top of theirs."""
    if dm.float8 is Float8Recipe.NONE:
        return moments
    moe = _moe(spec)
    rows, local = dm.tokens * moe.top_k, moe.num_experts // dm.ep
    ins, (f, h) = _mms(spec, dm)
    extra = {"mlp": backward_bytes(rows, f, h, local),
             "mlp_in": max(backward_bytes(rows, d_in, d_out, local)
                           for d_in, d_out in ins)}
    return [m._replace(transient_bytes=m.transient_bytes + extra.get(m.name, 0))
            for m in moments]
