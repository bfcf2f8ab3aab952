"""Trace a user's own ``nn.Module`` under fake tensors, for a model profile.

``memplan calibrate --device cpu --module pkg.mod:factory`` imports ``factory`` and calls it as

    def factory(*, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module

inside ``FakeTensorMode`` (weights take no memory, any size traces). The module is a causal LM:
``forward(input_ids)`` with ``input_ids`` of shape (b, s) returns logits (b, s, V), an object
or dict with ``logits``, or a tuple holding them; if ``forward`` accepts ``labels``, it is
called as ``forward(input_ids=ids, labels=targets)`` and its loss is used (Hugging Face models
shift the labels themselves); if it accepts ``targets``, as ``forward(ids, targets=targets)``
(nanoGPT). Otherwise the loss is cross-entropy on the logits upcast to fp32. The factory should create the
weights directly in ``dtype`` (a later ``.to()`` would hold a second copy while it runs).

Each (mbs, seq) point runs two training steps (the first and a steady one) of the workload's
precision recipe and optimizer under the exact tracker, which also records the saved bytes born
inside each transformer block (``find_blocks``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memplan.calibrate.records import (
    PHASES,
    Meta,
    PhaseMeasure,
    RankMeasure,
    Record,
    StepMeasure,
)
from memplan.errors import MemplanError
from memplan.parallel import ParallelConfig
from memplan.planning.timing import step_flops
from memplan.profile.distributed import ParallelTracker
from memplan.profile.trace import _TORCH_DTYPE, _fake_mode, run_steps
from memplan.spec import ModelSpec
from memplan.workload import Attention, LogitsHeld, Workload

Factory = Callable[..., nn.Module]


def load_factory(target: str) -> Factory:
    """``pkg.mod:factory`` (or ``path/to/file.py:factory``) -> the callable."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise MemplanError(f"module: expected pkg.mod:factory, got {target!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, OSError) as err:
        raise MemplanError(f"module: cannot import {module_name!r}: {err}") from err
    except (Exception, SystemExit) as err:  # the user's module failed while it ran
        raise MemplanError(f"module: importing {module_name!r} raised "
                           f"{type(err).__name__}: {_first_line(err)}") from err
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise MemplanError(f"module: {module_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise MemplanError(f"module: {target!r} is not callable")
    _check_signature(obj, target)
    return obj


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


_KWARGS = ("dtype", "device")


def _check_signature(factory: Factory, target: str) -> None:
    """The factory must be callable as ``factory(dtype=..., device=...)`` (either may be
    left out of its signature): say so before any tracing, not as a TypeError inside it."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: called as it is
        return
    required = [p for p in sig.parameters.values()
                if p.default is p.empty and p.name not in _KWARGS
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p.name for p in sig.parameters.values()
                  if p.name in _KWARGS and p.kind is p.POSITIONAL_ONLY]
    if required or positional:
        what = (f"requires {', '.join(p.name for p in required)}" if required else
                f"takes {', '.join(positional)} only by position")
        raise MemplanError(f"module: {target}{sig} {what}; memplan calls it as "
                           "factory(*, dtype, device)")


def build(factory: Factory, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs = {k: v for k, v in (("dtype", dtype), ("device", device)) if k in params}
    name = getattr(factory, "__qualname__", repr(factory))
    try:
        model = factory(**kwargs)
    except MemplanError:
        raise
    except Exception as err:  # the user's code: one line naming it, the traceback with DEBUG
        raise MemplanError(f"module: the factory {name}() raised {type(err).__name__}: "
                           f"{_first_line(err)}") from err
    if not isinstance(model, nn.Module):

        raise MemplanError(f"module: the factory returned {type(model).__name__}, not an "
                           "nn.Module")
    return model


def hf_spec(model: nn.Module) -> ModelSpec | None:
    """The spec of a Hugging Face model from its ``config`` (no transformers import here)."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    from memplan.spec import spec_from_hf_dict

    data = to_dict()
    return spec_from_hf_dict(data, f"{type(model).__name__}.config",
                             str(data.get("_name_or_path") or type(model).__name__))


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, in order: of the containers whose children share one class
    (``nn.ModuleList`` and ``nn.Sequential`` as Hugging Face, litgpt and nanoGPT hold them;
    ``nn.ModuleDict`` as torchtitan does, ``layers["0"]``...), the one holding the most
    parameters (not, say, one layer's list of experts)."""
    def children(mod: nn.Module) -> list[nn.Module]:
        return list(mod.values()) if isinstance(mod, nn.ModuleDict) else list(mod)

    def weight(mod: nn.Module) -> tuple[int, int]:
        return sum(p.numel() for p in mod.parameters()), len(mod)

    found = [mod for mod in model.modules()
             if isinstance(mod, nn.ModuleList | nn.Sequential | nn.ModuleDict) and len(mod)
             and len({type(c) for c in children(mod)}) == 1 and (len(mod) > 1 or mod is not model)]
    if not found:
        raise MemplanError(f"module: {type(model).__name__} has no nn.ModuleList, "
                           "nn.Sequential or nn.ModuleDict of blocks")
    return children(max(found, key=weight))


# Hugging Face ``config._attn_implementation`` -> the attention memplan describes it with: SDPA's
# and the flash / flex kernels save their output and logsumexp, eager the s^2 probabilities
# (transformers 5.3 modeling_utils.py ALL_ATTENTION_FUNCTIONS)
_HF_ATTENTION = {"eager": Attention.EAGER, "sdpa": Attention.FLASH,
                 "flash_attention_2": Attention.FLASH, "flash_attention_3": Attention.FLASH,
                 "flex_attention": Attention.FLASH}


def module_attention(model: nn.Module) -> tuple[Attention, str] | None:
    """The attention a Hugging Face model's config says it runs, with the config's name for
    it; None when the module has no such config (or names a kernel memplan does not know)."""
    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    if name is None and callable(getattr(config, "to_dict", None)):
        name = config.to_dict().get("attn_implementation")
    found = _HF_ATTENTION.get(name) if isinstance(name, str) else None
    return None if found is None else (found, name)


def _field(out: Any, name: str) -> torch.Tensor | None:
    """``out.<name>`` / ``out[name]``; from a tuple, the loss is its 0-dim tensor and the
    logits its 3-dim one (``(logits, loss)`` as nanoGPT returns, or ``(loss, logits)``)."""
    if isinstance(out, torch.Tensor):
        return out if name == "logits" else None
    value = out.get(name) if hasattr(out, "get") else getattr(out, name, None)
    if value is None and isinstance(out, tuple | list):
        dims = 0 if name == "loss" else 3
        value = next((v for v in out if isinstance(v, torch.Tensor) and v.dim() == dims), None)
    return value


class CausalLM(nn.Module):
    """``forward(ids, targets) -> loss`` around the user's model (what ``run_steps`` calls).
    The model computes its own loss when ``forward`` takes ``labels`` (Hugging Face, keyword
    ``input_ids``) or ``targets`` (nanoGPT, positional input); otherwise cross-entropy on its
    logits upcast to fp32."""

    def __init__(self, inner: nn.Module, *, hold: bool = False) -> None:
        super().__init__()
        self.inner = inner
        params = inspect.signature(inner.forward).parameters
        self.labels = next((k for k in ("labels", "targets") if k in params), None)
        # ``LogitsHeld.STEP``: the loop keeps the logits as a variable through backward and
        # the optimizer step, until the next step's loss replaces them (litgpt's pretrain)
        self.hold = hold
        self.held: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.labels == "labels":
            out = self.inner(input_ids=ids, labels=targets)
        elif self.labels == "targets":
            out = self.inner(ids, targets=targets)
        else:
            out = self.inner(ids)
            logits = _field(out, "logits")
            if logits is None:
                raise MemplanError("module: forward(input_ids) returned no logits")
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            self._keep(logits)
            return loss
        loss = _field(out, "loss")
        if loss is None:
            raise MemplanError(f"module: forward({self.labels}=...) returned no loss")
        self._keep(_field(out, "logits"))
        return loss

    def _keep(self, logits: torch.Tensor | None) -> None:
        if self.hold:
            self.held = logits


class BlockTracker(ParallelTracker):
    """The exact tracker plus the saved bytes born inside each block's forward."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__(timeline=True)
        self.born: dict[int, dict] = {}
        self.layer_saved: dict[int, list[int]] = {}
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda *_a, i=i: self._enter(i))
            block.register_forward_hook(lambda *_a, i=i: self._leave(i))
        self._before: dict[int, dict] = {}

    def _enter(self, i: int) -> None:
        if self.phase == "forward":  # recomputation in backward is not what forward saved
            self._before[i] = self.live()

    def _leave(self, i: int) -> None:
        if self.phase == "forward" and i in self._before:
            self.born[i] = self.born_since(self._before.pop(i))

    def set_phase(self, phase: str, step: int | None = None) -> None:
        if phase == "backward" and self.phase == "forward":
            self.layer_saved[self.step] = [self.bytes_of(self.born[i])
                                           for i in sorted(self.born)]
            self.born = {}
        super().set_phase(phase, step)


def trace_point(factory: Factory, spec: ModelSpec, wl: Workload, *, fake: bool = True
                ) -> tuple[list[StepMeasure], int]:
    """Two steps at (wl.micro_batch_size, wl.seq_len): the step measures and the parameter
    count of the model the factory built."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    try:
        with _fake_mode() if fake else _null():
            torch.manual_seed(0)
            inner = build(factory, _TORCH_DTYPE[wl.compute_dtype.value])
            model = CausalLM(inner, hold=wl.logits_held is LogitsHeld.STEP)
            tracker = BlockTracker(find_blocks(inner))
            traced = run_steps(model, spec, wl, tracker, steps=2)
    except (DataDependentOutputException, DynamicOutputShapeException,
            UnsupportedOperatorException) as err:
        raise MemplanError(f"module: the model reads tensor values, which fake tensors do not "
                           f"have ({type(err).__name__}: {str(err).splitlines()[0][:120]}); "
                           "trace a small config with --real") from err
    except MemplanError:
        raise
    except Exception as err:  # the user's forward or loss failed: MEMPLAN_DEBUG=1 shows where
        raise MemplanError(f"module: a training step of the model at micro-batch "
                           f"{wl.micro_batch_size}, sequence {wl.seq_len} raised "
                           f"{type(err).__name__}: {_first_line(err)[:200]}") from err

    flops = step_flops(spec, wl, wl.micro_batch_size, pp=1)[1]  # one process, no pipeline
    ops: dict[tuple[int, str], list[int]] = {}
    for point in tracker.timeline:
        ops.setdefault((point.step, point.phase), []).append(point.total_bytes)
    steps = []
    for st in traced.steps:
        steps.append(StepMeasure(
            step=st.step, time_s=0.0, hardware_flops=flops, achieved_flops_per_s=0.0,
            phases={p: PhaseMeasure(allocated_bytes=st.phases[p].total_bytes) for p in PHASES},
            saved_activations_bytes=st.saved_activations_bytes,
            layer_saved_bytes=tracker.layer_saved.get(st.step, []),
            # the optimizer phase does not depend on (b, s): its peak needs no envelope
            op_bytes={p: ops.get((st.step, p), []) for p in ("forward", "backward")}))
    return steps, sum(p.numel() for p in inner.parameters())


def _null():
    import contextlib

    return contextlib.nullcontext()


def default_points(max_seq: int) -> list[tuple[int, int, str]]:
    """(mbs, seq, role) with S = ``max_seq``: micro-batch 1 at four sequence lengths (its own
    regime, see ``memplan.calibrate.calibration_profile.ModelTerms``), micro-batch 2 and 3 at S/4, S/2 and
    S, micro-batch 4 at S/4 and S (12 fit points); held out: one point per regime between the
    fitted sequence lengths and one beyond the fitted micro-batch sizes."""
    s = max(16, max_seq // 16 * 16)
    q, h, t = s // 4, s // 2, 3 * s // 4
    fit = [(1, x, "fit") for x in (q, h, t, s)]
    fit += [(b, x, "fit") for b in (2, 3) for x in (q, h, s)] + [(4, q, "fit"), (4, s, "fit")]
    held = [(1, 3 * s // 8, "holdout"), (3, t, "holdout"), (6, 5 * s // 8, "holdout")]
    return fit + held


def resolve_spec(factory: Factory, spec: ModelSpec | None
                 ) -> tuple[ModelSpec, tuple[Attention, str] | None]:
    """``spec`` when given, else the one the model's Hugging Face config describes; at the
    depth the factory builds (its number of blocks). Beside it, the attention the model's
    config says it runs (``module_attention``)."""
    with _fake_mode():
        model = build(factory, torch.float32)
        found = spec or hf_spec(model)
        blocks = len(find_blocks(model))
        attention = module_attention(model)
    if found is None:
        raise MemplanError("module: the model has no Hugging Face config to read its spec from; "
                           "pass --model with the spec it implements")
    if blocks != found.num_layers:
        found = found.model_copy(update={"num_layers": blocks,
                                         "name": f"{found.name}[:{blocks}]"})
    return found, attention


# the longest sequence traced when --seq is not given: the fit's points run up to it, and
# beyond 1,024 tokens a CPU trace of a full-width model takes minutes per point
DEFAULT_MAX_SEQ = 1024
MIN_SEQ = 16  # the grid traces S/4, S/2, 3S/4 and S: a multiple of 16, at least 16


def user_points(spec: ModelSpec, max_seq: int | None = None) -> list[tuple[int, int, str]]:
    """The (mbs, seq, role) points traced: up to ``max_seq`` tokens when given (refused
    beyond the model's positions), else up to min(its positions, ``DEFAULT_MAX_SEQ``)."""
    if max_seq is None:
        return default_points(min(spec.max_seq_len, DEFAULT_MAX_SEQ))
    if max_seq < MIN_SEQ:
        raise MemplanError(f"seq ({max_seq}) must be at least {MIN_SEQ}: the traces run "
                           f"S/4, S/2, 3S/4 and S tokens")
    if max_seq > spec.max_seq_len:
        raise MemplanError(f"seq ({max_seq}) is longer than {spec.name}'s {spec.max_seq_len} "
                           f"positions (max_seq_len)")
    return default_points(max_seq)


def point_key(b: int, s: int) -> str:
    return f"model-mbs{b}-seq{s}"


def measure_user_point(factory: Factory, target: str, spec: ModelSpec, wl: Workload,
                       point: tuple[int, int, str], meta: Meta, *, fake: bool = True) -> Record:
    """One (mbs, seq) point of the user's model as a record of kind ``model``."""
    b, s, role = point
    point_wl = wl.model_copy(update={"micro_batch_size": b, "seq_len": s})
    steps, num = trace_point(factory, spec, point_wl, fake=fake)
    return Record(kind="model", key=point_key(b, s), role=role, status="ok", spec=spec,
                  layout=ParallelConfig(), workload=point_wl, num_params=num, module=target,
                  ranks=[RankMeasure(steps=steps)], meta=meta)
