"""The optimizer policy: the states an optimizer keeps per parameter and the temporaries each
implementation of its step makes, as data the states read (``memplan.model.model_states``).

An optimizer is one row of ``POLICIES``: its states per parameter element, per
``OptimizerImpl`` its step's temporaries, and the class a trace runs; or, where the states or
the step depend on each tensor's shape, a ``PerTensor`` (bitsandbytes' 8-bit ``Blockwise``,
Adafactor's ``Factored``, ``MuonSplit``). A new optimizer is a member of
``memplan.workload.Optimizer`` and a row here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from memplan.units import FP32_BYTES, ceil_div
from memplan.workload import Optimizer, OptimizerImpl, PrecisionPolicy


class StepTemps(NamedTuple):
    """What one implementation of the step makes beyond the states, in elements of what the
    optimizer updates (``PrecisionPolicy.updated``): ``all_params`` copies of every parameter
    it updates at once (a foreach intermediate list), or per tensor, while it steps one,
    ``current`` copies of it beside ``previous`` copies of the tensor before it (a for-loop);
    ``device_step_counters``: a step count per parameter tensor held on the device, an fp32
    scalar each."""

    all_params: int = 0
    previous: int = 0
    current: int = 0
    device_step_counters: bool = False

    @property
    def per_tensor(self) -> bool:
        """Whether the temporaries depend on the tensors' sizes (``elements`` reads them)."""
        return bool(self.previous or self.current)

    def elements(self, num_params: int, tensor_sizes: Sequence[int]) -> int:
        """Elements of the largest set of temporaries alive at once: ``num_params`` updated
        in all, ``tensor_sizes`` of each updated tensor in the order the step visits them."""
        loop = 0
        if self.per_tensor:
            loop = max((self.previous * prev + self.current * cur
                        for prev, cur in zip((0, *tensor_sizes), tensor_sizes)), default=0)
        return self.all_params * num_params + loop


NO_TEMPS = StepTemps()

Shapes = Sequence[tuple[int, ...]]  # the shape of each updated tensor, in step order


class States(NamedTuple):
    """An optimizer's states on one rank, in bytes: held by the device's allocator, and in
    unified memory (paged: on the device while it has room, paged out to the host under
    pressure)."""

    device_bytes: int
    paged_bytes: int = 0
    setup_bytes: int = 0  # of device_bytes, what exists from the optimizer's construction on


class PerTensor(Protocol):
    """An optimizer whose states and temporaries depend on each tensor's shape, not only on
    the number of elements: ``states`` in ``itemsize``-byte elements where it follows the
    updated dtype, ``temp_bytes`` the step's largest set alive at once, ``device_counters``
    the tensors whose step count is a device scalar."""

    def states(self, shapes: Shapes, itemsize: int) -> States: ...

    def temp_bytes(self, shapes: Shapes, itemsize: int, impl: OptimizerImpl) -> int: ...

    def device_counters(self, shapes: Shapes, impl: OptimizerImpl) -> int: ...


