"""The dense MLP block: gated (SwiGLU/GeGLU) or not (GELU, ReLU), with its output's dropout.

What it saves: gated, the gate projection's output, the activation's output, the up
projection's output and their product; GELU, the first linear's output and the activation's;
ReLU, only its output (its backward reads the output, which the next linear saves too).
"""

from __future__ import annotations

from functools import lru_cache

from memplan.model import compiled, linear
from memplan.model.block import BackwardMoment, Moment
from memplan.model.norm import output_kept
from memplan.model.dims import FP32_BYTES, MASK_BYTES, Dims, Term, residual_dropout_mask, total
from memplan.model.linear import Linear, Split, local_widths
from memplan.spec import ActivationImpl, MlpKind, ModelSpec, activation_params
from memplan.workload import MlpImpl, Recompute, TeFp8Recipe, Workload


def mlp_terms(prefix: str, spec: ModelSpec, dm: Dims, ffn: int, tokens: int) -> list[Term]:
    """A dense MLP of width ``ffn`` over ``tokens`` tokens, TP-split."""
    elements = tokens * ffn // dm.tp
    if not linear.keeps_input(mlp_linears(spec, ffn)[-1:], dm):
        # the down projection's input is saved for its weight's gradient alone: frozen, the
        # last name (its input) is not saved (gated: prod; GELU: act), but ReLU's output
        last = ".prod" if spec.mlp.gated else ".act"
        return [Term(n, 0 if n.endswith(last) and spec.mlp is not MlpKind.RELU else size)
                for n, size in _mlp_terms(prefix, spec, dm, ffn, tokens)]
    if dm.te_fp8 is not TeFp8Recipe.NONE and spec.mlp is not MlpKind.RELU:
        # the down projection saves an fp8 copy of its input (linear.te_fp8_input_bytes):
        # the activation's output is saved by nobody else (gated: prod; GELU: act)
        last = ".prod" if spec.mlp.gated else ".act"
        return [Term(n, 0) if n.endswith(last) else Term(n, size)
                for n, size in _mlp_terms(prefix, spec, dm, ffn, tokens)]
    if dm.float8_tp:
        return _float8_tp_terms(prefix, spec, dm, ffn, tokens)
    return _mlp_terms(prefix, spec, dm, ffn, tokens)


