"""What Inductor's partitioner saves for backward in a compiled decoder layer, traced on CPU.

A transformers ``LlamaDecoderLayer`` is compiled on its own (as torchtitan's
``apply_compile`` compiles each decoder layer: torchtitan/distributed/compile.py), optionally
wrapped in non-reentrant activation checkpointing first (torchtitan checkpoints, then
compiles: torchtitan/models/llama3/parallelize.py). One forward and backward run; the
partition Inductor makes (``torch._inductor.compile_fx.partition_fn`` calls
``min_cut_rematerialization_partition``) is recorded: the forward graph's outputs beyond the
layer's own are the tensors saved for backward, with their sizes from the fake values.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple


class SavedTensor(NamedTuple):
    """One tensor the compiled forward saves: its node, op, shape, dtype and bytes;
    ``graph_input``: a graph input (the layer's input, a weight, the RoPE tables) rather than
    a tensor the forward made; ``input_view``: a view of a graph input (a tensor-parallel
    weight's local shard transposed for backward), no storage of its own."""

    name: str
    op: str
    shape: tuple[int | str, ...]  # a symbolic size by its name
    dtype: str
    size_bytes: int
    graph_input: bool
    input_view: bool = False


# aten ops whose output aliases their first argument's storage
_VIEW_OPS = frozenset(("aten.view.default", "aten.permute.default", "aten.t.default",
                       "aten.transpose.int", "aten.expand.default", "aten.alias.default",
                       "aten.unsqueeze.default", "aten.squeeze.dim", "aten.slice.Tensor",
                       "aten.select.int", "aten._unsafe_view.default"))


def _view_base(node: Any) -> Any:
    """The node at the end of ``node``'s chain of views (``_VIEW_OPS``): itself if none."""
    while node.op == "call_function" and str(node.target) in _VIEW_OPS:
        node = node.args[0]
    return node


def _views_input(node: Any) -> bool:
    """Whether ``node`` is a chain of views of a graph input."""
    return _view_base(node).op == "placeholder"


@contextlib.contextmanager
def _recursion_limit_kept() -> Iterator[None]:
    """Inductor raises the interpreter's recursion limit while it compiles (and leaves it
    raised); a trace leaves the process as it found it."""
    limit = sys.getrecursionlimit()
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def _record(rows: list[list[SavedTensor]]):
    import torch

    from torch._inductor import compile_fx

    original = compile_fx.min_cut_rematerialization_partition

    def recording(gm: Any, joint_inputs: Any, **kwargs: Any):
        fw, bw = original(gm, joint_inputs, **kwargs)
        outputs = next(iter(fw.graph.find_nodes(op="output"))).args[0]
        saved = []
        symbols: dict[str, str] = {}
        for node in outputs[kwargs["num_fwd_outputs"]:]:
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor):
                continue  # symbolic sizes, RNG seeds
            numel = int(value.numel()) if all(isinstance(d, int) for d in value.shape) else 0
            # a symbolic size as its text ("u0"): the record holds no live shape environment
            shape = tuple(d if isinstance(d, int) else _symbol_text(d, symbols)
                          for d in value.shape)
            saved.append(SavedTensor(node.name, str(node.target), shape,
                                     str(value.dtype).removeprefix("torch."),
                                     numel * value.element_size(), node.op == "placeholder",
                                     node.op != "placeholder" and _views_input(node)))
        rows.append(saved)
        return fw, bw

    return compile_fx, original, recording


def _symbol_text(size: Any, names: dict[str, str]) -> str:
    """A symbolic size's text with its symbols numbered in the order this graph's saved set
    first shows them (``u0``, ``s0``, ...): the shape environment numbers them across the
    process (``s18`` in one run is ``s43`` in another), so the same graph reads the same."""
    def rename(match: re.Match) -> str:
        prefix = match.group(1)
        key = match.group(0)
        if key not in names:
            taken = sum(1 for v in names.values() if re.fullmatch(rf"{prefix}\d+", v))
            names[key] = f"{prefix}{taken}"
        return names[key]

    return re.sub(r"\b([a-z]+)(\d+)\b", rename, str(size))


def _layer(config: dict, dtype_name: str, batch: int, seq: int):
    """A decoder layer in ``dtype_name``, a function running it on a hidden-state tensor, and
    its input for ``batch`` sequences of ``seq`` tokens. ``config``: a transformers
    config.json dict (its ``LlamaDecoderLayer``, SDPA attention, with RoPE tables made once
    outside the layer as ``LlamaModel`` makes them) or, with ``"torchtitan"`` set to the
    keywords of ``memplan.profile.frameworks.torchtitan_config``, torchtitan's Llama3 block
    (its RoPE cache a buffer of the block, SDPA attention; with ``"float8"`` among them, a
    recipe name, its linears converted as torchtitan's float8 converter converts them)."""
    import torch

    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    if "torchtitan_moe" in config:
        return _titan_moe_block(config["torchtitan_moe"], dtype, batch, seq)
    if "torchtitan" in config and config["torchtitan"].get("tp", 1) > 1:
        return _tp_block(config["torchtitan"], dtype, batch, seq)
    if "torchtitan" in config:
        from memplan.profile.frameworks import _float8, torchtitan_config

        fields = dict(config["torchtitan"])
        float8 = fields.pop("float8", "none")
        cfg = torchtitan_config(**fields, seq_len=seq)
        layer = _titan_params_to(cfg.layers[0].build(), dtype)
        for param in layer.parameters():  # its own init needs the model's; any values do
            torch.nn.init.normal_(param, std=0.02)
        if float8 != "none":  # torchao's Float8Linear on its linears (torchtitan's converter)
            _float8(layer, float8, False)
        x = torch.randn(batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
        return layer, (lambda h: layer(h, None, None)), x
    if config.get("model_type", "llama") != "llama":
        return _hf_layer(config, dtype, batch, seq)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**config)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).to(dtype)
    x = torch.randn(batch, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
    positions = torch.arange(seq)[None].expand(batch, seq)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, positions)

    def run(h):
        out = layer(h, attention_mask=None, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    return layer, run, x


def _titan_params_to(module: Any, dtype: Any) -> Any:
    """``module`` (torchtitan's) with its parameters cast to ``dtype`` and its buffers as
    torchtitan 0.3.0 holds them: the Llama3 RoPE cache complex64
    (models/common/rope.py ``ComplexRoPE._precompute_cache``: ``.float()`` then
    ``torch.polar``), Qwen3's cos/sin cache fp32 (``CosSinRoPE._precompute_cache``), the MoE
    counters fp32 (models/common/moe.py ``MoE.__init__``, ``_init_self_buffers``).
    torchtitan never casts a buffer: FSDP2's ``MixedPrecisionPolicy`` casts parameters
    only, and under ``training.dtype`` bfloat16 (trainer.py ``Trainer.__init__``: the model
    built on meta inside ``set_default_dtype``) ``init_weights`` recomputes the buffers after
    ``to_empty`` with those explicit dtypes. ``nn.Module.to(dtype)`` would cast them too
    (torch 2.13 nn/modules/module.py ``Module.to``: ``convert`` casts complex tensors to a
    real dtype, dropping the imaginary part)."""
    for param in module.parameters():
        param.data = param.data.to(dtype)
    return module


def _titan_moe_block(fields: dict, dtype, batch: int, seq: int):
    """torchtitan's Qwen3 MoE block (``memplan.profile.frameworks.torchtitan_moe_config``'s
    keywords, routing held balanced) in ``dtype``, its buffers fp32 as ``init_states`` makes
    them, its router's gate as CUDA's fp32 autocast runs it (``_titan_router_fp32``), traced
    with ``capture_scalar_outputs`` as torchtitan's ``apply_compile`` sets it."""
    import torch

    from memplan.profile.frameworks import _titan_router_fp32, torchtitan_moe_config

    torch._dynamo.config.capture_scalar_outputs = True
    cfg = torchtitan_moe_config(**fields, seq_len=seq)
    layer = _titan_params_to(cfg.layers[0].build(), dtype)  # expert counters, cache: fp32
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    _titan_router_fp32(layer)
    x = torch.randn(batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
    return layer, (lambda h: layer(h, None, None)), x


def _tp_block(fields: dict, dtype, batch: int, seq: int):
    """torchtitan's Llama3 block on rank 0 of a ``tp``-rank mesh of the fake process group
    (``fields``: ``torchtitan_config``'s keywords with ``tp``, ``sp`` (default True) and
    ``float8``), parallelised as ``build_torchtitan`` parallelises it: 0.3.0's own sharding
    configs (rowwise float8: its converter's ``Float8Linear`` configs,
    ``frameworks._float8_configs``), or torchao's float8 TP styles with tensorwise
    (``frameworks._float8_tp_plan``), applied by ``model.parallelize`` on the TP mesh alone
    (``parallelize_llama`` without FSDP). Its input is the residual stream's DTensor:
    sequence-sharded under SP, replicated without."""
    import torch
    import torchtitan.distributed.parallel_dims as pd
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    from memplan.profile.frameworks import (
        _float8,
        _float8_configs,
        _float8_tp_plan,
        torchtitan_config,
    )

    fields = dict(fields)
    tp, sp, float8 = fields.pop("tp"), fields.pop("sp", True), fields.pop("float8", "none")
    cfg = torchtitan_config(**fields, seq_len=seq)
    if float8 == "rowwise":
        _float8_configs(cfg, float8)
    if float8 == "tensorwise":
        from torchtitan.models.common.decoder_sharding import set_decoder_sharding_config

        set_decoder_sharding_config(cfg, enable_sp=sp)
    else:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(cfg, enable_sp=sp)
    with torch.device("cpu"):
        model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    model = _titan_params_to(model, dtype)
    if float8 == "tensorwise":
        _float8(model, float8, False)
        _float8_tp_plan(model, sp)
    parallelism = ParallelismConfig(tensor_parallel_degree=tp, enable_sequence_parallel=sp,
                                    spmd_backend="partial_dtensor")
    device_type = pd.device_type
    pd.device_type = "cpu"  # torchtitan falls back to "cuda" when no accelerator is found
    try:
        dims = ParallelDims.from_config(parallelism, world_size=tp)
        dims.build_mesh()
        model.parallelize(dims)
    finally:
        pd.device_type = device_type
    layer = model.layers["0"]
    local = torch.randn(batch, seq // tp if sp else seq, cfg.dim, dtype=dtype,
                        requires_grad=True)
    x = DTensor.from_local(local, dims.get_mesh("tp"), (Shard(1) if sp else Replicate(),),
                           run_check=False)
    return layer, (lambda h: layer(h, None, None)), x


def _hf_layer(config: dict, dtype, batch: int, seq: int):
    """A transformers decoder layer of ``config``'s family (its ``model_type``: the
    ``*DecoderLayer`` and ``*RotaryEmbedding`` of ``models/<type>/modeling_<type>.py``), SDPA
    attention and, for stacked experts, the ``grouped_mm`` experts implementation (the
    default ``get_correct_experts_implementation`` picks), its parameters drawn at std 0.02."""
    import importlib

    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**config)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    # a text model type inside a multimodal family's module (gemma3_text: models/gemma3)
    kind = model_type_to_module_name(config["model_type"])
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    names = dir(module)
    layer_cls = getattr(module, next(n for n in names if n.endswith("DecoderLayer")))
    rope_cls = getattr(module, next(n for n in names if n.endswith("RotaryEmbedding")))
    layer = layer_cls(cfg, 0).to(dtype)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    x = torch.randn(batch, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
    positions = torch.arange(seq)[None].expand(batch, seq)
    # per layer type tables (Gemma 3: sliding and full attention, ``rope_type`` a dict of
    # them): layer 0's
    rope = rope_cls(cfg)
    per_type = isinstance(getattr(rope, "rope_type", None), dict)
    cos, sin = (rope(x, positions, layer_type=cfg.layer_types[0]) if per_type
                else rope(x, positions))

    def run(h):
        out = layer(h, attention_mask=None, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    return layer, run, x


@contextlib.contextmanager
def _transformers_logging_ignored() -> Iterator[None]:
    """transformers 5.3's grouped experts ask ``is_grouped_mm_available()`` on every call
    (integrations/moe.py ``_can_use_grouped_mm``); Dynamo traces through its ``lru_cache``
    into ``_is_package_available``'s ``logger.debug``, a graph break, which ``fullgraph``
    refuses. The logger ignored, the layer is one graph; what it saves is what the broken
    graphs save (the same 525,328 B on the Qwen3-MoE toy, measured either way by
    saved-tensor hooks on the real storages)."""
    import torch

    try:
        from transformers.utils import import_utils
    except ImportError:
        yield
        return
    with torch._dynamo.config.patch(ignore_logging_functions={import_utils.logger.debug}):
        yield


def _autocast(run, autocast: str | None):
    """``run`` inside ``torch.autocast("cpu", dtype=autocast)`` (a dtype's name), or ``run``
    itself. The region is inside the compiled function, as accelerate puts it: its
    ``prepare_model`` wraps the model's forward in ``torch.autocast`` (``autocast_context``)
    and compiles the wrapped model last (accelerate/accelerator.py, 1.15); backward runs
    outside it. CPU autocast has kernels for the layer's linears and SDPA as CUDA's has
    (``AutocastCPU`` and ``AutocastCUDA`` both register linear, mm and
    scaled_dot_product_attention); CUDA's fp32 ops among the layer's (pow, rsqrt: its norm)
    have no CPU autocast kernel, but read the fp32 residual stream, where the fp32 policy
    changes nothing."""
    if autocast is None:
        return run
    import torch

    dtype = getattr(torch, autocast)

    def autocast_run(h):
        with torch.autocast("cpu", dtype=dtype):
            return run(h)

    return autocast_run


def compiled_layer_saved(config: dict, dtype_name: str, batch: int, seq: int,
                         checkpoint: str = "none",
                         autocast: str | None = None) -> list[SavedTensor]:
    """The saved set of one compiled decoder layer of ``config`` (``_layer``) in
    ``dtype_name`` for ``batch`` sequences of ``seq`` tokens (a torchtitan block with ``tp``
    > 1 among its keywords: on rank 0 of that TP mesh, ``_tp_block``); ``checkpoint``:
    "full", inside non-reentrant activation checkpointing, or "op", inside torchtitan's per-op SAC
    (``SelectiveAC._wrap_block``, its save list with CPU's SDPA kernel:
    ``frameworks._sac_saves_cpu_flash``), compiled around it, as torchtitan checkpoints, then
    compiles. ``autocast``: a low-precision dtype's name, the layer's forward run under CPU
    autocast to it (``_autocast``), its weights in ``dtype_name``."""
    tp = config.get("torchtitan", {}).get("tp", 1)
    if tp == 1:
        with _recursion_limit_kept():
            return _saved(config, dtype_name, batch, seq, checkpoint, autocast)
    from memplan.profile.frameworks import _process_group

    with _recursion_limit_kept(), _process_group(tp):
        return _saved(config, dtype_name, batch, seq, checkpoint, autocast)


def _saved(config: dict, dtype_name: str, batch: int, seq: int,
           checkpoint: str, autocast: str | None = None) -> list[SavedTensor]:
    import torch
    from torch.utils.checkpoint import checkpoint as run_checkpointed

    layer, run, x = _layer(config, dtype_name, batch, seq)
    if checkpoint == "op":
        run = _per_op_sac(layer)

    def step(h):
        if checkpoint == "full":
            return run_checkpointed(run, h, use_reentrant=False)
        return run(h)

    rows: list[list[SavedTensor]] = []
    module, original, recording = _record(rows)
    module.min_cut_rematerialization_partition = recording
    # a cached compile (AOTAutograd's and Inductor's on-disk caches) skips the partitioner
    no_cache = (torch._functorch.config.patch(enable_autograd_cache=False),
                torch._inductor.config.patch(fx_graph_cache=False))
    try:
        with no_cache[0], no_cache[1], _transformers_logging_ignored():
            out = torch.compile(_autocast(step, autocast), backend="inductor",
                                fullgraph=True)(x)
            # a tensor-parallel block's output is a DTensor: its rank's shard
            (out.to_local() if hasattr(out, "to_local") else out).sum().backward()
    finally:
        module.min_cut_rematerialization_partition = original
        torch._dynamo.reset()
    assert len(rows) == 1, f"expected one partitioned graph, got {len(rows)}"
    return rows[0]


def _per_op_sac(layer: Any) -> Any:
    """A function running torchtitan's block ``layer`` inside torchtitan's per-op SAC
    (``SelectiveAC._wrap_block``, its save list with CPU's SDPA kernel:
    ``frameworks._sac_saves_cpu_flash``)."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from memplan.profile.frameworks import _sac_saves_cpu_flash

    with _sac_saves_cpu_flash():
        wrapped = SelectiveAC(SelectiveAC.Config())._wrap_block(layer, base_fqn="layers.0")
    return lambda h: wrapped(h, None, None)


def compiled_layer_peaks(config: dict, dtype_name: str, batch: int, seq: int,
                         autocast: str | None = None, checkpoint: str = "none",
                         kernel_per_node: bool = False, gpu_realize: bool = False,
                         ) -> tuple[int, int]:
    """(forward peak, backward peak) of one compiled decoder layer's step (``_layer``), in bytes
    above what exists before it (weights, the input, the RoPE tables, the output's gradient),
    from the CPU allocator's own events (torch.profiler with profile_memory: they include
    the buffers compiled kernels allocate, which a dispatch mode does not see). The layer's
    output stays alive through its backward (the step holds it). Compiled and run once first,
    its gradients dropped. oneDNN is off: its bf16 matmuls on CPU allocate reordered weight
    copies (132,736 B at the toy's q projection) that no GPU kernel makes. ``autocast`` and
    ``checkpoint`` ("none" or "full"): as ``compiled_layer_saved``'s. ``kernel_per_node``:
    one kernel per scheduler node (``_kernel_per_node``), as a GPU backend launches them; off,
    the C++ backend's groups of kernels (what the pinned traces were recorded with).
    ``gpu_realize``: as ``compiled_layer_step``'s."""
    return compiled_layer_step(config, dtype_name, batch, seq, autocast, checkpoint,
                               kernel_per_node, gpu_realize)[1:]


def compiled_layer_step(config: dict, dtype_name: str, batch: int, seq: int,
                        autocast: str | None = None, checkpoint: str = "none",
                        kernel_per_node: bool = True, gpu_realize: bool = False,
                        ) -> tuple[list[SavedTensor], int, int]:
    """``compiled_layer_saved``'s saved set and ``compiled_layer_peaks``' (forward peak,
    backward peak) from one compile (a dense transformers layer: ``_layer``), by default one
    kernel per scheduler node (``_kernel_per_node``). ``gpu_realize``: Inductor's lowering
    decides which reused pointwise values become buffers as it would for a GPU
    (``_gpu_realization``)."""
    import torch

    rows: list[list[SavedTensor]] = []
    per_node = _kernel_per_node() if kernel_per_node else contextlib.nullcontext()
    realize = _gpu_realization() if gpu_realize else contextlib.nullcontext()
    with (torch.backends.mkldnn.flags(enabled=False), _recursion_limit_kept(), per_node,
          realize):
        forward, backward = _peaks(config, dtype_name, batch, seq, autocast, checkpoint, rows)
    assert len(rows) == 1, f"expected one partitioned graph, got {len(rows)}"
    return rows[0], forward, backward


@contextlib.contextmanager
def _gpu_realization() -> Iterator[None]:
    """Inductor's lowering realizes a pointwise value read by several users (a buffer of its
    own rather than its ops inlined into each reader) by device: on CPU any value computed
    with a "heavy" op (``exp``, ``tanh``, ``sigmoid``...), and with other read and op-count
    thresholds (torch/_inductor/ir.py ``StorageBox.should_realize_on_reuse``,
    ``has_exceeded_max_reads``, ``Loops.has_large_inner_fn``: ``is_cpu`` picks
    ``config.realize_cpu_*``; torch 2.13). Here those three decide as for a GPU tensor
    (``is_cpu`` false inside them alone), so the CPU run holds the buffers a GPU run holds;
    the kernels still run on CPU."""
    from torch._inductor import ir

    patched = [(ir.StorageBox, "should_realize_on_reuse"), (ir.StorageBox,
               "has_exceeded_max_reads"), (ir.Loops, "has_large_inner_fn")]
    originals = [getattr(cls, name) for cls, name in patched]

    def as_gpu(original: Any) -> Any:
        def decide(*args: Any, **kwargs: Any) -> Any:
            is_cpu, ir.is_cpu = ir.is_cpu, lambda *_: False
            try:
                return original(*args, **kwargs)
            finally:
                ir.is_cpu = is_cpu
        return decide

    for (cls, name), original in zip(patched, originals, strict=True):
        setattr(cls, name, as_gpu(original))
    try:
        yield
    finally:
        for (cls, name), original in zip(patched, originals, strict=True):
            setattr(cls, name, original)


@contextlib.contextmanager
def _kernel_per_node() -> Iterator[None]:
    """Inductor's C++ backend writes consecutive scheduler nodes into one kernel call
    (``CppScheduling.codegen_node`` adds each to its ``KernelGroup`` until an extern kernel
    flushes it), allocating all their outputs before the call and freeing their inputs after;
    a GPU backend launches one kernel per scheduler node (``SIMDScheduling.codegen_node``),
    each input freed after its last reader. Flushed after every node, the CPU run holds what
    a GPU run holds: under autocast the fp32 casts of the MLP's weight gradients one at a
    time, not three beside their bf16 sources (the dense toy's backward 4,130,816 B, grouped
    5,048,320 B). The dense toy's fp32 and bf16 peaks are the same either way; transformers
    5.3's Qwen3-MoE toy's backward is 721,936 B (memplan exact), grouped 723,984 B."""
    from torch._inductor.codegen import cpp

    original = cpp.CppScheduling.codegen_node

    def one_kernel(self: Any, node: Any) -> None:
        original(self, node)
        self._set_flush_status(True)

    cpp.CppScheduling.codegen_node = one_kernel
    try:
        yield
    finally:
        cpp.CppScheduling.codegen_node = original


def _peaks(config: dict, dtype_name: str, batch: int, seq: int,
           autocast: str | None = None, checkpoint: str = "none",
           rows: list[list[SavedTensor]] | None = None) -> tuple[int, int]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.checkpoint import checkpoint as run_checkpointed

    layer, layer_run, x = _layer(config, dtype_name, batch, seq)
    if checkpoint == "op":
        layer_run = _per_op_sac(layer)

    def checkpointed(h):
        return run_checkpointed(layer_run, h, use_reentrant=False)

    run = torch.compile(_autocast(checkpointed if checkpoint == "full" else layer_run,
                                  autocast), backend="inductor", fullgraph=True)
    no_cache = (torch._functorch.config.patch(enable_autograd_cache=False),
                torch._inductor.config.patch(fx_graph_cache=False))
    grad = torch.ones_like(x, requires_grad=False)

    def step(mark) -> None:
        out = run(x)
        mark()
        out.backward(grad)

    def marked() -> None:
        with record_function("memplan.backward"):
            pass

    module, original, recording = _record([] if rows is None else rows)
    module.min_cut_rematerialization_partition = recording
    try:
        with no_cache[0], no_cache[1], _transformers_logging_ignored():
            step(lambda: None)
    finally:
        module.min_cut_rematerialization_partition = original
    layer.zero_grad(set_to_none=True)
    x.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(marked)
    torch._dynamo.reset()
    events = prof.profiler.kineto_results.events()
    mark = next(e.start_ns() for e in events if e.name() == "memplan.backward")
    alive = forward = backward = 0
    for start, nbytes in _calls_whole(events):
        alive += nbytes
        if start < mark:
            forward = max(forward, alive)
        else:
            backward = max(backward, alive)
    return forward, backward


# the ops ``_calls_whole`` counts as their outputs alone: their CPU kernels' scratch is not
# what a GPU kernel of the op allocates (``_calls_whole``)
WHOLE_CALLS = ("aten::_scaled_mm", "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def _calls_whole(events: Any) -> list[tuple[int, int]]:
    """The profile's memory events as (time, bytes), each call of a ``WHOLE_CALLS`` op one
    event of its net bytes (its outputs) at its end, its scratch dropped:

    - ``aten::_scaled_mm``: on CPU the op is emulated: it copies both float8 operands to fp32
      (a transposed one made contiguous first), multiplies in fp32 and casts the result,
      freeing all of it before it returns (``_scaled_mm_out_cpu_emulated``,
      aten/src/ATen/native/Blas.cpp, torch 2.13; the 2 x 64 toy's w1: 196,608 + 131,072 +
      786,432 + 393,216 + 196,608 B inside the call, its 196,608 B output left); a GPU's
      cuBLASLt kernel allocates the output alone (its workspace, kept per handle, is no
      step's allocation: ``getCUDABlasLtWorkspace``, aten/src/ATen/cuda/CUDABlas.cpp).
    - ``aten::_scaled_dot_product_flash_attention_for_cpu_backward`` (SDPA's CPU flash
      backward): besides dq, dk and dv it allocates per-thread scratch, freed before it
      returns (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp
      ``cpu_flash_attention_backward``, torch 2.13: ``buf``, num_threads x (q split x kv
      split + ...) fp32, ``buf_reduced`` in the input's dtype for a reduced-precision input,
      and a per-row sum; 3,146,752 B on 2 threads at the toy's 2 x 1,024 tokens), so its
      size follows the machine's thread count, not the step. A GPU's flash backward
      (FlashAttention-2 ``mha_bwd``, aten/src/ATen/native/transformers/cuda/flash_attn/
      flash_api.cpp, pytorch/pytorch main) allocates other scratch inside the call:
      ``softmax_d`` (batch x heads x seqlen_q rounded up to 128, fp32, returned and dropped
      by its caller), ``dq_accum`` (batch x seqlen_q rounded x heads x head_size rounded to
      32 or 64, fp32; deterministic: one per split, zeroed) and, given fewer k/v heads than
      q heads, ``dk_expanded`` and ``dv_expanded`` (batch x seqlen_k x heads x head_size,
      the input's dtype) summed into dk and dv after the kernel. memplan models the call
      as its outputs (dq, dk, dv: ``attention._flash_backward``, ``compiled.
      attention_backward_moments``), no kernel's scratch, and the trace counts the same:
      neither depends on the CPU's thread count, and neither holds the GPU kernel's
      scratch (the toy's 2 x 1,024 tokens: softmax_d 65,536 B, dq_accum 2,097,152 B, the
      expanded dk and dv 2 x 1,048,576 B were its 8 q and 2 k/v heads passed as they are),
      a gap of the model
      (the attention backward's moments), not of the trace.

    Nested calls count at the outer call's end."""
    calls = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in events
                   if e.name() in WHOLE_CALLS)
    rows: list[tuple[int, int]] = []
    pending: dict[int, int] = {}
    for event in sorted((e for e in events if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        at = event.start_ns()
        end = max((stop for begin, stop in calls if begin <= at <= stop), default=None)
        if end is None:
            rows.append((at, event.nbytes()))
        else:
            pending[end] = pending.get(end, 0) + event.nbytes()
    return sorted(rows + list(pending.items()))
