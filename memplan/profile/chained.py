"""Two torch optimizers stepped as one (``--optimizer muon``): torch.optim.Muon takes only
2-D parameters, so its docstring's recipe gives the others to torch.optim.AdamW and steps
Muon first; a trace (``memplan.profile.trace``) sees them as one optimizer."""

from __future__ import annotations

import torch


class ChainedOptimizer:
    """``optimizers`` stepped in order; ``state`` and ``param_groups`` are all of theirs."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def state(self) -> dict:
        # a merged copy: a ChainMap would read a missing key through torch's defaultdict
        # states and create empty ones
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def muon_and_adamw(params: list[torch.Tensor], flags: dict[str, bool]) -> ChainedOptimizer:
    """torch.optim.Muon over the 2-D ``params``, torch.optim.AdamW (with ``flags``: foreach,
    fused) over the others, as the Muon docstring builds them."""
    matrices = [p for p in params if p.ndim == 2]
    others = [p for p in params if p.ndim != 2]
    return ChainedOptimizer(torch.optim.Muon(matrices, lr=0.02, momentum=0.95),
                            torch.optim.AdamW(others, lr=3e-4, weight_decay=0.01, **flags))
