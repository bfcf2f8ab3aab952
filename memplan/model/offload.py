"""Offloading to host memory: what each mechanism moves off the GPU, what the GPU still holds
and what the host holds, for one rank (``memplan.parallel.Offload``).

Three mechanisms, each read from its code (torch 2.13, torchao 0.x):

- the optimizer without ZeRO, torchao's ``CPUOffloadOptimizer`` (torchao/optim/cpu_offload.py):
  at construction a pinned host copy of every trained parameter of at least ``minimal_size``
  elements (``empty_like(p, device="cpu", pin_memory=True)``) with a host gradient of the same
  dtype (smaller ones stay with an on-device optimizer); a
  ``post_accumulate_grad`` hook copies each device gradient into it; ``step`` runs one
  ``optimizer_class`` per parameter on the host copies (states ``zeros_like`` the host
  parameter: its dtype) and copies each updated parameter back into the device one in place
  (no device temporary). With ``offload_gradients=False`` (its default) the device gradients
  stay until ``zero_grad``. The GPU keeps weights and gradients, and the states of the
  small tensors (a fused on-device AdamW: no step temporaries).
- the parameters, FSDP2's ``CPUOffloadPolicy`` (torch/distributed/fsdp/_fully_shard/
  _fsdp_param.py ``FSDPParam._init_sharded_param``: the padded shard moved to the CPU and
  pinned; _fsdp_collectives.py ``foreach_reduce``: each reduce-scatter output shard copied to
  the CPU, the device one dropped): sharded weights, their sharded gradients and the
  optimizer's states live on the host and the step runs there. It moves parameters only:
  with LoRA the frozen base and the adapters in their own dtypes, while a quantized weight's
  ``quant_state`` (no parameter) stays on the device. The GPU holds what FSDP2
  gathers (the units' unsharded weights, forward and backward) and a unit's unsharded
  gradients before their reduce-scatter: ``memplan.model.model_states.sharding_buffers``,
  unchanged.
- activations, ``torch.autograd.graph.save_on_cpu`` around the decoder layers
  (torch/autograd/graph.py: ``pack_to_cpu`` copies every saved tensor, parameters and views
  included, to the host; ``unpack_from_cpu`` makes a device copy for the node that reads it):
  ``saved_on_host``, ``unpacked_bytes``, ``kept_cache_bytes``, ``host_activation_bytes``.
  torchtune's ``OffloadActivations`` is not this: it keeps parameters and tensors under 1 KiB
  on the device, and with streams (its default) the last five packed tensors in forward and
  the previous node's unpacked ones in backward; it is not modelled.
"""

from __future__ import annotations

from typing import NamedTuple

from memplan.model.block import BackwardMoment, Block
from memplan.model.dims import Dims
from memplan.model.layer import LayerKind, LayerMoment, kv_cache_bytes
from memplan.model.optimizer import OptimizerPolicy
from memplan.parallel import Offload, ParallelConfig, host_optimizer
from memplan.spec import ModelSpec
from memplan.units import FP32_BYTES
from memplan.workload import PrecisionPolicy, Recompute, Workload


class Moved(NamedTuple):
    """What one offload mechanism leaves on the GPU and puts on the host, in bytes for one
    rank: the weights and gradients the GPU keeps, and the host's bytes."""

    params_bytes: int
    grads_bytes: int
    host_bytes: int


# torchao CPUOffloadOptimizer(minimal_size=4096): a parameter of fewer elements stays on the
# device, stepped there by one on-device ``optimizer_class`` (torchao/optim/cpu_offload.py)
TORCHAO_MINIMAL_SIZE = 4096