def _float8_tp_terms(prefix: str, spec: ModelSpec, dm: Dims, ffn: int,
                     tokens: int) -> list[Term]:
    """Under torchao's float8 tensor-parallel styles the down projection saves the float8
    cast of its input (``Float8RowwiseParallel``: ``linear.float8_tp_input_bytes``): the
    activation's output is saved by nobody else (gated: prod; GELU: act), ReLU's by its own
    backward."""
    last = f"{prefix}.prod" if spec.mlp.gated else f"{prefix}.act"
    cast = Term(f"{prefix}.down_float8", linear.float8_tp_input_bytes(tokens, ffn // dm.tp))
    return [Term(n, 0) if n == last and spec.mlp is not MlpKind.RELU else Term(n, size)
            for n, size in _mlp_terms(prefix, spec, dm, ffn, tokens)] + [cast]


def _mlp_terms(prefix: str, spec: ModelSpec, dm: Dims, ffn: int, tokens: int) -> list[Term]:
    elements = tokens * ffn // dm.tp
    if spec.mlp.gated:
        names = ("gate", "act", "up", "prod")
    elif spec.mlp is MlpKind.RELU:
        names = ("act",)  # ReLU's backward reads its output, which the next linear saves too
    elif spec.activation_impl is ActivationImpl.GELU_NEW:
        return [Term(f"{prefix}.{n}", elements * size)
                for n, size in gelu_new_saved(dm).items()]
    elif spec.activation_impl is ActivationImpl.XIELU:
        return [Term(f"{prefix}.{n}", elements * size) for n, size in xielu_saved(dm).items()]
    else:
        names = ("fc1", "act")
    return [Term(f"{prefix}.{n}", elements * dm.e) for n in names]


def gelu_new_saved(dm: Dims) -> dict[str, int]:
    """Bytes per element of what transformers' NewGELUActivation formula (activations.py:
    0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3))))) leaves saved, with the down
    projection's saved input (``act``). Its autograd: pow saves its input, tanh its output,
    (0.5 * x) * (1 + tanh) both factors. Under CUDA autocast ``pow`` is an fp32 op
    (aten/src/ATen/autocast_mode.h AT_FORALL_FP32), so it saves an fp32 cast of x (x itself,
    which nothing else saves, is freed); tanh, the adds and the scalar multiplies are not
    autocast ops and type-promote, so tanh and 1 + tanh are fp32, 0.5 * x stays low and their
    product is fp32, which the down projection casts back and saves (traced:
    tests/traced/test_frameworks.py gpt2-toy amp-bf16)."""
    e, wide = dm.e, (FP32_BYTES if dm.autocast else dm.e)
    return {"fc1": wide, "gelu_tanh": wide, "gelu_half_x": e, "gelu_one_plus_tanh": wide,
            "act": e}


def xielu_saved(dm: Dims) -> dict[str, int]:
    """Bytes per element of what transformers' xIELU formula leaves saved (activations.py
    XIELUActivation._xielu_python: where(x > 0, alpha_p * x * x + beta * x,
    (expm1(min(x, eps)) - x) * alpha_n + beta * x), alpha_p and alpha_n the softplus of its
    two learned one-element parameters), with the down projection's saved input (``act``).
    Its autograd: alpha_p * x saves x (for alpha_p's gradient) and, times x again, its output;
    minimum saves x; expm1 its output; (expm1 - x) * alpha_n that difference; where its bool
    condition; beta is a buffer (no gradient), so beta * x saves no tensor of x's size. The
    alphas are one-element tensors, not 0-dim, so they take part in type promotion: under
    autocast (fp32 alphas, a low-precision x) alpha_p * x, both products with alpha_n, their
    sums and the output are fp32, which the down projection casts back and saves; expm1 is an
    fp32 op of CUDA's autocast (aten/src/ATen/autocast_mode.h AT_FORALL_FP32), so its output
    and the difference are fp32 too."""
    e, wide = dm.e, (FP32_BYTES if dm.autocast else dm.e)
    return {"fc1": e, "xielu_px": wide, "xielu_expm1": wide, "xielu_diff": wide,
            "xielu_mask": MASK_BYTES, "act": e}


def xielu_forward_bytes(dm: Dims) -> int:
    """Bytes per element alive beyond the saved at xIELU's forward peak: the negative branch's
    sum made (its product with alpha_n and beta * x beside it) while the positive branch's
    sum waits for the where (traced: tests/traced/test_hf_heldout.py apertus)."""
    wide = FP32_BYTES if dm.autocast else dm.e
    return 3 * wide + dm.e


@lru_cache(maxsize=256)
def mlp_linears(spec: ModelSpec, ffn: int) -> tuple[Linear, ...]:
    """An MLP of width ``ffn``, its projections in registration order: up (and gate),
    column-parallel, gate and up as one parameter with ``fused_gate_up`` (the ``mlp`` gradient
    group ends with them); down, row-parallel (``mlp_out``: its backward runs first)."""
    h, bias = spec.hidden_size, spec.mlp_bias
    down = Linear("down", "mlp_out", ffn, h, bias, Split.ROW)
    if spec.fused_gate_up:
        return Linear("gate_up", "mlp", h, 2 * ffn, bias), down
    gate = (Linear("gate", "mlp", h, ffn, bias),) if spec.mlp.gated else ()
    return Linear("up", "mlp", h, ffn, bias), *gate, down


def mlp_tensor_sizes(spec: ModelSpec, ffn: int, t: int) -> list[int]:
    """An MLP's parameter tensors on one TP rank (``mlp_linears``)."""
    return linear.all_tensor_sizes(mlp_linears(spec, ffn), t)


def act_grad_bytes(spec: ModelSpec, dm: Dims) -> int:
    """Bytes per intermediate element of the gradients an MLP's backward holds at its
    activation, beyond what stays saved (the down projection's saved input counted among
    the saved though its backward freed it: it stands for the incoming gradient of its size).
    A gated MLP the gradients of its product, activation and up projection while the product
    is freed (2 intermediates); GELU the gradients of its activation and first linear while
    the activation is freed (1); ReLU both gradients beside its saved output (2);
    transformers' gelu_new formula the gradients of its output and of both factors of its
    last product (``gelu_new_grad_bytes``)."""
    if spec.mlp.gated or spec.mlp is MlpKind.RELU:
        return 2 * dm.e
    if spec.activation_impl is ActivationImpl.GELU_NEW:
        return gelu_new_grad_bytes(dm)
    if spec.activation_impl is ActivationImpl.XIELU:
        return xielu_grad_bytes(dm)
    return dm.e


def gelu_new_grad_bytes(dm: Dims) -> int:
    """gelu_new's backward at its last product (0.5 * x) * (1 + tanh): the gradient of its
    output and the gradients of both factors, in the product's dtype (fp32 under autocast,
    where the output's gradient comes from the down projection's cast's backward, and the
    low 0.5 * x's gradient is cast down too), the down projection's saved input already freed
    (traced: tests/traced/test_frameworks.py gpt2-toy; under autocast 4 + 4 + 4 + 2 - 2 = 12
    bytes, in bf16 2 + 2 + 2 - 2 = 4)."""
    wide = FP32_BYTES if dm.autocast else dm.e
    cast = dm.e if dm.autocast else 0
    return 3 * wide + cast - dm.e


def xielu_grad_bytes(dm: Dims) -> int:
    """xIELU's backward at its peak, the product with alpha_n's (autograd runs its nodes
    latest first: the where, the negative branch's sum, beta * x, then that product): the
    gradients of the where's two branches, x's gradient so far (beta * x's), the difference's
    gradient and the product summed into alpha_n's gradient; the down projection's saved
    input (counted among the saved) and the where's bool condition (released when its node
    ran) freed: 5 - 1 intermediates less the condition's byte (traced: tests/traced/
    test_hf_heldout.py apertus, bf16 under full recompute, where this is the peak). Under
    autocast the where's gradients, the difference's and the product are fp32 and x's is
    cast to x's dtype: 4 + 4 + 2 + 4 + 4 - 2 - 1 = 15 bytes, 4 fp32 less the condition's."""
    wide = FP32_BYTES if dm.autocast else dm.e
    return 4 * wide - MASK_BYTES


def backward_moments(spec: ModelSpec, dm: Dims, *, saved: int, freed: int, run_tokens: int,
                     ffn: int, grad_inputs: int, fresh: int,
                     out_cast: int = 0, out_grad: int = 0,
                     fused_in: bool = False, in_saved: int = 0) -> list[BackwardMoment]:
    """An MLP's backward peaks over ``run_tokens`` rows of width ``ffn`` (one expert's rows in
    an MoE): the second linear's, from dropout's gradient (one intermediate gradient); the
    activation's, dropout's gradient freed; the input projections', the last weight gradient
    made while the others exist, beside ``grad_inputs`` of the (shared) input still to be
    summed. ``freed``: of ``saved``, what the backward has freed before it reaches the MLP;
    ``out_cast``: the second linear's saved weight cast (autocast), freed with its backward;
    ``out_grad``: the gradient of the second linear's output, where it is not the block
    output's (grouped experts: their rows' gradient, made by the weighting's backward);
    ``fused_in``: gate and up are one projection (``fused_gate_up``, stacked experts), whose
    output's gradient, both halves concatenated, is alive at its backward; ``in_saved``: what
    the input projections saved of their own input that is still alive while their backward
    runs (grouped experts: the dispatched rows, saved by the gate_up grouped_mm alone)."""
    h, e = spec.hidden_size, dm.e
    elements = run_tokens * ffn // dm.tp
    inner = elements * e
    grads = elements * act_grad_bytes(spec, dm)
    unsaved = (not linear.keeps_input(mlp_linears(spec, ffn)[-1:], dm)
               or dm.te_fp8 is not TeFp8Recipe.NONE)  # TE fp8: its fp8 copy instead
    if unsaved and spec.mlp is not MlpKind.RELU:
        # a frozen down projection saved no input to stand for its incoming gradient
        grads += inner
    # With dropout on the block output, the block's backward starts from dropout's gradient
    # (a new residual-sized tensor) while the incoming one stays for the skip path.
    dropout_grad = dm.rows * h * e if spec.dropout > 0 else 0
    # LoRA on the down projection: its adapter's backward before its base's
    # as a Float8Linear, the down projection's backward casts beside its input gradient
    down = mlp_linears(spec, ffn)[-1]
    lora, base = 0, inner + linear.float8_backward_bytes(down, dm)
    if dm.adapters is not None:  # the adapter's backward, then the base's
        linears = mlp_linears(spec, ffn)
        lora = linear.adapter_backward_bytes(linears[-1], dm)
        base = linear.dequant_backward_bytes(linears[-1], dm, inner)
    # as a Float8Linear, the down projection's casts before its weight's gradient exists
    casts = ([BackwardMoment("mlp_f8_down", saved - freed, dropout_grad + out_grad
                             + linear.float8_backward_peak(down, dm, inner))]
             if linear.float8_converts(down, dm) else [])
    return [
        *casts,
        # the down projection's input (the product) is freed by its node before its weight's
        # gradient hook (a ZeRO-3 bucket reduce runs there: memplan.model.sharding)
        BackwardMoment("mlp", saved - freed,
                       dropout_grad + out_grad + max(base, lora), ("mlp_out",), fresh,
                       inner if not unsaved and not lora and not casts else 0),
        BackwardMoment("mlp_act", saved - freed - out_cast, grads, ("mlp_out",)),
        BackwardMoment("mlp_in", in_saved, grad_inputs + inner * (2 if fused_in else 1),
                       ("mlp",), fresh),
    ]


def up_backward(grad_input: int, inner: int, fresh: int, impl: MlpImpl) -> BackwardMoment:
    """The up projection's backward in a gated MLP with separate gate and up projections.
    The product's backward makes both factors' gradients; of the nodes then ready autograd
    runs the one made last in forward first (the engine's ready queue takes the highest
    sequence number, torch/csrc/autograd/engine.cpp CompareNodeTaskTime). Written
    act(gate(x)) * up(x) (``MlpImpl.GENERIC``: transformers' LlamaMLP.forward
    down_proj(act_fn(gate_proj(x)) * up_proj(x))) that is the up projection's, so the
    activation's backward waits: its saved input (the gate's output, ``inner``) and its
    incoming gradient stay; litgpt's (``MlpImpl.LITGPT``: the activation after both
    projections) runs the activation's first, which frees its input and leaves the gate
    output's gradient instead. Either way beside the up projection's output gradient, its
    input's gradient (``grad_input``, made first) and its weight's (``fresh``); the output
    gradient, the node's input, is released before the weight's hook (``hook_freed``).
    Never the peak where every gradient is held (``mlp_in`` or ``mlp_act`` is larger) or
    only the fresh ones (the down projection's ``mlp``); it is where a gradient is kept to
    the next hook (DeepSpeed's extra_large_param_to_reduce, traced: tests/traced/
    test_deepspeed_trace.py test_zero2_bucket_smaller_than_a_weight)."""
    waiting = inner if impl is MlpImpl.GENERIC else 0
    return BackwardMoment("mlp_up", waiting, grad_input + 2 * inner, ("mlp_out",), fresh, inner)


def up_first(spec: ModelSpec, wl: Workload, dm: Dims) -> bool:
    """Whether ``up_backward`` is modelled: a gated MLP with its own gate and up projections
    in eager autograd, as plain linears (compiled, fused, adapters and float8 casts have
    moments of their own)."""
    linears = mlp_linears(spec, spec.ffn_hidden_size)
    return (spec.mlp.gated and not spec.fused_gate_up and not wl.compile
            and dm.adapters is None and dm.te_fp8 is TeFp8Recipe.NONE
            and not any(linear.float8_converts(lin, dm) for lin in linears)
            and linear.keeps_input(linears[-1:], dm))


def working_steps(spec: ModelSpec, wl: Workload, dm: Dims) -> tuple[tuple[str, int], ...]:
    """A gated MLP's checkpointed forward (nothing saved) module by module, the transient
    bytes of each: transformers' LlamaMLP.forward down_proj(act_fn(gate_proj(x)) *
    up_proj(x)) frees each temporary once the next op has read it, so the gate projection
    makes its output (``gate``), the activation its own beside it (``act``), the up projection
    its output beside the activation's (``up``), the product both factors' product between
    the up projection's run and the down projection's (``prod``), the down projection its
    output beside the product (``down``). Their most is ``Mlp.working_set``'s. () where the
    order is not that one (``up_first``, ``MlpImpl.GENERIC``)."""
    if not up_first(spec, wl, dm) or wl.mlp_impl is not MlpImpl.GENERIC:
        return ()
    stream = dm.rows * spec.hidden_size * dm.e
    inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
    return (("gate", inner), ("act", 2 * inner), ("up", 2 * inner), ("prod", 3 * inner),
            ("down", inner + stream))


def lora_working_steps(spec: ModelSpec, wl: Workload, dm: Dims) -> tuple[tuple[str, int], ...]:
    """``working_steps`` of a gated MLP whose projections carry LoRA adapters (traced under
    DeepSpeed's ZeRO-3, tests/traced/test_deepspeed_trace.py): each projection's base output,
    then where it is adapted its adapter's sum (``<name>_lora``, ``_adapter_steps``) beside
    what the step before left alive. () where the MLP is not a gated one of three plain
    projections or none is adapted."""
    adapted = dict(_adapter_steps(spec, dm))
    if (not adapted or not spec.mlp.gated or spec.fused_gate_up or wl.compile
            or wl.mlp_impl is not MlpImpl.GENERIC):
        return ()
    stream = dm.rows * spec.hidden_size * dm.e
    inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
    steps = (("gate", inner), ("gate_lora", None), ("act", 2 * inner), ("up", 2 * inner),
             ("up_lora", None), ("prod", 3 * inner), ("down", inner + stream),
             ("down_lora", None))
    return tuple((name, adapted[name] if size is None else size) for name, size in steps
                 if size is not None or name in adapted)


def _working_bytes(spec: ModelSpec, stream: int, inner: int) -> int:
    """The most a checkpointed MLP holds at once (nothing saved). One fused gate/up
    projection (Phi3MLP.forward: ``gate, up_states = gate_up_proj(x).chunk(2)``, then
    ``up_states * act(gate)`` and down_proj) keeps its 2 x inner output alive through the
    function, ``gate`` a view of it: beside it the activation and the product (4 x inner),
    then the product and the down projection's output (3 x inner + stream)."""
    if spec.mlp.gated and spec.fused_gate_up:
        return max(4 * inner, 3 * inner + stream)
    return max(stream + inner, (3 if spec.mlp.gated else 2) * inner)


def _gelu_new_working_bytes(spec: ModelSpec, dm: Dims, stream: int) -> int:
    """A checkpointed gelu_new MLP (nothing saved) at its formula (activations.py
    NewGELUActivation.forward: ``0.5 * input`` alive to the last product, each later step's
    input freed once the next is made, the first projection's output the caller's local until
    the activation returns): the input, 0.5 x input and two of the chain's tensors at each
    step (at pow: its output and its product with 0.044715), the chain in fp32 under
    autocast (pow an fp32 op, then type promotion: ``gelu_new_saved``); then the product
    beside its cast (autocast) and the down projection's output. Traced: GPT-2 narrowed, bf16,
    full recompute at 2 x 512 tokens: before, the forward 34.8% under (two of four tensors
    counted). 0 for another activation."""
    if spec.activation_impl is not ActivationImpl.GELU_NEW:
        return 0
    elements = dm.tokens * spec.ffn_hidden_size // dm.tp
    wide = FP32_BYTES if dm.autocast else dm.e
    cast = dm.e if dm.autocast else 0
    return max(elements * (2 * dm.e + 2 * wide), elements * (wide + cast) + stream)


def _adapter_steps(spec: ModelSpec, dm: Dims) -> tuple[tuple[str, int], ...]:
    """A checkpointed MLP's (nothing saved) moments at its adapters, in the order they run:
    each adapted projection's adapter (``linear.adapter_checkpointed_bytes``) beside its base
    output and what the forward left alive before it, in LlamaMLP.forward's order
    (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``): at the gate its output; at up the
    activation's output and up's; at the down projection the product and its output. An
    ungated MLP: the first linear's output, then the activation's output beside the second's;
    one fused gate/up projection (Phi3MLP) keeps its output through the function (traced:
    tests/traced/test_finetune.py, peft's LoRA on every linear under gradient
    checkpointing). () without adapters on the MLP."""
    if dm.adapters is None:
        return ()
    stream = dm.rows * spec.hidden_size * dm.e
    inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
    linears = {lin.name: lin for lin in mlp_linears(spec, spec.ffn_hidden_size)}
    if spec.fused_gate_up:
        before = {"gate_up": 2 * inner, "down": 3 * inner + stream}
    elif not spec.mlp.gated:
        before = {"up": inner, "down": inner + stream}
    else:
        before = {"gate": inner, "up": 2 * inner, "down": inner + stream}
    return tuple((f"{name}_lora", size + linear.adapter_checkpointed_bytes(linears[name], dm))
                 for name, size in before.items() if dm.adapters.adapts(linears[name]))


def _lora_working_bytes(spec: ModelSpec, dm: Dims) -> int:
    """The most a checkpointed MLP holds at its adapters (``_adapter_steps``; 0 without)."""
    return max((size for _, size in _adapter_steps(spec, dm)), default=0)


def rerun_pending_bytes(spec: ModelSpec, dm: Dims) -> int:
    """Gradients made before a checkpointed layer's rerun starts, alive through it, beyond the
    stream's: with an adapter on the down projection (its last op), the layer's backward
    runs the adapter sum's nodes first, which need no saved tensor (peft's ``result.to(
    dtype)``, ``result + lora_B(...) * scaling``): the base output's gradient in the compute
    dtype (a cast of the sum's, where the base computes in another dtype than the adapters)
    and the scaled product's in the adapters' (``grad * scaling``), both waiting for nodes
    whose saved tensors the rerun makes (traced: tests/traced/test_finetune.py, bf16 base: a
    131,072 B and a 262,144 B tensor at T = 256, h = 256; fp32 base: the second alone).
    0 otherwise, and compiled: the layer is one autograd node, the sum inside it."""
    down = mlp_linears(spec, spec.ffn_hidden_size)[-1]
    if dm.adapters is None or not dm.adapters.adapts(down) or dm.compiled:
        return 0
    low = linear.adapter_math_bytes(dm)
    rows_out = dm.tokens * local_widths(down, dm.tp)[1]
    # the sum's backward hands its gradient on as it is where base and adapter share a dtype
    # (fp32 weights; autocast), and casts it for the base's where they differ
    return rows_out * (low + (dm.e if dm.e != low else 0))


def rerun_stop_bytes(spec: ModelSpec, dm: Dims) -> int:
    """Beyond what the layer saves, at a checkpointed layer's rerun stop where the down
    projection has an adapter (the rerun stops at ``lora_B``'s pack of its rank-r input, made
    before ``lora_B`` runs): the down projection's input (the product, saved by no one: the
    frozen base keeps no input and ``lora_A`` keeps its own cast, or with dropout dropout's
    output), unless the adapter saves that very tensor (``linear.keeps_input``); and with
    dropout the adapters' cast of it, bound to peft's local x (traced: tests/traced/
    test_finetune.py, LoRA on every linear with dropout under gradient checkpointing, the
    first layer's rerun at ``lora_A``'s output). 0 otherwise, and compiled: the compiled
    forward reruns whole, its saved set packed when it returns (``compiled.in_checkpoint``)."""
    down = mlp_linears(spec, spec.ffn_hidden_size)[-1]
    ad = dm.adapters
    if ad is None or not ad.adapts(down) or dm.compiled:
        return 0
    d_in, _ = local_widths(down, dm.tp)
    product = 0 if linear.keeps_input((down,), dm) else dm.tokens * d_in * dm.e
    cast = (dm.tokens * d_in * ad.weight_bytes
            if ad.dropout > 0 and not dm.autocast and dm.e != ad.weight_bytes else 0)
    return product + cast


def compiled_lora(spec: ModelSpec, dm: Dims) -> bool:
    """A compiled gated MLP (gate and up apart) with an adapter on one of its projections:
    its forward and backward peak at Inductor's fused pointwise kernels
    (``compiled.lora_mlp_forward``, ``compiled.lora_mlp_backward``)."""
    ad = dm.adapters
    return (dm.compiled and ad is not None and spec.mlp.gated and not spec.fused_gate_up
            and any(ad.adapts(lin) for lin in mlp_linears(spec, spec.ffn_hidden_size)))


def dropout_mask_bytes(spec: ModelSpec, dm: Dims) -> int:
    """The block output's dropout mask: freed when the MLP's backward starts."""
    return dm.rows * spec.hidden_size * MASK_BYTES if spec.dropout > 0 else 0


def _frozen_forward(spec: ModelSpec, dm: Dims, saved: int) -> list[Moment]:
    """LoRA (frozen weights): the up projection's adapter sum (``linear.
    adapter_forward_bytes``) beside its base output, before that output is saved and before
    the down projection runs (its adapter's terms not made yet); the down projection's, with
    its input alive though unsaved. The block's input (the norm's output), saved by no one,
    is alive until the block returns (its caller's variable)."""
    ffn = spec.ffn_hidden_size
    linears = mlp_linears(spec, ffn)
    up, down = linears[0], linears[-1]
    base_out = dm.tokens * local_widths(up, dm.tp)[1] * dm.e
    stream = dm.rows * spec.hidden_size * dm.e
    block_in = 0 if output_kept("mlp_norm", dm) else dm.linear_rows * spec.hidden_size * dm.e
    # made after up's adapter sum: the down projection's adapter terms, up's output (saved
    # by the product) and the product where the down projection's adapter saves it itself
    # (``linear.keeps_input``: an fp32 base)
    last = ".prod" if spec.mlp.gated else ".act"
    kept = sum(t.size_bytes for t in mlp_terms("mlp", spec, dm, ffn, dm.tokens)
               if t.name.endswith(last) and linear.keeps_input((down,), dm))
    later = (total(linear.adapter_terms("mlp", (down,), dm))
             + (base_out if spec.mlp.gated else 0) + kept)
    inner = 0 if linear.keeps_input((down,), dm) else dm.tokens * ffn // dm.tp * dm.e
    return [Moment("mlp_lora", saved - later,
                   block_in + base_out + linear.adapter_forward_bytes(up, dm)),
            Moment("mlp_down", saved, block_in + inner
                   + linear.dequant_forward_bytes(down, dm, stream)
                   + linear.adapter_forward_bytes(down, dm))]


def _float8_forward(spec: ModelSpec, dm: Dims, terms: list[Term]) -> list[Moment]:
    """As ``Float8Linear``s (``linear.float8_forward_peak``), the input projections' moments,
    in the order they run (gate, its activation, up; or the one fused or first linear): each
    beside what the block saved before it. None unconverted."""
    linears = mlp_linears(spec, spec.ffn_hidden_size)[:-1]
    if not any(linear.float8_converts(lin, dm) for lin in linears):
        return []
    inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
    if len(linears) == 1:  # fused gate_up, or an ungated MLP's first linear
        width = 2 if spec.fused_gate_up else 1
        return [Moment("mlp_f8_in", 0, linear.float8_forward_peak(linears[0], dm,
                                                                  width * inner))]
    up, gate = linears
    before_up = sum(t.size_bytes for t in terms if t.name.endswith((".gate", ".act")))
    return [Moment("mlp_f8_gate", 0, linear.float8_forward_peak(gate, dm, inner)),
            Moment("mlp_f8_up", before_up, linear.float8_forward_peak(up, dm, inner))]


def _float8_backward(spec: ModelSpec, dm: Dims, terms: list[Term]) -> list[BackwardMoment]:
    """As ``Float8Linear``s (``linear.float8_backward_peak``), the input projections'
    backward moments after the down projection's: up's first (made later in forward), its
    output's gradient beside the activation's, the gate's output still saved for the
    activation's backward; then the gate's, beside up's input gradient. None unconverted."""
    linears = mlp_linears(spec, spec.ffn_hidden_size)[:-1]
    if not any(linear.float8_converts(lin, dm) for lin in linears):
        return []
    inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
    # the input's gradient as the matmul makes it: all tokens under DTensor sequence
    # parallelism (reduce-scattered after, by the input's redistribute)
    grad_in = dm.linear_rows * spec.hidden_size * dm.e
    if len(linears) == 1:
        width = 2 if spec.fused_gate_up else 1
        return [BackwardMoment("mlp_f8_in", 0, width * inner + linear.float8_backward_peak(
            linears[0], dm, grad_in), ("mlp_out",))]
    up, gate = linears
    gate_saved = sum(t.size_bytes for t in terms if t.name.endswith(".gate"))
    return [BackwardMoment("mlp_f8_up", gate_saved, 2 * inner
                           + linear.float8_backward_peak(up, dm, grad_in), ("mlp_out",)),
            BackwardMoment("mlp_f8_gate", 0, grad_in + inner
                           + linear.float8_backward_peak(gate, dm, grad_in), ("mlp_out",))]


class Mlp:
    """A dense feed-forward of ``spec.ffn_hidden_size``, TP-split."""

    name = "mlp"

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        terms = mlp_terms("mlp", spec, dm, spec.ffn_hidden_size, dm.tokens)
        linears = mlp_linears(spec, spec.ffn_hidden_size)
        if wl.compile:
            terms = compiled.mlp_terms(terms, spec.mlp.gated)
            if compiled.float8_recomputed(linears[-1:], dm):
                # the down projection's input, recomputed
                terms = [t for t in terms if not t.name.endswith(".prod")]
            terms += compiled.float8_scales("mlp", linears, dm)
            terms += compiled.float8_tp_weights("mlp", linears, dm, recompute)
            terms += compiled.float8_rebuilt_casts("mlp", linears, spec, wl, dm)
        return (terms + linear.saved_terms("mlp", linears, dm)
                + residual_dropout_mask("mlp", spec, dm))

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        terms = self.saved(spec, wl, dm, recompute)
        saved = total(terms)
        stream = dm.rows * spec.hidden_size * dm.e
        # its output before the residual add, then beside the add's output; compiled, the add
        # writes into the down projection's output (``compiled.MLP_OUTPUTS``)
        # as a Float8Linear, the down projection's float8 casts' working set before its output
        down = linear.float8_forward_peak(mlp_linears(spec, spec.ffn_hidden_size)[-1], dm,
                                          stream)
        moments = [Moment("mlp", saved, max(
            compiled.mlp_outputs_bytes(stream, dm) if wl.compile else 2 * stream, down))]
        moments += _float8_forward(spec, dm, terms)
        if compiled_lora(spec, dm):
            moments.append(compiled.lora_mlp_forward(mlp_linears(spec, spec.ffn_hidden_size),
                                                     dm, saved))
        elif dm.adapters is not None:
            moments += _frozen_forward(spec, dm, saved)
        if spec.activation_impl is ActivationImpl.XIELU:
            # its formula's temporaries before the down projection's input (and, under
            # autocast, its weight's cast) exists
            inner = dm.tokens * spec.ffn_hidden_size // dm.tp
            down = linear.saved_bytes(mlp_linears(spec, spec.ffn_hidden_size)[-1:], dm)
            moments.append(Moment("mlp_act", saved - inner * dm.e - down
                                  - dropout_mask_bytes(spec, dm), inner * xielu_forward_bytes(dm)))
        if spec.mlp is MlpKind.RELU:
            # ReLU saves its output, not its input: the first linear's output lives beside it
            # until the activation returns, before the block's output dropout mask (traced)
            moments.append(Moment("mlp_act", saved - dropout_mask_bytes(spec, dm),
                                  dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e))
        return moments

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """Gated: activation, up and product together (compiled, gate and up alone:
        ``compiled.checkpointed_mlp_working_bytes``); plain: first linear and activation, or
        its output beside the intermediate (the second linear's)."""
        stream = dm.rows * spec.hidden_size * dm.e
        inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
        down = mlp_linears(spec, spec.ffn_hidden_size)[-1]
        # as Float8Linears: the input projections' casts (nothing saved: before up only the
        # activation's output alive, its input freed), the down projection's beside its input
        f8 = [m._replace(own_bytes=0, transient_bytes=m.transient_bytes + (
                  inner if m.name == "mlp_f8_up" else 0))
              for m in _float8_forward(spec, dm, [])]
        if linear.float8_converts(down, dm):
            f8.append(Moment("mlp_f8_down", 0, inner + linear.float8_forward_peak(down, dm,
                                                                                 stream)))
        fused = compiled.checkpointed_mlp_working_bytes(
            spec, dm, mlp_linears(spec, spec.ffn_hidden_size))
        working = max(_working_bytes(spec, stream, inner) if fused is None else fused,
                      _lora_working_bytes(spec, dm), _gelu_new_working_bytes(spec, dm, stream))
        return [Moment("mlp", 0, working), *f8]

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        rows_h_e = dm.rows * spec.hidden_size * dm.e
        fresh = spec.hidden_size * spec.ffn_hidden_size // dm.tp
        inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
        terms = self.saved(spec, wl, dm, recompute)
        if compiled.swiglu_backward(spec, dm, recompute):  # Inductor's schedule
            return compiled.swiglu_moments(
                wl, dm, total(terms), inner, 2 * rows_h_e, fresh,
                linear.saved_bytes(mlp_linears(spec, spec.ffn_hidden_size)[-1:], dm),
                compiled.rerun_whole_mlp(spec, dm),
                rows_h_e if spec.norm_placement.post_norm else 0,
                compiled.scaled_residual_grad(spec, dm))
        # a plain MLP has one input projection: nothing to sum
        moments = backward_moments(
            spec, dm, saved=total(terms),
            freed=dropout_mask_bytes(spec, dm), run_tokens=dm.tokens,
            ffn=spec.ffn_hidden_size, grad_inputs=(2 if spec.mlp.gated else 1) * rows_h_e,
            fresh=fresh,
            out_cast=linear.saved_bytes(mlp_linears(spec, spec.ffn_hidden_size)[-1:], dm))
        if up_first(spec, wl, dm):  # before the input projections' moment
            up = up_backward(rows_h_e, inner, fresh, wl.mlp_impl)
            moments.insert(len(moments) - 1, up)
        if compiled_lora(spec, dm):
            moments.append(compiled.lora_mlp_backward(mlp_linears(spec, spec.ffn_hidden_size),
                                                      dm, total(terms)))
        kernels = (compiled.float8_swiglu_casts(  # Inductor's float8 kernels (a rerun's too)
            spec, wl, dm, mlp_linears(spec, spec.ffn_hidden_size), total(terms))
            if recompute is Recompute.NONE else [])
        # an eager Float8Linear's casts one by one, each with its working set: none where
        # Inductor's kernels write them (no such moment is a traced compiled block's peak)
        return moments + kernels + ([] if kernels else _float8_backward(spec, dm, terms))

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """LoRA under full recompute: the rerun saves as the first forward would have, so at
        up's adapter sum (``_frozen_forward``'s ``mlp_lora``) what the block saved before it
        is alive again beside the sum's tensors (traced: tests/traced/test_finetune.py,
        peft's LoRA on every linear under gradient checkpointing: the step's backward peak,
        in the first layer's rerun)."""
        if dm.adapters is None:
            return []
        saved = total(self.saved(spec, wl, dm, Recompute.NONE))
        if compiled_lora(spec, dm):  # the compiled forward rerun whole (``in_checkpoint``)
            return [compiled.lora_mlp_forward(mlp_linears(spec, spec.ffn_hidden_size), dm,
                                              saved)]
        return [m for m in _frozen_forward(spec, dm, saved) if m.name == "mlp_lora"]

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        """The projections', then the activation's own (xIELU's alpha_p and alpha_n)."""
        return (mlp_tensor_sizes(spec, spec.ffn_hidden_size, t)
                + [1] * activation_params(spec))

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        return (linear.all_tensor_shapes(mlp_linears(spec, spec.ffn_hidden_size), t)
                + [(1,)] * activation_params(spec))

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        """``mlp_out``: the down projection (its backward runs first); ``mlp``: all (the
        activation's own parameters among them)."""
        return linear.grad_groups(mlp_linears(spec, spec.ffn_hidden_size), t, ("mlp_out", "mlp"),
                                  {"mlp": activation_params(spec)})

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        return linear.flops_per_token(mlp_linears(spec, spec.ffn_hidden_size))
