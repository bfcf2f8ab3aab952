"""The optimizer policy: the states an optimizer keeps per parameter and the temporaries each
implementation of its step makes, as data the states read (``memplan.model.model_states``).

An optimizer is one row of ``POLICIES``: its states per parameter element, per
``OptimizerImpl`` its step's temporaries, and the torch.optim class a trace runs. A new
optimizer is a member of ``memplan.workload.Optimizer`` and a row here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memplan.units import FP32_BYTES
from memplan.workload import Optimizer, OptimizerImpl, PrecisionPolicy


@dataclass(frozen=True)
class StepTemps:
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


@dataclass(frozen=True)
class OptimizerPolicy:
    """States per parameter element (each in the dtype of what it updates) and the step's
    temporaries per implementation (``StepTemps``; an implementation not listed makes
    none)."""

    name: str
    num_states: int
    temps: tuple[tuple[OptimizerImpl, StepTemps], ...] = ()
    torch_class: str = ""  # the torch.optim class a trace runs (``memplan.profile.trace``)
    torch_kwargs: tuple[tuple[str, object], ...] = ()  # ... its arguments beyond lr
    fused_on_cpu: bool = False  # ... whether it has a fused CPU implementation

    def state_bytes_per_param(self, precision: PrecisionPolicy) -> int:
        """Bytes of the states of one parameter element on the device."""
        return self.num_states * precision.updated.itemsize

    def host_state_bytes_per_param(self) -> int:
        """... in host memory, where an offloaded optimizer keeps them in fp32 (DeepSpeed's
        CPU-Adam)."""
        return self.num_states * FP32_BYTES

    def step(self, impl: OptimizerImpl) -> StepTemps:
        return next((temps for key, temps in self.temps if key is impl), NO_TEMPS)

    def step_counter_bytes(self, impl: OptimizerImpl, num_tensors: int) -> int:
        """The step counts kept on the device: one fp32 scalar per parameter tensor."""
        return num_tensors * FP32_BYTES if self.step(impl).device_step_counters else 0


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
}


def optimizer_policy(optimizer: Optimizer) -> OptimizerPolicy:
    return POLICIES[optimizer]