class Blockwise(NamedTuple):
    """bitsandbytes' 8-bit states (``Optimizer2State.init_state`` in
    ``bitsandbytes/optim/optimizer.py``, bitsandbytes 0.50.2), per parameter tensor of ``n``
    elements: below ``min_8bit_size`` elements two fp32 states (``get_state_buffer(p,
    dtype=torch.float32)``, whatever the parameter's dtype); from it on two uint8 states and
    per state one fp32 absmax per block of ``block_size`` elements (``blocks = n // 256 +
    bool(n % 256)``). The two quantization maps (``create_dynamic_map``, signed and unsigned,
    256 fp32 values each) exist once per optimizer (``name2qmap``), made in its constructor
    (``fill_qmap``), before step 1; every 8-bit tensor's state refers to them. Paged
    (``is_paged``): ``get_state_buffer`` puts the uint8 states
    of a tensor of at least ``paged_min_numel`` elements in unified memory (``F.get_paged``:
    ``cudaMallocManaged``, outside torch's allocator); absmax and the smaller tensors' states
    stay device tensors."""

    num_states: int = 2
    block_size: int = 256  # init_state: blocksize = 256
    min_8bit_size: int = 4096  # AdamW8bit(min_8bit_size=4096)
    qmap_entries: int = 256  # create_dynamic_map(): 2**8 values, fp32
    paged_min_numel: int | None = None  # get_state_buffer: paged when p.numel() >= 1e5

    def paged(self, n: int) -> bool:
        return (self.paged_min_numel is not None and n >= self.min_8bit_size
                and n >= self.paged_min_numel)

    def tensor_states(self, n: int) -> States:
        """The states of one tensor of ``n`` elements."""
        if n < self.min_8bit_size:
            return States(self.num_states * n * FP32_BYTES)
        absmax = self.num_states * ceil_div(n, self.block_size) * FP32_BYTES
        codes = self.num_states * n  # uint8
        return States(absmax, codes) if self.paged(n) else States(absmax + codes)

    def states(self, shapes: Shapes, itemsize: int = 0) -> States:
        """The states of tensors of ``shapes``, with the quantization maps when any of them
        is 8-bit (``itemsize``, the updated dtype's, does not matter)."""
        sizes = [math.prod(shape) for shape in shapes]
        parts = [self.tensor_states(n) for n in sizes]
        maps = (self.num_states * self.qmap_entries * FP32_BYTES
                if any(n >= self.min_8bit_size for n in sizes) else 0)
        return States(sum(p.device_bytes for p in parts) + maps,
                      sum(p.paged_bytes for p in parts), maps)

    def temp_bytes(self, shapes: Shapes, itemsize: int, impl: OptimizerImpl) -> int:
        """The paged states the device holds at least during the step: each tensor's are
        prefetched before its update (``prefetch_state``: ``F.prefetch_tensor``), so the
        largest paged tensor's, ``num_states`` bytes per element (0 unpaged)."""
        return max((self.num_states * n for n in map(math.prod, shapes) if self.paged(n)),
                   default=0)

    def device_counters(self, shapes: Shapes, impl: OptimizerImpl) -> int:
        return 0  # the step count is a Python int


class Paged32(NamedTuple):
    """bitsandbytes' 32-bit paged states (``PagedAdamW`` / ``PagedAdamW32bit``, ``optim_bits=32``,
    ``is_paged=True``; ``Optimizer2State.init_state`` in ``bitsandbytes/optim/optimizer.py``,
    bitsandbytes 0.50.2): per parameter tensor of ``n`` elements two fp32 states
    (``get_state_buffer(p, dtype=torch.float32)``, whatever the parameter's dtype;
    ``min_8bit_size`` only picks 8-bit states, so it changes nothing here), in unified memory
    (``F.get_paged``: ``cudaMallocManaged``) when ``n >= paged_min_numel``, device tensors
    below it (``get_state_buffer``: ``p.numel() < 1e5``). No quantization maps (``fill_qmap``
    runs for uint8 states only); the step count is a Python int; the CUDA update
    (``_optimizer_update_32bit_impl``) writes the parameter and both states in place."""

    num_states: int = 2
    paged_min_numel: int = 100_000  # get_state_buffer: paged unless p.numel() < 1e5

    def states(self, shapes: Shapes, itemsize: int = 0) -> States:
        """The states of tensors of ``shapes`` (fp32 whatever ``itemsize``)."""
        sizes = [math.prod(shape) * self.num_states * FP32_BYTES for shape in shapes]
        paged = [b for b, shape in zip(sizes, shapes) if self.paged(math.prod(shape))]
        return States(sum(sizes) - sum(paged), sum(paged))

    def paged(self, n: int) -> bool:
        return n >= self.paged_min_numel

    def temp_bytes(self, shapes: Shapes, itemsize: int, impl: OptimizerImpl) -> int:
        """The largest paged tensor's states, prefetched to the device before its update
        (``prefetch_state``: both states), as ``Blockwise.temp_bytes``; 0 unpaged."""
        return max((self.num_states * n * FP32_BYTES for n in map(math.prod, shapes)
                    if self.paged(n)), default=0)

    def device_counters(self, shapes: Shapes, impl: OptimizerImpl) -> int:
        return 0  # the step count is a Python int


