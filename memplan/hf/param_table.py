"""A model's parameter tensors as transformers builds them: each tensor's shape, the part of
the model it belongs to and how tensor parallelism is assumed to split it.

A model type memplan has no reader for (``memplan.hf.fallback``) is estimated with
approximate blocks; its weights, gradients and optimizer states follow this table instead,
so they are exact per layer, per pipeline stage and, under the rules below, per TP shard.
torch-free: the tensors' names and shapes come from a meta-device build
(``memplan.profile.hf_meta``), done once when the config is read.

Attribution by module path: ``...layers.N.`` is decoder layer N; the token embedding is the
(V, h) tensor outside the layers registered before them and ``lm_head.weight`` the output
projection (tied: absent, as ``named_parameters`` lists a shared tensor once); any other
tensor outside the layers belongs to the last stage beside the final norm when registered
after the layers, to the first layer (the first stage) when registered before them.

Tensor parallelism (a framework's split is not known for a model type memplan cannot read,
so these rules are assumed, Megatron-LM's for the projections they name, and stated in the
estimate's assumptions):

- ``column``: a matrix (2 or more dimensions) split on its first dimension (its output
  features; a convolution's channels), and the bias of such a projection;
- ``row``: a matrix whose module is an output projection by its name (``ROW_PARALLEL``: o_proj,
  down_proj, out_proj, w2, ...), split on its last dimension; its bias is held whole;
- ``whole``: every 1-D tensor that is no column projection's bias (norms, per-head values such
  as Mamba's A_log, D and dt_bias, an activation's learned scalars), and a mixture of
  experts' router (``ROUTERS``): held whole by every TP rank, an upper bound where a framework
  splits them;
- ``expert``: a tensor under an ``experts`` module, routed experts stacked as (E, ...): split
  by expert parallelism over its experts, then by expert TP.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Literal

from memplan.choices import Record
from memplan.units import ceil_div

Split = Literal["column", "row", "whole", "expert"]
TableTensor = tuple[Split, tuple[int, ...]]

# modules whose weight is an output projection by name: Llama's o_proj and down_proj, Mamba's
# and LFM2's out_proj, LFM2's w2, GraniteMoeHybrid's output_linear, GPT-style dense, c_proj,
# fc2 and wo
ROW_PARALLEL = frozenset({"o_proj", "down_proj", "out_proj", "w2", "output_linear", "dense",
                          "c_proj", "fc2", "wo", "dense_4h_to_h"})
# a mixture of experts' router, replicated by Megatron-LM (TopKRouter's weight)
# (and Qwen2-MoE's shared_expert_gate, a (1, h) gate memplan's readers count with it)
ROUTERS = frozenset({"router", "gate", "shared_expert_gate"})

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.*)$")


class ParamTable(Record):
    """The parameter tensors of a model's decoder layers (distinct ``rows`` and the row of
    each layer), and those of its last stage beside the output projection (``final``: the
    final norm and whatever else follows the layers). Shapes are whole tensors."""


    rows: tuple[tuple[TableTensor, ...], ...]
    layer_rows: tuple[int, ...]
    final: tuple[TableTensor, ...]
    fp32_elements: int = 0  # of them, elements transformers keeps in fp32 in a bf16 model

    def layer_split(self, index: int) -> tuple[int, int, int]:
        """Layer ``index``'s (TP-split, held whole, expert) elements."""
        return split_counts(self.rows[self.layer_rows[index]])

    def final_elements(self) -> int:
        return sum(math.prod(shape) for _, shape in self.final)

    def layer_shapes(self, index: int, t: int, ep: int, etp: int) -> list[tuple[int, ...]]:
        """Layer ``index``'s tensors on one TP (and EP) rank, in registration order."""
        return [rank_shape(split, shape, t, ep, etp) for split, shape in
                self.rows[self.layer_rows[index]]]

    def final_shapes(self) -> list[tuple[int, ...]]:
        return [shape for _, shape in self.final]

    @property
    def num_layer_elements(self) -> int:
        return sum(sum(split_counts(self.rows[r])) for r in self.layer_rows)


def split_counts(row: Iterable[TableTensor]) -> tuple[int, int, int]:
    """(TP-split, held whole, expert) elements of a row of tensors."""
    sums = {"split": 0, "whole": 0, "expert": 0}
    for split, shape in row:
        key = "split" if split in ("column", "row") else split
        sums[key] += math.prod(shape)
    return sums["split"], sums["whole"], sums["expert"]