def host_optimizer_states(tensor_sizes: tuple[int, ...], policy: PrecisionPolicy,
                          optimizer: OptimizerPolicy) -> tuple[int, int]:
    """(device bytes, host bytes) of torchao's ``CPUOffloadOptimizer`` over the trained
    tensors of ``tensor_sizes`` elements each. A tensor of at least ``TORCHAO_MINIMAL_SIZE``
    elements gets a pinned host copy and a host gradient in the weights' dtype, its states in
    the same dtype (``zeros_like`` the host copy) and, with AdamW, a step count (an fp32
    scalar); a smaller one stays with the on-device optimizer: its states on the GPU, and
    AdamW there is fused (torchao sets ``fused=True``), which keeps its step count on the
    device too. Neither makes step temporaries on the GPU (fused; the host step)."""
    e = policy.params.itemsize
    large = [n for n in tensor_sizes if n >= TORCHAO_MINIMAL_SIZE]
    small = [n for n in tensor_sizes if n < TORCHAO_MINIMAL_SIZE]
    step = FP32_BYTES if optimizer.name == "adamw" else 0
    host = sum(large) * (2 * e + optimizer.num_states * e) + len(large) * step
    device = sum(small) * optimizer.state_bytes_per_param(policy) + len(small) * step
    return device, host


def cpu_offload_policy(shard_params_bytes: int, shard_trained: int, num_tensors: int,
                       policy: PrecisionPolicy, optimizer: OptimizerPolicy) -> Moved:
    """FSDP2's ``CPUOffloadPolicy``: the ``shard_params_bytes`` of sharded weights (in their
    own dtypes: with LoRA a frozen base, quantized or not, and fp32 adapters) and
    ``shard_trained`` elements of gradients and states move to the host (gradients in the
    reduce dtype FSDP2 leaves them in, states in the trained weights' dtype, ``policy``, and
    the host optimizer's AdamW step counts, an fp32 scalar per trained tensor); the GPU keeps
    none of them."""
    steps = num_tensors * FP32_BYTES if optimizer.name == "adamw" else 0
    host = (shard_params_bytes
            + shard_trained * (policy.grad_bytes + optimizer.state_bytes_per_param(policy))
            + steps)
    return Moved(params_bytes=0, grads_bytes=0, host_bytes=host)


def saved_on_host(kind: LayerKind, checkpointed: LayerKind, moments: list[LayerMoment],
                  stream: int, cache: int) -> LayerKind:
    """A decoder layer whose saved tensors are packed to host memory as its forward saves them
    and unpacked to the GPU for its backward (``torch.autograd.graph.save_on_cpu`` around the
    layers: every tensor autograd saves, parameters included, goes through its
    ``pack_to_cpu``; ``unpack_from_cpu`` makes a device copy when a node's backward reads it).

    Nothing of the layer stays on the GPU from its forward to its backward (``saved_bytes``
    0; autocast's cached casts are the autocast cache's, still held until the forward ends).
    Its forward holds what a checkpointed layer's forward holds (``checkpointed``: the same
    layer under full recompute; ``Block.working_set``): a tensor it saves is freed on the GPU
    once the forward's own references drop it, as where nothing is saved, and the layer's
    input stays referenced by its caller until the layer returns, as a checkpoint keeps it;
    beside it, what the layer caches for later (``kind``'s cached bytes beyond the checkpointed
    layer's, and ``cache``: a KV cache's K and V, which without offloading are the very tensors
    attention saves; they stay on the GPU, referenced by the cache, until the forward's output
    is dropped), and ``stream``: the stage's first input, which the model's forward keeps
    referenced through all its layers (transformers' ``LlamaModel.forward`` holds
    ``inputs_embeds``). In its backward, ``moments``
    (``memplan.model.layer.backward_moments`` with ``host_saved``)."""
    own_cache = max(0, kind.cached_bytes - checkpointed.cached_bytes) + cache
    return kind._replace(saved_bytes=0, moments=tuple(moments),
                         cached_bytes=kind.cached_bytes + cache,
                         forward_peak_bytes=checkpointed.forward_peak_bytes + own_cache + stream,
                         forward_blocks=())


