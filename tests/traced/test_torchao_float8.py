"""torchao's ``Float8Linear`` (``convert_to_float8_training``, as torchtitan's float8 converter
applies it) run on CPU (``torch._scaled_mm`` runs there on torch 2.13), against ``--float8``'s
bytes (``memplan.model.linear``): what one linear saves for backward (a saved-tensors hook),
and the float8 casts and scales each of its three matmuls reads (a dispatch mode sees
``aten.mm`` on the ``Float8TrainingTensor`` arguments, whose ``_data`` and ``_scale`` it
reads; the kernels the subclass's own dispatch runs are not seen), with the input-gradient
matmul's casts checked still alive at the weight-gradient matmul.

torchao is not a project dependency; the tests are skipped without it (checked with torchao
0.18.0's wheel on the path).
"""

from __future__ import annotations

import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.float8")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

from memplan.model import linear  # noqa: E402
from memplan.model.dims import Dims  # noqa: E402
from memplan.model.linear import Linear  # noqa: E402
from memplan.workload import Float8Recipe  # noqa: E402

TOKENS, D_IN, D_OUT = 16, 64, 96


class _MmCasts(TorchDispatchMode):
    """For each ``aten.mm``: the storages (data pointer, bytes, weak reference) of the float8
    data and scales of its arguments; at the third, whether the second's are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[tuple[int, int, weakref.ref]]] = []
        self.alive: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            parts = [t for a in args if hasattr(a, "_data") and hasattr(a, "_scale")
                     for t in (a._data, a._scale)]
            self.calls.append([(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(),
                                weakref.ref(t.untyped_storage())) for t in parts])
            if len(self.calls) == 3:
                self.alive = [ref() is not None for _, _, ref in self.calls[1]]
        return func(*args, **(kwargs or {}))


def _bytes(call: list[tuple[int, int, weakref.ref]]) -> int:
    return sum({ptr: n for ptr, n, _ in call}.values())


def _run(recipe: str):
    m = torch.nn.Sequential(torch.nn.Linear(D_IN, D_OUT, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(TOKENS, D_IN, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    mode = _MmCasts()
    with mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = m(x)
        y.sum().backward()
    return m[0], saved, mode


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_matches_trace(recipe: str) -> None:
    layer, saved, mode = _run(recipe)
    assert type(layer).__name__ == "Float8Linear"
    weight = layer.weight.untyped_storage().data_ptr()
    # saved: the bf16 input and a view of the weight itself, no float8 cast and no copy
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [
        (torch.bfloat16, (TOKENS, D_IN)), (torch.bfloat16, (D_IN, D_OUT))]
    assert saved[1].untyped_storage().data_ptr() == weight
    dm = Dims(b=1, s=TOKENS, s_kv=TOKENS, tokens=TOKENS, res_tokens_div=1, tp=1, e=2,
              vocab_shard=1, stream_e=2, float8=Float8Recipe(recipe))
    lin = Linear("up", "mlp", D_IN, D_OUT)
    assert linear.saved_bytes([lin], dm) == 0  # nothing beyond the input the block counts
    assert len(mode.calls) == 3
    assert _bytes(mode.calls[0]) == linear.float8_forward_bytes(lin, dm)
    assert all(mode.alive)
    assert (_bytes(mode.calls[1]) + _bytes(mode.calls[2])
            == linear.float8_backward_bytes(lin, dm))


def test_frozen_float8_linear_saves_its_input_and_makes_a_weight_gradient() -> None:
    """What float8 with LoRA would hold (refused: ``memplan.parallel.float8_rule``): a
    ``Float8Linear`` whose weight is frozen, as torchtitan's ``LoRAFloat8Linear`` freezes it
    (``components/lora.py``), still saves its bf16 input and runs the weight-gradient matmul
    (``matmul_with_hp_or_float8_args.backward`` computes ``grad_weight`` unconditionally;
    autograd drops it), unlike a plain frozen linear, which saves no input."""
    m = torch.nn.Sequential(torch.nn.Linear(D_IN, D_OUT, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("rowwise"))
    m[0].weight.requires_grad_(False)
    x = torch.randn(TOKENS, D_IN, dtype=torch.bfloat16, requires_grad=True)
    saved: list = []
    mode = _MmCasts()
    with mode:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            y = m(x)
        y.sum().backward()
    assert saved[0] is x
    assert len(mode.calls) == 3  # the output's, the input gradient's and the weight's mm
    assert m[0].weight.grad is None