class Factored(NamedTuple):
    """torch.optim.Adafactor (``torch/optim/_adafactor.py``, torch 2.13): ``_init_group``
    gives a tensor of more than one dimension a row factor (its shape with the last dim 1)
    and a column factor (the next-to-last dim 1), ``p.grad.new_zeros``, so in the gradient's
    dtype; a vector one full ``variance``; the step count is a host scalar. The foreach step
    (``_multi_tensor_adafactor``, the CUDA default) makes ``var_estimates``, one tensor the
    size of each parameter of a group (matrices, then vectors, or the reverse), and the list
    of the first group is still referenced (``updates``) while the second group's are made:
    the size of all parameters at once. The for-loop (``_single_tensor_adafactor``) makes a
    matrix's ``var_estimate`` (a vector's ``grad * grad`` and ``variance.clone()``) while the
    previous tensor's update is still referenced. It has no fused implementation: a preset's
    ``fused`` reads as foreach, what a framework's Adafactor runs on CUDA."""

    def states(self, shapes: Shapes, itemsize: int) -> States:
        return States(sum(_factored(shape) for shape in shapes) * itemsize)

    def temp_bytes(self, shapes: Shapes, itemsize: int, impl: OptimizerImpl) -> int:
        sizes = [math.prod(shape) for shape in shapes]
        if impl is OptimizerImpl.FORLOOP:
            return max((prev + (2 if len(shape) == 1 else 1) * n for prev, n, shape
                        in zip((0, *sizes), sizes, shapes)), default=0) * itemsize
        return sum(sizes) * itemsize

    def device_counters(self, shapes: Shapes, impl: OptimizerImpl) -> int:
        return 0


def _factored(shape: tuple[int, ...]) -> int:
    """Adafactor's state elements for one tensor: row + column factors, or the vector."""
    if len(shape) < 2:
        return math.prod(shape)
    *lead, rows, cols = shape
    return math.prod(lead) * (rows + cols)


# torch.optim.Muon's Newton-Schulz iteration (``_zeropower_via_newtonschulz``) runs in bf16
_NS_DTYPE_BYTES = 2


class MuonSplit(NamedTuple):
    """torch.optim.Muon (``torch/optim/_muon.py``, torch 2.13) on the 2-D parameters and
    torch.optim.AdamW (``other``'s rows) on the rest: Muon refuses any other (``__init__``:
    "Muon only supports 2D parameters"), and its docstring's recipe builds the two optimizers
    so, stepping Muon first. Muon keeps one ``momentum_buffer`` per parameter
    (``zeros_like(p.grad)``) and no step count. Its step (``_single_tensor_muon``, the only
    implementation) per (m, n) tensor, k = min(m, n), K = max(m, n): ``grad.lerp(buf)``
    (nesterov, the default: m*n in the gradient's dtype), then ``_zeropower_via_newtonschulz``
    in bf16: the copy X (k x K), and per iteration ``X @ X.T`` and ``addmm`` of it (k x k
    each) and the next X, made while the previous X and the previous Gram matrices are still
    referenced: at most 2 k^2 + 2 k K bf16 elements beside the lerp. Without a copy (bf16
    gradients) the first X is the lerp itself, still referenced, which the same bound
    covers."""

    other: OptimizerPolicy

    def _split(self, shapes: Shapes) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        return ([s for s in shapes if len(s) == 2], [s for s in shapes if len(s) != 2])

    def states(self, shapes: Shapes, itemsize: int) -> States:
        mats, others = self._split(shapes)
        return States((sum(map(math.prod, mats))
                       + self.other.num_states * sum(map(math.prod, others))) * itemsize)

    def temp_bytes(self, shapes: Shapes, itemsize: int, impl: OptimizerImpl) -> int:
        mats, others = self._split(shapes)
        muon = max((m * n * itemsize + _NS_DTYPE_BYTES * 2 * min(m, n) * (min(m, n) + max(m, n))
                    for m, n in mats), default=0)
        rest = self.other.temp_bytes(impl, sum(map(math.prod, others)), others, itemsize)
        return max(muon, rest)  # Muon steps first; its temporaries are gone by AdamW's step

    def device_counters(self, shapes: Shapes, impl: OptimizerImpl) -> int:
        others = self._split(shapes)[1]
        return len(others) if self.other.step(impl).device_step_counters else 0


