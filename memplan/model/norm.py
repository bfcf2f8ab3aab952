"""The norm block (RMSNorm or LayerNorm, before attention, before the MLP, and the final one).

What it saves (Llama and GPT blocks in PyTorch, traced with the exact tracker):

- ``upcast`` (Hugging Face style): the fp32 copy of its input (saved by pow and mul), per-token
  statistics (fp32 rstd; mean and rstd for LayerNorm), the normalised tensor in the compute
  dtype (saved by the weight multiply), and its output (saved by the next linear);
- ``fused``: its input, the statistics, and its output.

Under autocast with fp32 weights (``Dims.autocast``) the norm runs in fp32 on the fp32 residual
stream (rsqrt, pow, layer_norm and rms_norm are fp32 ops of CUDA's autocast), so its input is
the stream itself and the normalised tensor stays fp32; its output is saved by no one, but each
linear reading it saves its own low-precision cast (``consumers``: three for separate q/k/v
projections, two for gate and up).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memplan.model import compiled
from memplan.model.block import BackwardMoment, Moment
from memplan.model.linear import Linear, float8_tp_input_bytes, input_copies, shares_input
from memplan.model.dims import FP32_BYTES, Dims, Term, total
from memplan.spec import ModelSpec, NormKind, norm_params
from memplan.workload import BaseQuant, MoeImpl, NormImpl, Recompute, TeFp8Recipe, Workload


def consumers(prefix: str, spec: ModelSpec, wl: Workload) -> int:
    """Linears that read a norm's output: separate q, k and v projections (or one fused qkv)
    after the attention norm (and the MLP's, in a parallel layer); gate and up (or one first linear, or one fused gate_up) after
    the MLP norm; the head after the final norm."""
    mlp = 2 if spec.mlp.gated and not spec.fused_gate_up else 1
    if prefix == "attn_norm":
        # a parallel layer's one norm feeds the MLP's first linears too
        return (1 if spec.fused_qkv or wl.fused_qkv else 3) + (mlp if spec.parallel_block
                                                                else 0)
    if prefix == "mlp_norm":
        return mlp
    return 1


def output_saved_fp32(prefix: str, wl: Workload) -> bool:
    """Under autocast, whether a norm's fp32 output itself is saved: the final norm's before a
    chunked loss, whose checkpointed chunks keep their inputs (views of it)."""
    return prefix == "final_norm" and wl.loss_checkpointed


def is_post(prefix: str) -> bool:
    """A norm on a mixer's output, before the residual add (``NormPlacement``)."""
    return prefix.endswith("_post_norm")


def norm_terms(prefix: str, spec: ModelSpec, wl: Workload, dm: Dims,
               readers: int | None = None) -> list[Term]:
    """A norm in the residual stream, its output included (saved by the following linear).
    A post norm (``is_post``) normalises a mixer's output for the residual add, which saves
    nothing: its output is not saved. ``readers``: the linears reading its output where they
    are not the prefix's (``consumers``)."""
    if is_post(prefix):
        return [t for t in _norm_terms(prefix, spec, wl, dm, readers)
                if not t.name.endswith(".output")]
    return _norm_terms(prefix, spec, wl, dm, readers)


def _norm_terms(prefix: str, spec: ModelSpec, wl: Workload, dm: Dims,
                readers: int | None = None) -> list[Term]:
    rows, h = dm.rows, spec.hidden_size
    # a LayerNorm centring twice saves rsqrt's output alone (its mean is saved by no one);
    # compiled, the partitioner saves both reductions' outputs, the mean and rsqrt's, and
    # recomputes the centred input from them (traced: tests/traced/test_compile_trace.py
    # ``test_compiled_parallel_layer``, Cohere's layer: two T x 4 B per norm)
    two = spec.norm is NormKind.LAYERNORM and (not spec.norm_centres_twice or dm.compiled)
    stats = rows * FP32_BYTES * (2 if two else 1)
    # the output is saved by the next (column-parallel) linear: as its sequence shard, or
    # all-gathered to the full sequence (DTensor sequence parallelism); under autocast each
    # linear saves its own cast of it
    copies = input_copies(consumers(prefix, spec, wl) if readers is None else readers, dm)
    out_e = dm.e
    if dm.autocast and output_saved_fp32(prefix, wl):
        copies, out_e = 1, dm.stream_e
    if not output_kept(prefix, dm):
        copies = 0
    saved = copies * dm.linear_rows * h * out_e
    if dm.float8_tp and copies and prefix in ("attn_norm", "mlp_norm"):
        # torchao's PrepareFloat8ModuleInput casts the block's input to float8 before its
        # all-gather: the gathered float8 tensor is what its linears save, the norm's output
        # is freed (linear.float8_tp_input_bytes)
        saved = float8_tp_input_bytes(dm.linear_rows, h)
    out = [Term(f"{prefix}.output", saved), Term(f"{prefix}.stats", stats)]
    if wl.norm_impl is NormImpl.FUSED:
        return [Term(f"{prefix}.input", rows * h * compiled.norm_input_e(prefix, dm, spec)), *out]
    # normalise in fp32, cast back to the input's dtype, then weight * normed saves it;
    # litgpt multiplies before the cast, by an fp32 copy of the weight: both saved in fp32
    if wl.norm_impl is NormImpl.UPCAST_FP32:
        # (in fp32 runs the weight's .float() is the weight itself)
        weight = h * FP32_BYTES * (2 if spec.norm_bias else 1) if dm.stream_e < FP32_BYTES else 0
        # a LayerNorm centring twice saves both fp32 differences (ModelSpec.norm_centres_twice)
        centred = [Term(f"{prefix}.centred_fp32", rows * h * FP32_BYTES)] * spec.norm_centres_twice
        return [Term(f"{prefix}.input_fp32", rows * h * FP32_BYTES), *out, *centred,
                Term(f"{prefix}.normed", rows * h * FP32_BYTES),
                *([Term(f"{prefix}.weight_fp32", weight)] if weight else [])]
    # weight * normed saves normed for the weight's gradient alone: none when it is frozen.
    # It is cast back to the input's dtype: a post norm's input is its mixer's output, in the
    # compute dtype under autocast too (GLM-4's post_self_attn_layernorm / post_mlp_layernorm,
    # Glm4RMSNorm.forward: weight * hidden_states.to(input_dtype); traced:
    # tests/traced/test_hf_moe_families.py glm4 amp-bf16)
    normed_e = dm.e if is_post(prefix) else dm.stream_e
    normed = 0 if dm.adapters is not None else rows * h * normed_e
    return [Term(f"{prefix}.input_fp32", rows * h * FP32_BYTES), *out,
            Term(f"{prefix}.normed", normed)]


# the projections that read each norm's output (memplan.model.linear's names)
READERS = {"attn_norm": ("q", "k", "v", "qkv"), "mlp_norm": ("gate", "up", "gate_up"),
           "final_norm": ("head",)}


def moe_output_unread(spec: ModelSpec, wl: Workload, dm: Dims) -> bool:
    """Whether no backward saves the output of the norm before an MoE block: torchtitan's
    (``MoeImpl.TITAN``, ``memplan.model.moe_titan``) below fp32, where the router's gate saves
    an fp32 copy of it (models/common/moe.py ``TokenChoiceTopKRouter.forward``: the gate under
    fp32 autocast), the dispatch's ``x_TD[idx]`` its index alone (models/common/
    token_dispatcher.py ``_local_reorder``) and no shared expert reads it."""
    return (wl.moe_impl is MoeImpl.TITAN and dm.e < FP32_BYTES and spec.moe is not None
            and not spec.moe.num_shared_experts)


def output_kept(prefix: str, dm: Dims) -> bool:
    """Whether the linears after the norm save its output: their weights train, or an
    adapter of one of them saves the tensor itself (``memplan.model.linear.shares_input``;
    the final norm's reader is the head, adapted under ``--lora-targets output``). Under
    Transformer Engine fp8 a layer's norms feed TE modules that save an fp8 copy instead
    (``memplan.model.linear.te_fp8_input_bytes``); the head is no TE module. Under
    DeepSpeed's ZeRO-3 (``Dims.head_input_kept``) the final norm's output stays alive into
    backward though a frozen head saves no input (traced, tests/traced/
    test_deepspeed_trace.py, LoRA: the head's module hooks, parameter_offload.py
    ``PreBackwardFunctionForModule``/``PostBackwardFunctionModule``, return detached views
    of it)."""
    if dm.te_fp8 is not TeFp8Recipe.NONE and prefix in ("attn_norm", "mlp_norm"):
        return False
    if dm.adapters is None or (prefix == "final_norm" and dm.head_input_kept):
        return True
    if prefix in READERS and prefix != "final_norm" and dm.adapters.quant is BaseQuant.INT8:  # (linear.keeps_input)
        return True
    return shares_input(dm) and bool(set(READERS.get(prefix, ())) & dm.adapters.targets)


def saved_at_backward(terms: list[Term]) -> int:
    """What of a norm is still saved when its own backward runs: its output and weighted input
    were freed by the later ops' backward."""
    return sum(t.size_bytes for t in terms
               if t.name.partition(".")[2] not in ("output", "normed"))


def forward_transient(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """An upcast norm's fp32 normalised tensor before its cast back (and weight * normed
    before the bias is added), beside what it has saved."""
    if dm.autocast:
        return autocast_output_transient("", spec, wl, dm)
    if not wl.norm_impl.upcast:
        return 0
    stream = dm.rows * spec.hidden_size * dm.e
    fp32_normed = dm.rows * spec.hidden_size * FP32_BYTES if dm.e < FP32_BYTES else 0
    return fp32_normed + (stream if spec.norm_bias else 0)


def autocast_output_transient(prefix: str, spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Under autocast, beside all a norm saves (its output's casts included): its fp32 output,
    which no one saves (``Norm`` moments count the casts as made). With a bias, the weighted
    tensor and the output exist together before the casts are made."""
    out = dm.rows * spec.hidden_size * FP32_BYTES
    if output_saved_fp32(prefix, wl):  # the output is a saved term; a bias adds a temporary
        return out if spec.norm_bias and wl.norm_impl.upcast else 0
    if not spec.norm_bias or wl.norm_impl is NormImpl.FUSED:
        return out
    casts = next(t.size_bytes for t in norm_terms(prefix or "attn_norm", spec, wl, dm)
                 if t.name.endswith(".output"))
    return max(out, 2 * out - casts)


def working_set(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Bytes a norm's forward holds beyond its input: fp32 copies, the cast, its output."""
    rows, h, e = dm.rows, spec.hidden_size, dm.e
    stats = rows * FP32_BYTES * (2 if spec.norm is NormKind.LAYERNORM else 1)
    if dm.autocast:  # fp32 throughout: the normalised tensor and the output (no upcast copy)
        return (1 if wl.norm_impl is NormImpl.FUSED else 2) * rows * h * FP32_BYTES + stats
    if wl.norm_impl is NormImpl.FUSED:
        return rows * h * e + stats
    lowp = e < FP32_BYTES
    fp32_copies = (2 if lowp else 1) * rows * h * FP32_BYTES  # upcast input, normalised
    return fp32_copies + (2 if lowp else 1) * rows * h * e + stats


def backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Gradient bytes in flight inside a norm's backward, its incoming gradient excluded."""
    rows, h = dm.rows, spec.hidden_size
    if wl.norm_impl is NormImpl.FUSED:
        # LayerNorm's aten kernel: its input gradient. The reference fused RMSNorm: the
        # weighted gradient, the normalised input and one product. (In its input's dtype:
        # fp32 under autocast.)
        return (3 if spec.norm is NormKind.RMSNORM else 1) * rows * h * dm.stream_e
    if spec.norm is NormKind.LAYERNORM:
        # the gradient entering the aten kernel (the weighted one; in low precision its fp32
        # copy, the weighted one freed by then) and the input gradient it returns
        return 2 * rows * h * FP32_BYTES
    # Five fp32 hidden-sized tensors at the peak (traced): in low precision the cast back's
    # fp32 gradient copy and four from the RMSNorm math; in fp32, where the casts are no-ops,
    # the weighted gradient itself and the same four
    return 5 * rows * h * FP32_BYTES


def post_input_unsaved(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """A post norm's input, the mixer's output in the compute dtype, when the norm does not
    save that tensor itself (an upcast below fp32 saves an fp32 copy of it)."""
    saved = wl.norm_impl is NormImpl.FUSED or dm.e >= FP32_BYTES
    return 0 if saved else dm.rows * spec.hidden_size * dm.e


class Norm:
    """A norm block of a layer, named by its place (``attn_norm``, ``mlp_norm`` before the
    mixers; ``attn_post_norm``, ``mlp_post_norm`` on their outputs)."""

    __slots__ = ("name", "readers", "copies", "moe")

    def __init__(self, name: str,
                 readers: Callable[[ModelSpec], Sequence[Linear]] | None = None,
                 copies: int | None = None, moe: bool = False) -> None:
        self.name = name
        self.readers = readers  # the projections reading its output (compiled float8)
        # the linears reading its output where not the prefix's (``consumers``): a mixer
        # other than attention (LFM2's short convolution: in_proj alone)
        self.copies = copies
        self.moe = moe  # the norm before an MoE block (``moe_output_unread``)

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        terms = norm_terms(self.name, spec, wl, dm, self.copies)
        if self.moe and moe_output_unread(spec, wl, dm):
            return [t for t in terms if not t.name.endswith(".output")]
        if (self.readers is not None and compiled.float8_recomputed(self.readers(spec), dm)
                and not compiled.float8_tp_gathered_kept(dm, recompute)):
            return [t for t in terms if not t.name.endswith(".output")]  # recomputed
        return terms

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        own = total(norm_terms(self.name, spec, wl, dm, self.copies))
        if self.moe and moe_output_unread(spec, wl, dm):
            # its output alive beside what it saves, not saved (read to the block's end:
            # ``memplan.model.moe_titan``'s moments count it there)
            own = total(self.saved(spec, wl, dm, recompute))
        if is_post(self.name):
            # the mixer's output it reads, then its own output beside that input before the
            # residual add frees both
            out = dm.rows * spec.hidden_size * dm.e
            unsaved = post_input_unsaved(spec, wl, dm)
            return [Moment(self.name, own, unsaved + max(forward_transient(spec, wl, dm), out))]
        return [Moment(self.name, own, forward_transient(spec, wl, dm))]

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        if is_post(self.name):  # beside the mixer's output it reads
            return [Moment(self.name, 0, dm.rows * spec.hidden_size * dm.e
                           + working_set(spec, wl, dm))]
        return [Moment(self.name, 0, working_set(spec, wl, dm))]

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        inside = (compiled.post_norm_backward_bytes(spec, dm)
                  if dm.compiled and is_post(self.name) else backward_bytes(spec, wl, dm))
        return [BackwardMoment(self.name, saved_at_backward(norm_terms(self.name, spec, wl, dm,
                                                                       self.copies)), inside)]

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        return []

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        return [spec.hidden_size] * (2 if spec.norm_bias else 1)

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        return [(n,) for n in self.tensor_sizes(spec, t, ep)]

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        return {self.name: norm_params(spec)}

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        # counted as 2 FLOPs per parameter, as the step-time model counts every weight
        return 2.0 * norm_params(spec)


# --- the final norm, before the output head (last pipeline stage) ---------------------------

def final_forward_transient(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """The final norm's transients (the unsaved residual input and the fp32 normalised
    tensor before its cast back), on top of everything saved up to and including it."""
    if dm.autocast:
        return autocast_output_transient("final_norm", spec, wl, dm)
    if wl.norm_impl is NormImpl.FUSED:
        return 0
    bias_temp = dm.e if spec.norm_bias else 0  # weight * normed, before the bias is added
    if dm.e >= FP32_BYTES:  # the casts are no-ops: the input and normed tensor are saved
        return dm.rows * spec.hidden_size * bias_temp
    return dm.rows * spec.hidden_size * (dm.e + FP32_BYTES + bias_temp)


def final_saved_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> tuple[int, int]:
    """Saved bytes of the final norm (part of the head's terms): all of them, and those still
    saved when its own backward runs."""
    terms = norm_terms("final_norm", spec, wl, dm)
    return total(terms), saved_at_backward(terms)


def final_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Gradient bytes in flight inside the final norm's backward (``backward_bytes``).
    The reference fused RMSNorm is an autograd Function whose backward holds its incoming
    gradient to the end, with its per-row statistics: the rstd cast to the compute dtype, the
    fp32 row dot products and the fp32 weight gradient before its cast (traced; in a layer
    the layer's moments count that gradient)."""
    inside = backward_bytes(spec, wl, dm)
    if wl.norm_impl is not NormImpl.FUSED or spec.norm is not NormKind.RMSNORM:
        return inside
    rows, h, e = dm.rows, spec.hidden_size, dm.stream_e  # its input's dtype
    # the rstd cast to the input's dtype, and the fp32 weight gradient before its cast to the
    # weight's dtype: neither exists when that dtype is fp32
    low = e < FP32_BYTES
    return (inside + rows * h * e + (rows * e if low else 0) + rows * FP32_BYTES
            + (h * FP32_BYTES if low else 0))


class StreamInput:
    """A mixer that reads the residual stream itself, no norm before it (``NormPlacement.
    POST``, OLMo 2): its linears save the stream tensor (as the linears see it: the sequence
    shard, or all-gathered under DTensor sequence parallelism), under autocast a cast of it
    per linear. No parameters."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        copies = input_copies(consumers(self.name.replace("_input", "_norm"), spec, wl), dm)
        return [Term(f"{self.name}.output",
                     copies * dm.linear_rows * spec.hidden_size * dm.e)]

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        return []

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        return []

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        return []

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        return []

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        return []

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        return []

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        return {self.name: 0}

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        return 0.0
