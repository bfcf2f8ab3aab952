"""The trainable-parameter policy: which parameter groups of a stage hold gradients and
optimizer states (``memplan.model.model_states`` reads it).

Every parameter trains today (``ALL``). Freezing a group (``requires_grad_(False)``: no
gradient is made for it, and the optimizer is built over the others, so it keeps no states
for it) is a selection here; the weights themselves are held either way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Protocol


class StageParams(Protocol):
    """What the policy reads of a stage's parameter counts
    (``memplan.model.model_states.StageParams`` has these fields)."""

    dense: int
    expert: int
    embedding: int
    head: int
    tensor_sizes: tuple[int, ...]
    embedding_tensors: int
    head_tensors: int


class ParamGroup(str, enum.Enum):
    """The parameter groups of a pipeline stage, in registration order."""

    EMBEDDING = "embedding"  # token (and position) embedding, first stage
    LAYERS = "layers"  # the decoder layers (dense and expert parameters)
    HEAD = "head"  # final norm and output projection, last stage


class Trained(NamedTuple):
    """Parameters of one rank that hold gradients and optimizer states, before ZeRO."""

    dense: int
    expert: int
    tensor_sizes: tuple[int, ...]  # elements of each trained tensor, in registration order


@dataclass(frozen=True)
class TrainablePolicy:
    """The frozen parameter groups (none: every parameter trains)."""

    frozen: frozenset[ParamGroup] = frozenset()

    def trained(self, params: StageParams) -> Trained:
        """What of ``params`` trains: its dense and expert counts and its tensors, without
        the frozen groups'."""
        if not self.frozen:
            return Trained(params.dense, params.expert, params.tensor_sizes)
        sizes = params.tensor_sizes
        emb_n, head_n = params.embedding_tensors, params.head_tensors
        parts = {ParamGroup.EMBEDDING: (sizes[:emb_n], params.embedding, 0),
                 ParamGroup.LAYERS: (sizes[emb_n:len(sizes) - head_n],
                                     params.dense - params.embedding - params.head,
                                     params.expert),
                 ParamGroup.HEAD: (sizes[len(sizes) - head_n:], params.head, 0)}
        kept = [parts[g] for g in ParamGroup if g not in self.frozen]
        return Trained(sum(p[1] for p in kept), sum(p[2] for p in kept),
                       tuple(n for p in kept for n in p[0]))


ALL = TrainablePolicy()