class OptimizerPolicy(NamedTuple):
    """States per parameter element (each in the dtype of what it updates) and the step's
    temporaries per implementation (``StepTemps``; an implementation not listed makes
    none)."""

    name: str
    num_states: int
    temps: tuple[tuple[OptimizerImpl, StepTemps], ...] = ()
    torch_class: str = ""  # the class a trace runs (``memplan.profile.trace``): a torch.optim
    #                        name, or a dotted path (bitsandbytes.optim.AdamW8bit)
    torch_kwargs: tuple[tuple[str, object], ...] = ()  # ... its arguments beyond lr
    fused_on_cpu: bool = False  # ... whether it has a fused CPU implementation
    per_tensor: PerTensor | None = None  # states and temporaries by each tensor's shape
    note: str = ""  # what the estimate assumes of it, printed with the assumptions

    def states(self, precision: PrecisionPolicy, num_params: int, shapes: Shapes) -> States:
        """The states of ``num_params`` updated elements in tensors of ``shapes`` (read only
        by a per-tensor optimizer)."""
        if self.per_tensor is not None:
            return self.per_tensor.states(shapes, precision.updated.itemsize)
        return States(num_params * self.state_bytes_per_param(precision))

    def temp_bytes(self, impl: OptimizerImpl, num_params: int, shapes: Shapes,
                   itemsize: int) -> int:
        """The step's temporaries over ``num_params`` updated elements in tensors of
        ``shapes``, in ``itemsize``-byte elements (the updated dtype's)."""
        if self.per_tensor is not None:
            return self.per_tensor.temp_bytes(shapes, itemsize, impl)
        sizes = [math.prod(shape) for shape in shapes]
        return self.step(impl).elements(num_params, sizes) * itemsize

    @property
    def shaped(self) -> bool:
        """Whether ``states`` and ``temp_bytes`` read the tensors' shapes."""
        return self.per_tensor is not None

    def state_bytes_per_param(self, precision: PrecisionPolicy) -> int:
        """Bytes of the states of one parameter element on the device."""
        return self.num_states * precision.updated.itemsize

    def host_state_bytes_per_param(self) -> int:
        """... in host memory, where an offloaded optimizer keeps them in fp32 (DeepSpeed's
        CPU-Adam)."""
        return self.num_states * FP32_BYTES

    def step(self, impl: OptimizerImpl) -> StepTemps:
        return next((temps for key, temps in self.temps if key is impl), NO_TEMPS)

    def step_counter_bytes(self, impl: OptimizerImpl, num_tensors: int,
                           shapes: Shapes = ()) -> int:
        """The step counts kept on the device: one fp32 scalar per parameter tensor (of
        ``num_tensors``; a per-tensor optimizer says which of ``shapes``)."""
        if self.per_tensor is not None:
            return self.per_tensor.device_counters(shapes, impl) * FP32_BYTES
        return num_tensors * FP32_BYTES if self.step(impl).device_step_counters else 0


_BNB_NOTE = ("optimizer states as bitsandbytes 0.50.2 creates them: per tensor of 4096 "
             "elements or more two uint8 states and one fp32 absmax per 256 elements each, "
             "smaller tensors two fp32 states; the CUDA update kernel makes no temporaries")