def rank_shape(split: Split, shape: tuple[int, ...], t: int, ep: int,
               etp: int) -> tuple[int, ...]:
    """A tensor's shape on one rank (the most loaded: ceil where a split is uneven)."""
    if split == "column":
        return (ceil_div(shape[0], t), *shape[1:])
    if split == "row":
        return (*shape[:-1], ceil_div(shape[-1], t))
    if split == "expert":
        experts = (ceil_div(shape[0], ep), *shape[1:])
        return (experts[0], ceil_div(experts[1], etp), *experts[2:]) if len(shape) > 1 \
            else experts
    return shape


def classify(name: str, shape: tuple[int, ...], weights: dict[str, tuple[int, ...]]) -> Split:
    """The TP split assumed for tensor ``name`` (module docstring); ``weights``: every
    tensor's shape by name (a bias follows its module's weight)."""
    module, _, leaf = name.rpartition(".")
    last = module.rpartition(".")[2]
    if ".experts." in f".{name}" or module.endswith("experts"):
        return "expert"
    if len(shape) >= 2:
        if last in ROUTERS:
            return "whole"
        return "row" if last in ROW_PARALLEL else "column"
    weight = weights.get(f"{module}.weight", ())
    if leaf == "bias" and len(weight) >= 2 and last not in ROW_PARALLEL | ROUTERS:
        return "column"
    return "whole"


def _stacked(named: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """Experts built one module each (``experts.N.w``) as one stacked (E, ...) tensor per
    name, at the place of expert 0's."""
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: dict[str, int] = {}
    for name, shape in named:
        m = _EXPERT.match(name)
        if not m:
            out.append((name, shape))
            continue
        key = f"{m.group(1)}.{m.group(3)}"
        if key in seen:
            pos = seen[key]
            out[pos] = (key, (out[pos][1][0] + 1, *out[pos][1][1:]))
        else:
            seen[key] = len(out)
            out.append((key, (1, *shape)))
    return out


def build_table(named: list[tuple[str, tuple[int, ...]]], num_layers: int, vocab: int,
                hidden: int, tied: bool, fp32_elements: int = 0) -> ParamTable | str:
    """The table of a model's named parameter tensors in registration order (each once), or
    why they do not fit the spec's embedding and head (a reason, in words)."""
    weights = dict(named)
    layers: list[list[TableTensor]] = [[] for _ in range(num_layers)]
    before: list[TableTensor] = []
    final: list[TableTensor] = []
    embedding = head = None
    after = False  # a layer's tensor seen
    for name, shape in named:
        m = _LAYER.search(name)
        if m:
            index = int(m.group(1))
            if index >= num_layers:
                return f"{name} is beyond the config's {num_layers} layers"
            layers[index].append((classify(name, shape, weights), shape))
            after = True
        elif name.startswith("lm_head.") and name.endswith("weight") and head is None:
            head = shape
        elif embedding is None and not after and shape == (vocab, hidden):
            embedding = shape
        else:
            (final if after else before).append(("whole", shape))
    if embedding is None:
        return f"no ({vocab}, {hidden}) token embedding before the layers"
    if (head is None) != tied or head not in (None, (vocab, hidden)):
        return f"an output projection of shape {head} where the config says tied={tied}"
    rows: list[tuple[TableTensor, ...]] = []
    layer_rows = []
    for i, row in enumerate(layers):
        row_t = tuple((before if i == 0 else []) + row)
        if row_t not in rows:
            rows.append(row_t)
        layer_rows.append(rows.index(row_t))
    return ParamTable(rows=tuple(rows), layer_rows=tuple(layer_rows), final=tuple(final),
                      fp32_elements=fp32_elements)


def table_from_build(named: list[tuple[str, tuple[int, ...]]], num_layers: int, vocab: int,
                     hidden: int, tied: bool, fp32_elements: int = 0) -> ParamTable | str:
    """``build_table`` with experts built one module each stacked first."""
    return build_table(_stacked(named), num_layers, vocab, hidden, tied, fp32_elements)


RULES = ("tensor parallelism is assumed to split a matrix on its output features (on its "
         "input features for the output projections o_proj, down_proj, out_proj, w2, "
         "output_linear) and a split projection's bias, and to hold every other 1-D tensor "
         "(norms, per-head values) and a router whole on every TP rank; experts are split by "
         "EP, then expert TP")