def offload_assumptions(par: ParallelConfig) -> tuple[str, ...]:
    """The estimate's lines for what ``par`` offloads beyond ZeRO-Offload (which has its own)."""
    lines = []
    if Offload.PARAMS in par.offload:
        lines.append("parameters offloaded (FSDP2 CPUOffloadPolicy): sharded weights, their "
                     "gradients, the optimizer states and step in host memory; the GPU holds the "
                     "gathered units and the reduce-scatter buffers")
    elif host_optimizer(par):
        lines.append("optimizer offloaded (torchao CPUOffloadOptimizer): host copies of the "
                     "trained weights and their gradients, the states and the step in host "
                     "memory; the GPU keeps weights and gradients")
    if Offload.ACTIVATIONS in par.offload:
        lines.append("activations offloaded (torch.autograd.graph.save_on_cpu around each "
                     "decoder layer): what a layer saves is packed to host memory in forward and "
                     "copied back for its backward; the head and loss keep theirs on the GPU")
    return tuple(lines)


def kept_cache_bytes(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute,
                     variant: str) -> int:
    """A layer's K and V that a KV cache keeps on the GPU while autograd's copies of them are on
    the host (``saved_on_host``): where the cache holds the tensors attention saves
    (``memplan.model.layer.kv_cache_bytes`` counts no copy of its own)."""
    if not (wl.kv_cache and recompute is Recompute.NONE):
        return 0
    if kv_cache_bytes(spec, wl, dm, recompute, variant):
        return 0
    return 2 * dm.tokens * spec.kv_size // dm.tp * dm.e


def unpacked_bytes(spec: ModelSpec, dm: Dims, block: Block, moment: BackwardMoment) -> int:
    """What the node running at ``block``'s backward ``moment`` has copied back to the GPU
    when the layer's saved tensors are on the host (``saved_on_host``): a node unpacks the
    tensors it saved, alive while it runs. A linear's backward reads its input and its weight
    (``save_on_cpu`` packs parameters too: the copy is a second weight on the GPU, the
    block's largest): the MLP's output projection reads the product (gated) or the
    activation; the input projections read the block's input (the up projection's too: the
    gate's output it runs beside, saved for the activation, is still packed). The gated
    product's backward reads its two factors. Other moments (norms, the attention core) read
    what the block still holds at them (``moment.own_bytes``)."""
    weight = max(block.tensor_sizes(spec, dm.tp, 1), default=0) * dm.e
    inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
    if moment.name == "mlp":
        return inner + weight
    if moment.name == "mlp_act":
        # the product's two factors, beside its incoming gradient (which the moment's own
        # bytes count where the product was saved)
        return (3 if spec.mlp.gated else 2) * inner
    if moment.name in ("mlp_in", "mlp_up", "attn_in"):
        return dm.linear_rows * spec.hidden_size * dm.e + weight
    return moment.own_bytes


def host_activation_bytes(kinds: list[tuple[int, bool, int]], layer_weights_bytes: int,
                          rope_bytes: int, in_flight: int) -> int:
    """Host memory of the decoder layers' saved tensors (``saved_on_host``) on one rank, per
    micro-batch in flight: for each kind of layer (its saved bytes, whether it is fully
    recomputed, how many), what it saves (each tensor once) and, unless recomputed, the
    weights its matmuls save (``layer_weights_bytes`` per layer: ``save_on_cpu`` packs
    parameters too), and the rope tables where no layer is recomputed (a checkpoint keeps
    them, its inputs, on the device; its rerun saves there too). A lower bound: a tensor that
    several nodes save (a linear input shared by q, k and v, a norm's input read twice) is
    packed once per node."""
    saved = sum(n * (size + (0 if full else layer_weights_bytes)) for size, full, n in kinds)
    rope = 0 if any(full for _, full, _ in kinds) else rope_bytes
    return in_flight * (saved + rope)