POLICIES = {
    # torch.optim.AdamW (torch/optim/adamw.py): exp_avg and exp_avg_sq, each zeros_like(param).
    # foreach (the CUDA default, _multi_tensor_adamw) makes one intermediate list the size of
    # all parameters; the for-loop (_single_tensor_adamw) a parameter's two intermediates
    # (sqrt and div make its denominator) while the previous parameter's is still referenced;
    # fused (_fused_adamw) none, but keeps each tensor's step count on the device (an fp32
    # scalar; foreach and the for-loop keep it on the host, capturable=False).
    Optimizer.ADAMW: OptimizerPolicy("adamw", 2, (
        (OptimizerImpl.FOREACH, StepTemps(all_params=1)),
        (OptimizerImpl.FORLOOP, StepTemps(previous=1, current=2)),
        (OptimizerImpl.FUSED, StepTemps(device_step_counters=True))),
        torch_class="AdamW", fused_on_cpu=True),
    # torch.optim.SGD with momentum (torch/optim/sgd.py): one momentum buffer, updated in
    # place by every implementation, no step count
    Optimizer.SGD: OptimizerPolicy("sgd", 1, torch_class="SGD",
                                   torch_kwargs=(("momentum", 0.9),)),
    # torch.optim.Adafactor: ``Factored``; no fused implementation
    Optimizer.ADAFACTOR: OptimizerPolicy("adafactor", 1, torch_class="Adafactor",
                                         per_tensor=Factored()),
}
POLICIES |= {
    # torch.optim.Muon beside AdamW: ``MuonSplit``; torch_class names the pair a trace builds
    Optimizer.MUON: OptimizerPolicy("muon", 1, torch_class="Muon+AdamW", fused_on_cpu=True,
                                    per_tensor=MuonSplit(POLICIES[Optimizer.ADAMW]),
                                    note=("optimizer: torch.optim.Muon on the 2-D parameters "
                                          "(embedding and head included), torch.optim.AdamW "
                                          "on the others, as torch's Muon docstring builds "
                                          "them")),
    # bitsandbytes.optim.AdamW8bit / PagedAdamW8bit (bitsandbytes/optim/adamw.py): states per
    # ``Blockwise``. No step temporaries on CUDA: ``Optimizer8bit.step`` updates one tensor at
    # a time through ``optimizer_update_8bit_blockwise`` (or ``optimizer_update_32bit`` below
    # min_8bit_size), whose CUDA implementations (``_optimizer_update_8bit_blockwise_impl`` and
    # ``_optimizer_update_32bit_impl`` in bitsandbytes/backends/cuda/ops.py) pass pointers to
    # one kernel that writes the parameter and its states in place; its step count is a Python
    # int. The torch.optim implementations (foreach, fused, for-loop) do not apply.
    Optimizer.ADAMW8BIT: OptimizerPolicy(
        "adamw8bit", 2, torch_class="bitsandbytes.optim.AdamW8bit", per_tensor=Blockwise(),
        note=_BNB_NOTE),
    Optimizer.PAGED_ADAMW8BIT: OptimizerPolicy(
        "paged-adamw8bit", 2, torch_class="bitsandbytes.optim.PagedAdamW8bit",
        per_tensor=Blockwise(paged_min_numel=100_000),  # get_state_buffer: numel() < 1e5
        note=_BNB_NOTE + "; paged: the uint8 states of tensors of 100,000 elements or more "
        "live in unified memory (cudaMallocManaged), outside the peak except the pages of "
        "the tensor being updated, which the step prefetches to the GPU"),
    # bitsandbytes.optim.PagedAdamW (= PagedAdamW32bit, bitsandbytes/optim/adamw.py): ``Paged32``
    Optimizer.PAGED_ADAMW: OptimizerPolicy(
        "paged-adamw", 2, torch_class="bitsandbytes.optim.PagedAdamW", per_tensor=Paged32(),
        note="optimizer states as bitsandbytes 0.50.2's PagedAdamW creates them: two fp32 "
        "states per parameter, those of tensors of 100,000 elements or more in unified memory "
        "(cudaMallocManaged), outside the peak except the pages of the tensor being updated, "
        "which the step prefetches to the GPU; the CUDA update kernel makes no temporaries"),
}


def optimizer_policy(optimizer: Optimizer) -> OptimizerPolicy:
    return POLICIES[optimizer]
