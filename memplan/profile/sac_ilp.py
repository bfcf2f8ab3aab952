"""PyTorch's own SAC tools beside memplan's choice: ``torch.distributed._tools``'
``SACEstimator`` measures each op of a module (its output's bytes and its runtime) and
``sac_ilp.get_optimal_checkpointing_policy_per_module`` picks the ops to save under a
fraction of the module's bytes by an integer program (pulp's CBC).

``SACEstimator`` estimates runtimes on a CUDA device only (``RuntimeEstimator``: benchmark or
roofline); on a CPU the runtime is given in FLOPs here, in memplan's units: a matmul's from
``torch.utils.flop_counter``, the attention kernel's 2 * s * q per token (the causal half of
QK^T and PV: ``memplan.model.attention.Attention.core_flops_per_token``), one per output
element for any other op. The bytes are the estimator's own.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from memplan.spec import ModelSpec
from memplan.workload import Workload


class IlpChoice(NamedTuple):
    """What the integer program keeps of one layer at one budget, in the estimator's op
    list: the ops saved as (name, occurrence), their bytes, the FLOPs of the ops not saved
    (its objective) and of those a rerun with early stop runs (up to the last op whose
    output backward reads)."""

    saved: frozenset[tuple[str, int]]
    saved_bytes: int
    ilp_rerun_flops: float
    rerun_flops: float


def _flops(spec: ModelSpec, seq_len: int):
    def estimate(func, args, kwargs):
        with FlopCounterMode(display=False) as counter:
            out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if "scaled_dot_product" in name:
            q = args[0]
            tokens = q.shape[0] * q.shape[2]
            return out, 2.0 * seq_len * q.shape[1] * q.shape[3] * tokens
        flops = float(counter.get_total_flops())
        if flops == 0.0:
            first = out[0] if isinstance(out, (tuple, list)) else out
            flops = float(first.numel()) if isinstance(first, torch.Tensor) else 0.0
        return out, flops
    return estimate


def layer_stats(spec: ModelSpec, wl: Workload, layer: str = "ReferenceModel.blocks.0"):
    """``SACStats`` of one decoder layer of the reference model, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.profile.reference import ReferenceModel
    from memplan.profile.trace import ref_options

    with FakeTensorMode():
        model = ReferenceModel(spec, ref_options(wl))
        ids = torch.randint(0, spec.vocab_size, (wl.micro_batch_size, wl.seq_len))
        return module_stats(lambda: model(ids, ids).backward(), layer, spec, wl.seq_len)[0]


def module_stats(step, layer: str, spec: ModelSpec, seq_len: int) -> tuple[object, list]:
    """``SACEstimator``'s statistics of the module named ``layer`` (its tracker's name, e.g.
    ``LlamaForCausalLM.model.layers.0``) over ``step()`` (a forward and backward, called
    inside the caller's ``FakeTensorMode``; runtimes in FLOPs, ``_flops``), and the module's
    forward ops in the statistics' order, each as (op, args, kwargs): what a policy function
    is asked of them."""
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP, SACEstimator

    estimator = SACEstimator()
    flops = _flops(spec, seq_len)
    ops: list = []

    def runtime(func, args, kwargs):
        tracker = estimator._mod_tracker
        if layer in tracker.parents and not tracker.is_bw and func not in OPS_TO_ALWAYS_SKIP:
            ops.append((func, args, kwargs))
        return flops(func, args, kwargs)

    with estimator(estimate_mode_type="operator-level-cost-model"):
        estimator._estimate_runtime = runtime  # CPU: FLOPs
        step()
    stats = estimator.sac_mod_stats[layer]
    if [op.overloadpacket.__name__ for op, _, _ in ops] != stats.func_names:
        raise AssertionError(f"{layer}: the recorded forward ops differ from the estimator's")
    return stats, ops


def policy_ops(ops: list, policy_fn) -> set[int]:
    """The indices of ``ops`` (``module_stats``) that ``policy_fn`` (an emitted policy's, for
    the layer's forward) saves."""
    from torch.utils.checkpoint import CheckpointPolicy

    class Forward:  # the context a policy reads: not the rerun
        is_recompute = False

    return {i for i, (op, args, kwargs) in enumerate(ops)
            if policy_fn(Forward(), op, *args, **kwargs) is CheckpointPolicy.MUST_SAVE}


def no_recompute(stats) -> IlpChoice:
    """The layer without a checkpoint, in the estimator's terms: it saves what autograd saves
    and reruns nothing."""
    saved = frozenset(stats.saved_autograd_ops)
    return IlpChoice(frozenset(occurrences(stats.func_names)[i] for i in saved),
                     sum(stats.memory[i] for i in saved), 0.0, 0.0)


