"""torchao 0.1's ``NF4Tensor`` (torchtune's QLoRA base weights while it pinned ``torchao==0.1``)
traced on CPU under the exact tensor tracker, against ``--base-quant nf4-torchao-0.1``'s bytes
(``memplan.model.adapters``): what one quantized weight stores, what ``to_nf4`` holds while it
quantizes a bf16 weight (torchtune's ``copy_`` runs it on the device for each weight of the
checkpoint), and what ``get_original_weight`` holds while it dequantizes (``LinearNF4``'s
forward and backward run it through ``weight.to(dtype)``: the ``_to_copy`` handler of
``NF4Tensor``; called directly here, because a dispatch mode does not see the ops a tensor
subclass's ``__torch_dispatch__`` runs).

torchao 0.1 is pure Python (``pip install --no-deps torchao==0.1``; its ``nf4tensor.py`` runs
on torch 2.13); the tests are skipped with any other version.
"""

from __future__ import annotations

import importlib.metadata

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")
if importlib.metadata.version("torchao") != "0.1":
    pytest.skip("torchao 0.1 only", allow_module_level=True)

from torchao.dtypes.nf4tensor import to_nf4  # noqa: E402

from memplan.model.adapters import (  # noqa: E402
    nf4_torchao_01_bytes,
    torchao_dequant_bytes,
    torchao_quantize_bytes,
)
from memplan.profile.tracker import MemoryTracker  # noqa: E402

# (rows, columns): a multiple of 64 x 256 weights, as NF4Tensor requires; one square, two not
SHAPES = [(256, 512), (1024, 1024), (512, 2048)]
PIECES = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def _stored(weight) -> int:
    return sum(getattr(weight, name).untyped_storage().nbytes() for name in PIECES)


@pytest.mark.parametrize("shape", SHAPES)
def test_stored_bytes(shape: tuple[int, int]) -> None:
    """1024 x 1024 by hand: 524,288 nibble bytes + 16,384 int8 scales + 16,384 bf16 elements
    of the factors' expanded tensor (32,768 bytes) + 2 (mean) + 32 (code) = 573,474."""
    weight = to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
    n = shape[0] * shape[1]
    assert _stored(weight) == nf4_torchao_01_bytes(n)
    if n == 1 << 20:
        assert nf4_torchao_01_bytes(n) == 573_474


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_working_set(shape: tuple[int, int]) -> None:
    """The most bytes alive while ``to_nf4`` quantizes a bf16 weight, the source included
    (the tracker counts it from the first op that returns it). 1024 x 1024 by hand: 68 x
    1,048,576 + 5 x 16,384 + 34 = 71,385,122."""
    n = shape[0] * shape[1]
    src = torch.randn(*shape, dtype=torch.bfloat16)
    with MemoryTracker() as tracker:
        to_nf4(src)
    assert tracker.high_water_bytes == torchao_quantize_bytes(n)
    if n == 1 << 20:
        assert torchao_quantize_bytes(n) == 71_385_122


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_working_set(shape: tuple[int, int]) -> None:
    """The most bytes ``get_original_weight`` holds beyond the stored weight. 1024 x 1024 by
    hand: 14 x 1,048,576 + 2 x 16,384 = 14,712,832."""
    n = shape[0] * shape[1]
    weight = to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
    with MemoryTracker() as tracker:
        tracker.register([getattr(weight, name) for name in PIECES], "parameters")
        stored = tracker.total_bytes
        out = weight.get_original_weight()
    assert out.dtype == torch.bfloat16
    assert tracker.high_water_bytes - stored == torchao_dequant_bytes(n)
    if n == 1 << 20:
        assert torchao_dequant_bytes(n) == 14_712_832
