"""torchao's ``NF4Tensor`` as released since 0.3 (torchtune's QLoRA base weights once it left
``torchao==0.1``) traced on CPU under the exact tensor tracker, against ``--base-quant
nf4-torchao``'s bytes (``memplan.model.adapters``): what one quantized weight stores, what the
load's ``copy_`` of a bf16 weight into it holds (``from_tensor`` on the incoming tensor, its
nearest code value taken 1024**2 weights at a time), and what ``get_original_weight`` holds
while it dequantizes (``LinearNF4``'s forward and backward run it through ``weight.to(dtype)``;
called directly, because a dispatch mode does not see the ops a tensor subclass's
``__torch_dispatch__`` runs). Shapes up to 16 times the chunk, so that the chunked working set
is read below, at and above one chunk.

torchao 0.18 (the test extra's) keeps ``NF4Tensor`` in ``torchao.quantization``; 0.3 to 0.17
in ``torchao.dtypes.nf4tensor``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")
try:
    from torchao.quantization import to_nf4
except ImportError:
    to_nf4 = pytest.importorskip("torchao.dtypes.nf4tensor").to_nf4

from memplan.model.adapters import (  # noqa: E402
    TORCHAO_NF4_CHUNK,
    nf4_torchao_bytes,
    quant_data_bytes,
    torchao_chunked_quantize_bytes,
    torchao_copy_pieces,
    torchao_dequant_bytes,
)
from memplan.profile.tracker import MemoryTracker  # noqa: E402
from memplan.workload import BaseQuant  # noqa: E402

# (rows, columns): a multiple of 64 x 256 weights, as NF4Tensor requires; below one chunk,
# one chunk (square and not), four chunks and sixteen
SHAPES = [(256, 512), (1024, 1024), (512, 2048), (2048, 2048), (4096, 1024), (4096, 4096)]
PIECES = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
# what FSDP2 gathers of a shard (``NF4Tensor.fsdp_pre_all_gather``)
GATHERED = ("quantized_scalers", "quantization_factor", "quantized_data")


def _pieces(weight) -> list:
    return [getattr(weight, name) for name in PIECES]


def _bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.fixture(autouse=True)
def _not_0_1() -> None:
    weight = to_nf4(torch.randn(256, 512, dtype=torch.bfloat16))
    if weight.quantization_factor.numel() != 256 * 512 // 64 // 256:
        pytest.skip("torchao before 0.3: the factors are a view of one element per block")


@pytest.mark.parametrize("shape", SHAPES)
def test_stored_bytes(shape: tuple[int, int]) -> None:
    """1024 x 1024 by hand: 524,288 nibble bytes + 16,384 int8 scales + 64 bf16 factors
    (128 bytes) + 2 (mean) + 32 (code) = 540,834; of them FSDP2 gathers all but the mean and
    the code."""
    weight = to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
    n = shape[0] * shape[1]
    assert _bytes(_pieces(weight)) == nf4_torchao_bytes(n)
    gathered = _bytes(getattr(weight, name) for name in GATHERED)
    assert gathered == quant_data_bytes(BaseQuant.NF4_TORCHAO, shape[1], shape[0])
    if n == 1 << 20:
        assert nf4_torchao_bytes(n) == 540_834
        assert gathered == 540_800


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_working_set(shape: tuple[int, int]) -> None:
    """The most bytes alive while ``to_nf4`` quantizes a bf16 weight, the source included (the
    tracker counts it from the first op that returns it). By hand, 1024 x 1024 (one chunk):
    69 x 1,048,576 + 3 x 16,384 + 128 + 34 = 72,401,058; 4096 x 1024 (four): 5 x 4,194,304 +
    64 x 1,048,576 + 3 x 65,536 + 512 + 34 = 88,277,538."""
    n = shape[0] * shape[1]
    src = torch.randn(*shape, dtype=torch.bfloat16)
    with MemoryTracker() as tracker:
        to_nf4(src)
    assert tracker.high_water_bytes == torchao_chunked_quantize_bytes(n)
    assert torchao_chunked_quantize_bytes(n) == sum(torchao_copy_pieces(n))
    if n == 1 << 20:
        assert torchao_chunked_quantize_bytes(n) == 72_401_058
    if n == 4 << 20:
        assert torchao_chunked_quantize_bytes(n) == 88_277_538
        assert n > TORCHAO_NF4_CHUNK


@pytest.mark.parametrize("shape", [(1024, 1024), (4096, 1024)])
def test_copy_into_a_weight_keeps_its_pieces(shape: tuple[int, int]) -> None:
    """The load's path: ``copy_`` of a bf16 tensor into an ``NF4Tensor`` (the ``aten.copy_``
    handler: ``from_tensor`` on the incoming tensor, then the new pieces copied into the old
    ones) leaves the weight in its own storages, the same bytes, and holds the new weight's
    values. (Its working set is ``to_nf4``'s, above: the handler runs inside the subclass's
    ``__torch_dispatch__``, which a dispatch mode does not see.)"""
    weight = to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
    before = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
              for t in _pieces(weight)]
    src = torch.randn(*shape, dtype=torch.bfloat16)
    weight.copy_(src)
    assert [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            for t in _pieces(weight)] == before
    assert torch.equal(weight.quantized_data, to_nf4(src).quantized_data)


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_dequantize_working_set(shape: tuple[int, int]) -> None:
    """The most bytes ``get_original_weight`` holds beyond the stored weight: 0.1's (1024 x
    1024 by hand: 14 x 1,048,576 + 2 x 16,384 = 14,712,832)."""
    n = shape[0] * shape[1]
    weight = to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
    with MemoryTracker() as tracker:
        tracker.register(_pieces(weight), "parameters")
        stored = tracker.total_bytes
        out = weight.get_original_weight()
    assert out.dtype == torch.bfloat16
    assert tracker.high_water_bytes - stored == torchao_dequant_bytes(n)
