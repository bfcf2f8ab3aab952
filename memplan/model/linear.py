"""One place every projection of a block goes through.

A block declares its projections (``Linear``: a name, the gradient group its backward fills,
its width in and out, a bias, how tensor parallelism splits it) and reads from here what
depends on a projection alone: its parameter tensors on one TP rank, the low-precision weight
casts it saves under autocast, the copies of its input it saves, the gradient groups its
backward makes, its FLOPs. A change made at the level of one linear (autocast's casts today;
float8 casts, adapters, quantized base weights next) is made here once, for every block.

Tensor parallelism follows Megatron-LM (``megatron/core/tensor_parallel/layers.py``):
``ColumnParallelLinear`` splits the output and its bias, ``RowParallelLinear`` the input (its
bias replicated); a projection that is not split (MLA's down projections, Megatron-LM's
``MLASelfAttention``; a router) holds all of it on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from memplan.choices import PlainEnum
from memplan.model import te_fp8
from memplan.model.adapters import TORCHAO_NF4, Adapters, torchao_dequant_bytes
from memplan.model.dims import MASK_BYTES, Dims, Term
from memplan.workload import BaseQuant, Float8Recipe, TeFp8Recipe

# torchao's float8 casts are one byte an element, e4m3 or e5m2 (tensorwise's grad_output)
# (``torchao/float8/config.py``: ``CastConfig.__post_init__`` asserts
# ``target_dtype.itemsize == 1``; ``Float8LinearConfig.from_recipe_name``)
FLOAT8_BYTES = 1
# each scale is fp32 (``torchao/float8/float8_utils.py``: ``amax_to_scale``,
# ``res.to(torch.float32)``)
FLOAT8_SCALE_BYTES = 4


class Split(PlainEnum):
    """How tensor parallelism splits a projection (see the module docstring)."""

    COLUMN = "column"  # the output (and the bias) split by t
    ROW = "row"  # the input split by t, the bias replicated
    NONE = "none"  # replicated: every rank holds all of it


class Linear(NamedTuple):
    """One projection of a block, ``d_in`` -> ``d_out`` elements per token, whole (before any
    split). ``stack``: experts held in one parameter (a stacked expert tensor: ``stack``
    weights of this shape in one tensor, no bias). ``saves_input``: its backward needs its
    input (for the weight's gradient), which autograd saves."""

    name: str
    group: str
    d_in: int
    d_out: int
    bias: bool = False
    split: Split = Split.COLUMN
    stack: int = 1
    saves_input: bool = True


def weight_elements(lin: Linear, t: int) -> int:
    """Elements of the weight on one TP rank (all ``stack`` experts of it)."""
    div = 1 if lin.split is Split.NONE else t
    return lin.stack * lin.d_in * lin.d_out // div


def tensor_sizes(lin: Linear, t: int) -> list[int]:
    """Elements of the weight and the bias on one TP rank, in registration order."""
    if not lin.bias:
        return [weight_elements(lin, t)]
    # a stacked bias holds one row per expert (GPT-OSS's gate_up_proj_bias: (E, 2f))
    return [weight_elements(lin, t),
            lin.stack * (lin.d_out // t if lin.split is Split.COLUMN else lin.d_out)]


def tensor_shapes(lin: Linear, t: int) -> list[tuple[int, ...]]:
    """Shapes of the weight and the bias on one TP rank (``tensor_sizes`` elements): the
    weight (d_out, d_in) as ``torch.nn.Linear`` holds it, (stack, d_out, d_in) stacked."""
    d_out = lin.d_out // t if lin.split is Split.COLUMN else lin.d_out
    d_in = lin.d_in // t if lin.split is Split.ROW else lin.d_in
    weight = (lin.stack, d_out, d_in) if lin.stack > 1 else (d_out, d_in)
    bias = (lin.stack, d_out) if lin.stack > 1 else (d_out,)
    return [weight, bias] if lin.bias else [weight]


def all_tensor_shapes(linears: Sequence[Linear], t: int) -> list[tuple[int, ...]]:
    """``tensor_shapes`` of each projection, in the order given."""
    return [shape for lin in linears for shape in tensor_shapes(lin, t)]


def all_tensor_sizes(linears: Sequence[Linear], t: int) -> list[int]:
    """``tensor_sizes`` of each projection, in the order given."""
    return [n for lin in linears for n in tensor_sizes(lin, t)]


def params(linears: Sequence[Linear], t: int = 1) -> int:
    """Parameters of the projections on one TP rank (all of them at ``t`` = 1)."""
    return sum(all_tensor_sizes(linears, t))


def weight_casts(prefix: str, elements: int, dm: Dims) -> list[Term]:
    """Under autocast, the low-precision casts of ``elements`` weight elements on this rank,
    which the linears save for backward: autocast casts an fp32 weight once per autocast
    region and caches the cast (``cached_cast`` in ``aten/src/ATen/autocast_mode.cpp``: fp32
    leaves that require grad), so each forward of a micro-batch makes its own set."""
    return [Term(f"{prefix}.weight_casts", elements * dm.e)] if dm.autocast else []


def saved_terms(prefix: str, linears: Sequence[Linear], dm: Dims) -> list[Term]:
    """What the projections save of their own for backward, beyond the activations the block
    counts (their inputs, ``saved_input``): under autocast the casts of their weights on this
    rank (``weight_casts``, one term); with LoRA what the adapters save (``adapter_terms``).
    As torchao's ``Float8Linear`` no weight cast: ``matmul_with_hp_or_float8_args.forward``
    (``torchao/float8/float8_linear.py``) saves ``(input_hp, weight_hp_t)``, the
    high-precision input and ``self.weight.t()``, a view of the parameter (autocast casts
    nothing there: ``Float8Linear.forward`` calls no ``F.linear``); its float8 casts are
    locals of the forward, made again in backward."""
    if dm.te_fp8 is not TeFp8Recipe.NONE:
        return te_fp8_saved_terms(prefix, linears, dm)
    if not dm.autocast and dm.adapters is None:  # (the planner's hot path: no sum to make)
        return []
    elements = sum(weight_elements(lin, dm.tp) for lin in linears
                   if not float8_converts(lin, dm))
    casts = weight_casts(prefix, elements, dm) if elements else []
    return casts + adapter_terms(prefix, linears, dm) + compiled_dequant_terms(prefix, linears,
                                                                                dm)


def compiled_dequant_terms(prefix: str, linears: Sequence[Linear], dm: Dims) -> list[Term]:
    """Compiled, torchao's ``NF4Tensor`` base weights (``adapters.TORCHAO_NF4``): each
    quantized linear's dequantized weight, d_in x d_out in the compute dtype. Dynamo traces
    ``linear_nf4`` (``LinearNF4``, an autograd Function: ``F.linear(input,
    weight.to(input.dtype))``) and the NF4 tensor's ``to`` into the layer's one graph; Inductor
    fuses the dequantization into one kernel writing the weight, and the partitioner saves
    that weight for the input gradient's matmul (``is_materialized_backwards``: a matmul's
    operand), not the NF4 pieces to dequantize again (traced: tests/traced/
    test_compile_lora.py, torchtune 0.6.1's ``lora_llama3(quantize_base=True)`` with torchao
    0.10.0, every adapted linear's weight, fp32 and bf16; torchao 0.1's ``linear_nf4`` alike,
    torch 2.13 on CPU)."""
    ad = dm.adapters
    if not dm.compiled or ad is None or ad.quant not in TORCHAO_NF4:
        return []
    n = sum(weight_elements(lin, dm.tp) for lin in linears if ad.quantizes(lin))
    return [Term(f"{prefix}.dequant_weights", n * dm.e)] if n else []


def te_modules(linears: Sequence[Linear]) -> list[Linear]:
    """The projections as Transformer Engine modules: the projections of one gradient group
    read one input and are one TE module (Megatron-LM's ``linear_qkv`` for q, k and v;
    ``linear_fc1`` for gate and up), their outputs side by side."""
    merged: dict[str, Linear] = {}
    for lin in linears:
        first = merged.get(lin.group)
        merged[lin.group] = lin if first is None else first._replace(
            d_out=first.d_out + lin.d_out, bias=first.bias or lin.bias)
    return list(merged.values())


def te_fp8_input_bytes(lin: Linear, dm: Dims) -> int:
    """The fp8 copy of its input a TE module saves for its weight gradient, in place of the
    compute-dtype input (``module/linear.py`` and ``module/layernorm_linear.py``
    ``_Linear.forward`` / ``_LayerNormLinear.forward``: the input quantized, then
    ``update_usage`` keeps one orientation: the rowwise data of the local shard where a
    per-tensor recipe must all-gather it in backward (column-parallel under sequence
    parallelism: ``supports_only_rowwise_all_gather``), else the columnwise copy; mxfp8 and
    blockwise keep the columnwise copy). Its rows: the sequence shard of a column-parallel
    module (saved before the all-gather), all tokens of a row-parallel one."""
    if not lin.saves_input:
        return 0
    rows = dm.linear_rows if lin.split is Split.COLUMN else dm.tokens
    d_in, _ = local_widths(lin, dm.tp)
    rowwise = dm.te_fp8 in te_fp8.PER_TENSOR
    return te_fp8.quantized_bytes(dm.te_fp8, rows, d_in, rowwise=rowwise,
                                  columnwise=not rowwise, transposes=dm.te_fp8_transposes)


def te_fp8_saved_terms(prefix: str, linears: Sequence[Linear], dm: Dims) -> list[Term]:
    """Under Transformer Engine fp8, what the modules of ``linears`` save for backward: the
    fp8 copy of each module's input (``te_fp8_input_bytes``). The compute-dtype inputs are
    then saved by nobody but a kernel that keeps its own (the blocks drop them:
    ``memplan.model.norm.output_kept``, the attention output, the MLP's last activation).
    Their weights' fp8 copies are kept across micro-batches, not per micro-batch
    (``te_fp8_weight_bytes``)."""
    return [Term(f"{prefix}.fp8_inputs", sum(te_fp8_input_bytes(mod, dm)
                                             for mod in te_modules(linears)))]


def te_fp8_weight_bytes(linears: Sequence[Linear], dm: Dims, amax_history_len: int,
                        param_gather: bool) -> int:
    """What the TE modules of ``linears`` keep on one TP rank across micro-batches and
    steps under fp8, beyond their parameters: Megatron-LM passes ``is_first_microbatch``
    (megatron/core/extensions/transformer_engine.py ``TELinear.forward``, unless
    ``disable_parameter_transpose_cache``), so each module casts its weight once per step
    into a cached workspace (``module/base.py`` ``get_weight_workspace`` with
    ``cache_name="weight"``: ``self._fp8_workspaces``), rowwise for the forward and
    columnwise for the input gradient, with their scales. With fp8 parameters
    (``param_gather``: ``fp8_model_init``) the parameter is the fp8 tensor: its rowwise data
    is the parameter (counted at one byte by the parameters), its columnwise copy and scales
    are kept on it (Megatron-LM's ``post_all_gather_processing``). And each module's recipe
    state (``te_fp8.module_state_bytes``)."""
    out = 0
    for mod in te_modules(linears):
        d_in, d_out = local_widths(mod, dm.tp)
        both = te_fp8.quantized_bytes(dm.te_fp8, d_out, d_in, rowwise=True, columnwise=True,
                                      weight=True, transposes=dm.te_fp8_transposes)
        out += (both - (d_out * d_in * te_fp8.FP8_BYTES if param_gather else 0)
                + te_fp8.module_state_bytes(dm.te_fp8, amax_history_len))
    return out


def te_fp8_forward_bytes(lin: Linear, dm: Dims) -> int:
    """At a row-parallel TE module's forward GEMM, beside its output: the rowwise fp8 copy
    of its input, made with the columnwise one it saves and dropped after the GEMM
    (``_Linear.forward``: ``set_usage(rowwise=True, columnwise=backward_needs_input)``, then
    ``update_usage(rowwise_usage=False)``)."""
    d_in, _ = local_widths(lin, dm.tp)
    if dm.te_fp8 in te_fp8.PER_TENSOR and not dm.te_fp8_transposes:
        return 0  # one copy, the one it saves
    return te_fp8.quantized_bytes(dm.te_fp8, dm.tokens, d_in, rowwise=True, columnwise=False)


def te_fp8_backward_bytes(lin: Linear, dm: Dims) -> int:
    """At a row-parallel TE module's weight-gradient GEMM: the incoming gradient (all
    tokens: all-gathered under sequence parallelism) cast to fp8 rowwise for the input
    gradient and columnwise for the weight gradient (``_Linear.backward``:
    ``grad_output_preprocess`` with ``grad_output_quantizer.set_usage(rowwise=True,
    columnwise=True)``)."""
    _, d_out = local_widths(lin, dm.tp)
    return te_fp8.quantized_bytes(dm.te_fp8, dm.tokens, d_out, rowwise=True, columnwise=True,
                                  transposes=dm.te_fp8_transposes)


def float8_converts(lin: Linear, dm: Dims) -> bool:
    """Whether the projection runs as a ``Float8Linear``: float8 on and both widths multiples
    of 16 (torchtitan's ``module_filter_fn``, ``torchtitan/components/quantization/utils.py``:
    other linears stay plain). The output head is not a projection here: torchtitan's float8
    configs filter it (``filter_fqns=["lm_head"]``, ``models/llama3/config_registry.py``)."""
    return dm.float8 is not Float8Recipe.NONE and convertible(lin)


def float8_tp_input_bytes(rows: int, width: int) -> int:
    """A linear input torchao's float8 tensor-parallel styles cast before the linear, as it
    saves it: ``rows`` x ``width`` float8 elements and one fp32 scale (tensorwise, the only
    recipe they take: ``float8_tensor_parallel.py``, "assumes tensorwise scaling";
    torchtitan's llama3 ``apply_tp`` uses them with float8 unless the recipe is rowwise).
    ``PrepareFloat8ModuleInput`` casts a block's input (the norm's output) to float8 on its
    sequence shard and all-gathers that (``_prepare_input_arg``: the cast, then
    ``redistribute``), ``Float8RowwiseParallel._prepare_input_fn`` casts the row-parallel
    linear's input; the Float8Linear finds it already cast (``matmul_with_hp_or_float8_args.
    forward``: ``tensor_already_casted_to_fp8``) and saves the float8 tensor as its
    ``input_hp`` (traced: tests/traced/test_float8_tp.py)."""
    return rows * width * FLOAT8_BYTES + FLOAT8_SCALE_BYTES


def convertible(lin: Linear) -> bool:
    """Both widths multiples of 16: what torchtitan's ``module_filter_fn`` converts."""
    return lin.d_in % 16 == 0 and lin.d_out % 16 == 0


def _scales(rows: int, dm: Dims) -> int:
    """Bytes of the scales of one float8 cast: one fp32 for the whole tensor (tensorwise),
    or one per ``rows`` (rowwise: ``tensor_to_amax``'s ``amax(abs(x), dim=axiswise_dim,
    keepdim=True)``, ``torchao/float8/float8_utils.py``, one per slice along the other dim)."""
    return (rows if dm.float8 is Float8Recipe.ROWWISE else 1) * FLOAT8_SCALE_BYTES


def float8_forward_bytes(lin: Linear, dm: Dims) -> int:
    """The float8 casts alive at a ``Float8Linear``'s forward matmul, beside its output
    (``matmul_with_hp_or_float8_args.forward``, ``torchao/float8/float8_linear.py``): the
    input's (tokens x d_in, one byte each, scales per token row: ``axiswise_dim`` -1) and the
    weight's (``weight_hp_t`` d_in x d_out, scales per output column: ``axiswise_dim`` 0),
    both locals freed when the forward returns. 0 unconverted (``float8_converts``). Under
    Transformer Engine fp8: ``te_fp8_forward_bytes``."""
    if dm.te_fp8 is not TeFp8Recipe.NONE:
        return te_fp8_forward_bytes(lin, dm)
    if not float8_converts(lin, dm):
        return 0
    return dm.tokens * local_widths(lin, dm.tp)[0] * FLOAT8_BYTES + _scales(dm.tokens, dm) \
        + _weight_cast(lin, dm, local_widths(lin, dm.tp)[1])


def _weight_cast(lin: Linear, dm: Dims, scales: int) -> int:
    """Bytes of a weight's float8 cast with ``scales`` scales: 0 where FSDP2 gathered it in
    float8 (``WeightWithDynamicFloat8CastTensor.fsdp_post_all_gather`` hands the linear a
    ``Float8TrainingTensor``: ``tensor_already_casted_to_fp8``, no cast; the gathered bytes
    are the data-parallel mechanism's, ``memplan.model.model_states``)."""
    if dm.float8_gathered:
        return 0
    return weight_elements(lin, dm.tp) * FLOAT8_BYTES + _scales(scales, dm)


# ``hp_tensor_to_float8_dynamic`` run eagerly, per element of the tensor it casts: after the
# amax, ``_ToFloat8ConstrFunc.forward`` (``torchao/float8/float8_training_tensor.py``) makes
# ``tensor_scaled = tensor.to(torch.float32) * scale`` (fp32, a local alive to the return) and
# ``to_fp8_saturated`` (``float8_utils.py``) its clamped fp32 copy, then the float8 bits from
# it: 4 + 4 + 1 bytes at once (the fp32 upcast of a bf16 tensor is freed by then), whatever
# the input's dtype (traced: tests/traced/test_torchao_float8.py)
FLOAT8_CAST_WORK_BYTES = 2 * 4 + FLOAT8_BYTES


def _work(dm: Dims) -> int:
    """Bytes per element a float8 cast holds while it runs: eagerly its fp32 working set
    (``FLOAT8_CAST_WORK_BYTES``); compiled, one Inductor kernel reads the high-precision
    tensor and writes the float8 bits alone (``memplan.model.compiled``)."""
    return FLOAT8_BYTES if dm.compiled else FLOAT8_CAST_WORK_BYTES


def float8_forward_peak(lin: Linear, dm: Dims, out_bytes: int) -> int:
    """Bytes a projection's forward holds at its peak beyond its input and weight, its
    output (``out_bytes``) included: as an eager ``Float8Linear``
    (``matmul_with_hp_or_float8_args.forward``) the largest of the input's cast working set,
    the weight's beside the input's float8 cast, and both casts beside the output at the
    matmul (``float8_forward_bytes``); unconverted, the output alone."""
    if not float8_converts(lin, dm):
        return out_bytes
    d_in, d_out = local_widths(lin, dm.tp)
    if dm.float8_tp:  # the input arrives cast (float8_tp_input_bytes): the weight's cast alone
        w = _weight_cast(lin, dm, d_out)
        m = 0 if dm.float8_gathered else weight_elements(lin, dm.tp)
        return max(m * _work(dm) + _scales(d_out, dm) if m else 0, w + out_bytes)
    n, m = dm.tokens * d_in, 0 if dm.float8_gathered else weight_elements(lin, dm.tp)
    x8 = n * FLOAT8_BYTES + _scales(dm.tokens, dm)
    return max(n * _work(dm) + _scales(dm.tokens, dm),
               x8 + (m * _work(dm) + _scales(d_out, dm) if m else 0),
               float8_forward_bytes(lin, dm) + out_bytes)


def float8_backward_peak(lin: Linear, dm: Dims, grad_in_bytes: int) -> int:
    """Bytes a projection's backward holds at its peak beyond its saved tensors and its
    output's gradient, its input's gradient (``grad_in_bytes``) included: as an eager
    ``Float8Linear`` (``matmul_with_hp_or_float8_args.backward``) the four casts made in
    turn, each cast's working set (``FLOAT8_CAST_WORK_BYTES``) beside the casts made before
    it (and after the input-gradient matmul, beside that gradient); unconverted, the input's
    gradient alone. The weight gradient is the walk's (``fresh_params``)."""
    if not float8_converts(lin, dm):
        return grad_in_bytes
    if dm.float8_tp:
        return _float8_tp_backward_peak(lin, dm, grad_in_bytes)
    d_in, d_out = local_widths(lin, dm.tp)
    rows, work = dm.tokens, _work(dm)
    p, n, m = rows * d_out, rows * d_in, 0 if dm.float8_gathered else weight_elements(lin, dm.tp)
    go0 = p * FLOAT8_BYTES + _scales(rows, dm)
    w0 = _weight_cast(lin, dm, d_in)
    go1 = p * FLOAT8_BYTES + _scales(d_out, dm)
    return _gathered_grad(lin, dm) + max(
        p * work + _scales(rows, dm), go0 + (m * work + _scales(d_in, dm) if m else 0),
        go0 + w0 + grad_in_bytes + p * work + _scales(d_out, dm),
        go0 + w0 + grad_in_bytes + go1 + n * work + _scales(d_in, dm))


def _gathered_grad(lin: Linear, dm: Dims) -> int:
    """Under DTensor sequence parallelism, a row-parallel Float8Linear's output gradient as
    its backward reads it: the sequence shard all-gathered (the backward of its output's
    reduce-scatter, torch's ``RowwiseParallel`` to ``Shard(1)``), all tokens in the compute
    dtype, alive through the linear's backward beside the shard the block counts (traced:
    tests/traced/test_float8_tp.py, torchtitan 0.3.0's TP with rowwise float8). 0
    otherwise."""
    if lin.split is not Split.ROW or not dm.gathered_linear_input:
        return 0
    return dm.tokens * local_widths(lin, dm.tp)[1] * dm.e


def _float8_tp_backward_peak(lin: Linear, dm: Dims, grad_in_bytes: int) -> int:
    """``float8_backward_peak`` under torchao's float8 tensor-parallel styles: the output's
    gradient reaches the linear already cast (``Float8ColwiseParallel`` /
    ``Float8RowwiseParallel._prepare_output_fn`` put ``NoopFwToFloat8BwDynamic`` after the
    output: its backward casts the gradient, on a row-parallel linear's sequence shard before
    the all-gather its redistribute runs backward, in float8), and its saved input is float8:
    ``matmul_with_hp_or_float8_args.backward`` casts the weight alone (for the input's
    gradient) and runs both matmuls on float8 arguments. The largest of: the gradient's cast
    working set (on the rows it is cast on), the weight's cast working set beside the float8
    gradient, and the weight's cast beside the gradient and the input's gradient."""
    d_in, d_out = local_widths(lin, dm.tp)
    work = _work(dm)
    cast_rows = dm.rows if lin.split is Split.ROW else dm.tokens
    go8 = dm.tokens * d_out * FLOAT8_BYTES + FLOAT8_SCALE_BYTES
    m = 0 if dm.float8_gathered else weight_elements(lin, dm.tp)
    return max(cast_rows * d_out * work + FLOAT8_SCALE_BYTES,
               go8 + (m * work + FLOAT8_SCALE_BYTES if m else 0),
               go8 + _weight_cast(lin, dm, d_in) + grad_in_bytes)


def float8_backward_bytes(lin: Linear, dm: Dims) -> int:
    """The float8 casts alive at a ``Float8Linear``'s weight-gradient matmul, the last of its
    backward (``matmul_with_hp_or_float8_args.backward``): the input-gradient matmul's casts
    (``grad_output`` per token row, ``weight_hp_t`` per input row: ``axiswise_dim`` -1) stay
    alive as locals, beside the weight gradient's (``grad_output`` per output column and the
    saved input per input column: ``axiswise_dim`` 0); the high-precision results (grad input,
    grad weight) not included. 0 unconverted (``float8_converts``). Under Transformer Engine
    fp8: ``te_fp8_backward_bytes``."""
    if dm.te_fp8 is not TeFp8Recipe.NONE:
        return te_fp8_backward_bytes(lin, dm)
    if not float8_converts(lin, dm):
        return 0
    d_in, d_out = local_widths(lin, dm.tp)
    rows = dm.tokens
    grad_input_casts = (rows * d_out * FLOAT8_BYTES + _scales(rows, dm)
                        + _weight_cast(lin, dm, d_in))
    grad_weight_casts = (rows * d_out * FLOAT8_BYTES + _scales(d_out, dm)
                         + rows * d_in * FLOAT8_BYTES + _scales(d_in, dm))
    return grad_input_casts + grad_weight_casts


def local_widths(lin: Linear, t: int) -> tuple[int, int]:
    """(input, output) width of a projection on one TP rank."""
    if lin.split is Split.ROW:
        return lin.d_in // t, lin.d_out
    if lin.split is Split.COLUMN:
        return lin.d_in, lin.d_out // t
    return lin.d_in, lin.d_out


def shares_input(dm: Dims) -> bool:
    """Whether ``lora_A`` saves the base linear's input tensor itself: no cast to the
    adapters' fp32 (the base computes in fp32, no autocast) and no dropout
    (``memplan.model.adapters``)."""
    ad = dm.adapters
    return (ad is not None and ad.dropout == 0 and not dm.autocast
            and dm.e == ad.weight_bytes)


def keeps_input(linears: Sequence[Linear], dm: Dims) -> bool:
    """Whether the input the block counts for ``linears`` (which read one tensor) stays
    saved: their weights train, an int8 base keeps it (bitsandbytes' ``MatMul8bitLt``
    forward: ``ctx.tensors = (CAt, subA, A)`` whenever an input requires grad; its CPU
    ``MatMul8bitFp``: ``ctx.A = A``), or an adapter of theirs saves that very tensor."""
    if dm.adapters is None or dm.adapters.quant is BaseQuant.INT8:
        return True
    return shares_input(dm) and any(dm.adapters.adapts(lin) for lin in linears)


def adapter_math_bytes(dm: Dims) -> int:
    """Bytes per element of the adapters' activations: their weights' dtype, or under
    autocast the compute dtype autocast runs their matmuls in."""
    assert dm.adapters is not None
    return dm.e if dm.autocast else dm.adapters.weight_bytes


def adapter_terms(prefix: str, linears: Sequence[Linear], dm: Dims) -> list[Term]:
    """What the adapters of ``linears`` save for backward on this rank (``memplan.model.
    adapters``): per adapted projection ``lora_B``'s rank-r input, and ``lora_A``'s input
    unless it is the base's own input (``shares_input``: counted by the block): the fp32 cast
    of it (under autocast the low-precision cast), or with dropout its bool mask and output.

    Compiled (``Adapters.shared_casts``), the casts of one tensor are one node: AOTAutograd
    merges identical nodes of the joint graph (``fx_graph_cse``, torch/_functorch/
    compile_utils.py, on by torch/_functorch/config.py ``cse``), and the partitioner saves
    that cast (read by every ``lora_A``'s weight gradient: ``is_materialized_backwards``):
    one per input the adapted projections read (a row-parallel projection reads its own;
    the others of the block, its input). Each dropout draws its own mask: no sharing."""
    ad = dm.adapters
    if ad is None:
        return []
    # autocast casts the fp32 adapters' matmuls; else their own dtype (fp32, or the model's
    # where the engine cast them: Adapters.weight_bytes)
    low = adapter_math_bytes(dm)
    rows = dm.tokens
    inputs = rank = 0
    cast: set[str] = set()  # the inputs whose cast is counted, when shared
    for lin in linears:
        if not ad.adapts(lin):
            continue
        d_in, _ = local_widths(lin, dm.tp)
        rank += rows * ad.rank * low
        source = lin.name if lin.split is Split.ROW else lin.group
        if ad.dropout > 0:
            inputs += rows * d_in * (MASK_BYTES + low)
        elif not shares_input(dm) and not (ad.shared_casts and source in cast):
            inputs += rows * d_in * low
            cast.add(source)
    return [Term(f"{prefix}.lora_input", inputs), Term(f"{prefix}.lora_rank", rank)]


def adapter_forward_bytes(lin: Linear, dm: Dims) -> int:
    """At an adapted projection's ``result + lora_B(...) * scaling``, beside its base output:
    ``lora_B``'s output and its scaled copy, then the sum (bf16 + fp32 promotes to fp32)
    beside the scaled copy, each rows x d_out in the adapters' dtype (0 when not adapted)."""
    ad = dm.adapters
    if ad is None or not ad.adapts(lin):
        return 0
    low = adapter_math_bytes(dm)
    return 2 * dm.tokens * local_widths(lin, dm.tp)[1] * low


def adapter_checkpointed_bytes(lin: Linear, dm: Dims) -> int:
    """The most an adapted projection's adapter holds beside its base output in a forward
    that saves nothing (a checkpointed layer's first forward): peft's ``Linear.forward``
    binds the adapters' cast of the input to its local ``x`` (``x = _cast_input_dtype(x,
    lora_A.weight.dtype)``, rows x d_in in fp32 where the base computes in a lower dtype; x
    itself where it is fp32 or autocast runs the adapters' matmuls) until it returns; with
    dropout, ``dropout(x)`` and its bool mask until ``lora_A`` returns; then ``lora_B``'s
    output and its scaled copy, or the sum beside the scaled copy
    (``adapter_forward_bytes``). 0 when not adapted."""
    ad = dm.adapters
    if ad is None or not ad.adapts(lin):
        return 0
    low = adapter_math_bytes(dm)
    d_in, _ = local_widths(lin, dm.tp)
    rows = dm.tokens
    cast = 0 if dm.autocast or dm.e == ad.weight_bytes else rows * d_in * ad.weight_bytes
    drop = rows * (d_in * (low + MASK_BYTES) + ad.rank * low) if ad.dropout > 0 else 0
    return cast + max(drop, adapter_forward_bytes(lin, dm))


def adapter_backward_bytes(lin: Linear, dm: Dims) -> int:
    """At an adapted projection's backward, its adapter's before its base's (made later in
    forward, so run first): the gradient of the summed output in the adapters' dtype, the
    rank-r gradient and the gradient of ``lora_A``'s input (0 when not adapted)."""
    ad = dm.adapters
    if ad is None or not ad.adapts(lin):
        return 0
    low = adapter_math_bytes(dm)
    d_in, d_out = local_widths(lin, dm.tp)
    return dm.tokens * (d_out + ad.rank + d_in) * low


def dequant_bytes(lin: Linear, dm: Dims) -> int:
    """The compute-dtype weight a quantized frozen base dequantizes for its backward's input
    gradient, alive beside it (bitsandbytes ``MatMul4Bit.backward``: ``matmul(grad_output,
    dequantize_4bit(B, state).to(dtype))``; ``MatMul8bitLt.backward``: ``CB.to(dtype,
    copy=True).mul_(SCB / 127)``); its forward's happens inside one op (``gemm_4bit``'s
    dequantize and linear), beside the output only. 0 unquantized."""
    if dm.adapters is None or not dm.adapters.quantizes(lin):
        return 0
    return weight_elements(lin, dm.tp) * dm.e


def dequant_backward_bytes(lin: Linear, dm: Dims, grad_in_bytes: int) -> int:
    """Bytes alive at a frozen base's input-gradient matmul, its result (``grad_in_bytes``)
    included: with bitsandbytes the dequantized weight beside it (``dequant_bytes``); with
    torchao's ``NF4Tensor`` (``grad_output @ weight.to(dtype)``) the larger of
    ``get_original_weight``'s working set (``adapters.torchao_dequant_bytes``) and the
    dequantized weight beside the result."""
    if dm.compiled:  # the dequantized weight is saved (``compiled_dequant_terms``)
        return grad_in_bytes
    if (dm.adapters is not None and dm.adapters.quant in TORCHAO_NF4
            and dm.adapters.quantizes(lin)):
        return _torchao_dequant(lin, dm, grad_in_bytes)
    return grad_in_bytes + dequant_bytes(lin, dm)


def dequant_forward_bytes(lin: Linear, dm: Dims, out_bytes: int) -> int:
    """Bytes alive at a frozen base's forward, its output (``out_bytes``) included:
    bitsandbytes dequantizes inside one op (``gemm_4bit``), beside nothing but the output;
    torchao's ``LinearNF4.forward`` (``F.linear(input, weight.to(input.dtype))``) as in
    ``dequant_backward_bytes``."""
    if dm.compiled:  # one fused kernel writes the (saved) weight: ``compiled_dequant_terms``
        return out_bytes
    if (dm.adapters is not None and dm.adapters.quant in TORCHAO_NF4
            and dm.adapters.quantizes(lin)):
        return _torchao_dequant(lin, dm, out_bytes)
    return out_bytes


def _torchao_dequant(lin: Linear, dm: Dims, out_bytes: int) -> int:
    n = weight_elements(lin, dm.tp)
    return max(torchao_dequant_bytes(n), n * dm.e + out_bytes)


def adapter_sizes(linears: Sequence[Linear], dm_adapters: Adapters | None,
                  t: int) -> list[int]:
    """Elements of each adapter tensor of ``linears`` on one TP rank, in registration order
    (``lora_A``, then ``lora_B``, of each adapted projection)."""
    if dm_adapters is None:
        return []
    out = []
    for lin in linears:
        if dm_adapters.adapts(lin):
            d_in, d_out = local_widths(lin, t)
            out += [dm_adapters.rank * d_in, d_out * dm_adapters.rank]
    return out


def saved_bytes(linears: Sequence[Linear], dm: Dims) -> int:
    """``saved_terms`` in bytes (0 without autocast)."""
    return sum(term.size_bytes for term in saved_terms("", linears, dm))


def input_copies(readers: int, dm: Dims) -> int:
    """Copies of one input tensor that ``readers`` linears reading it save: one shared tensor,
    or under autocast each linear's own low-precision cast (autocast casts the input of every
    matmul separately and caches only leaves' casts: ``cached_cast``, ``autocast_mode.cpp``).
    Compiled, one cast: autocast's casts are traced into the joint graph as identical
    ``convert_element_type`` nodes of the one input, which the partitioner's CSE pass merges
    (``min_cut_rematerialization_partition`` runs ``fx_graph_cse``,
    torch/_functorch/compile_utils.py, under ``torch._functorch.config.cse``, True); the
    weight gradients' matmuls read it, so it is saved (``is_materialized_backwards``; traced:
    tests/traced/test_compile_trace.py, amp-bf16 and amp-fp16)."""
    return readers if dm.autocast and not dm.compiled else 1


def saved_input(name: str, lin: Linear, rows: int, dm: Dims) -> Term:
    """The input a projection saves, ``rows`` tokens of its (TP-local) input width in the
    compute dtype: a row-parallel projection's input is split by t, a column-parallel one's is
    whole."""
    width = lin.d_in // dm.tp if lin.split is Split.ROW else lin.d_in
    kept = lin.saves_input and keeps_input((lin,), dm)
    return Term(name, rows * width * dm.e if kept else 0)


def grad_groups(linears: Sequence[Linear], t: int, order: tuple[str, ...],
                others: dict[str, int] | None = None) -> dict[str, int]:
    """Parameters on one TP rank whose gradients exist once the backward has run through each
    group of ``order`` (the backward's order: each group includes those before it). ``others``:
    parameters of a group that are not projections (norms inside a block)."""
    extra = others or {}
    out: dict[str, int] = {}
    running = 0
    for group in order:
        running += params([lin for lin in linears if lin.group == group], t) + extra.get(group, 0)
        out[group] = running
    return out


def flops_per_token(linears: Sequence[Linear]) -> float:
    """Forward FLOPs of one token through the projections: 2 per parameter, a multiply and an
    add per weight (and one add per bias element, counted alike; Narayanan et al. 2021, arXiv
    2104.04473, section 5.1, count 2 per weight)."""
    return 2.0 * params(linears)