def occurrences(names: list[str]) -> list[tuple[str, int]]:
    seen: Counter = Counter()
    out = []
    for name in names:
        out.append((name, seen[name]))
        seen[name] += 1
    return out


def ilp_choice(stats, fraction: float) -> IlpChoice:
    """The integer program's choice at ``fraction`` of the layer's op bytes, solved as
    PyTorch sets CBC up (``gapRel=0.05``) but without its 10 s time limit, so that the answer
    is the same on any machine however loaded (these programs solve in milliseconds)."""
    from torch.distributed._tools import sac_ilp

    solver = sac_ilp.PULP_CBC_CMD

    def untimed(*args, **kwargs):
        kwargs.pop("timeLimit", None)
        return solver(*args, **kwargs)

    sac_ilp.PULP_CBC_CMD = untimed
    try:
        x = sac_ilp.get_optimal_checkpointing_policy_per_module(stats, fraction)
    finally:
        sac_ilp.PULP_CBC_CMD = solver
    return choice_of(stats, {i for i, v in enumerate(x) if v})


def choice_of(stats, saved: set[int]) -> IlpChoice:
    """A set of saved op indices in the estimator's terms. The rerun under early stop runs up
    to the last op whose output autograd saves (``saved_autograd_ops``)."""
    last = max(stats.saved_autograd_ops)
    names = occurrences(stats.func_names)
    return IlpChoice(frozenset(names[i] for i in saved),
                     sum(stats.memory[i] for i in saved),
                     sum(r for i, r in enumerate(stats.runtimes) if i not in saved),
                     sum(r for i, r in enumerate(stats.runtimes)
                         if i not in saved and i <= last))


def policy_fns(saved: frozenset[tuple[str, int]], counts: Counter, num_layers: int) -> tuple:
    """A policy per layer saving the ops ``saved`` names (by name and occurrence in the
    layer; ``counts``: each name's ops per layer, so that later steps count alike), for
    ``RefOptions.policy_fns``."""
    from torch.utils.checkpoint import CheckpointPolicy

    def make():
        seen: Counter = Counter()

        def policy_fn(ctx, op, *args, **kwargs):
            name = op.overloadpacket.__name__
            nth = seen[name] % max(counts[name], 1)
            seen[name] += 1
            return (CheckpointPolicy.MUST_SAVE if (name, nth) in saved
                    else CheckpointPolicy.PREFER_RECOMPUTE)
        return policy_fn

    return tuple(make() for _ in range(num_layers))


def memplan_ops(stats, kept_names: tuple[str, ...], spec: ModelSpec, tokens: int,
                e: int) -> set[int]:
    """The estimator's op indices of memplan's kept items: the projections by their order
    among the layer's matmuls, the attention kernel, the activation, the gated product (the
    one ``mul`` of T x f elements), and the k-th norm's ops (``memplan.model.sac_ops.
    _norm_ops``; the reference model has no q/k norms): its casts the (2k)-th and (2k+1)-th
    ``_to_copy``, its ``rsqrt`` the k-th, its output the ``mul`` after its second cast."""
    matmuls = [i for i, n in enumerate(stats.func_names) if n in ("mm", "addmm")]
    copies = [i for i, n in enumerate(stats.func_names) if n == "_to_copy"]
    rsqrts = [i for i, n in enumerate(stats.func_names) if n == "rsqrt"]
    order = ["attn.q", "attn.k", "attn.v", "attn.o_proj", "mlp.gate", "mlp.up"]
    norm_ops = {"input_fp32": lambda k: copies[2 * k], "stats": lambda k: rsqrts[k],
                "normed": lambda k: copies[2 * k + 1], "output": lambda k: copies[2 * k + 1] + 1}
    out = set()
    for name in kept_names:
        norm, _, part = name.partition(".")
        if norm in ("attn_norm", "mlp_norm"):
            out.add(norm_ops[part](("attn_norm", "mlp_norm").index(norm)))
        elif name in order:
            out.add(matmuls[order.index(name)])
        elif name == "attn.out":
            out.add(next(i for i, n in enumerate(stats.func_names) if "scaled_dot" in n))
        elif name == "mlp.act":
            out.add(next(i for i, n in enumerate(stats.func_names) if n in ("silu", "gelu")))
        elif name == "mlp.prod":
            size = tokens * spec.ffn_hidden_size * e
            out.add(next(i for i, (n, m) in enumerate(zip(stats.func_names, stats.memory))
                         if n == "mul" and m == size))
    return out
