"""torchao 0.1's ``to_nf4`` and ``get_original_weight`` traced on CPU with the allocation
recorder, against ``memplan.model.nf4_init``'s patterns: the same allocations (sizes) and frees,
in the same order. torchao 0.1 is pure Python (``pip install --no-deps torchao==0.1``); skipped
with any other version."""

from __future__ import annotations

import importlib.metadata

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")
if importlib.metadata.version("torchao") != "0.1":
    pytest.skip("torchao 0.1 only", allow_module_level=True)

from torchao.dtypes.nf4tensor import to_nf4  # noqa: E402

from memplan.model import nf4_init  # noqa: E402
from memplan.model.alloc_sequence import Builder  # noqa: E402
from memplan.model.allocator import Alloc  # noqa: E402
from memplan.profile.alloc_trace import AllocationRecorder  # noqa: E402

SHAPES = [(256, 512), (1024, 1024), (11008, 64)]
PIECES = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def _shape_of(events, skip: set[int]) -> list[tuple[str, int]]:
    """Events as (alloc, size) and (free, position of its allocation among the kept ones)."""
    order: list[int] = []
    out: list[tuple[str, int]] = []
    sizes = {}
    for ev in events:
        if isinstance(ev, Alloc):
            if ev.id in skip:
                continue
            order.append(ev.id)
            sizes[ev.id] = ev.size_bytes
            out.append(("a", ev.size_bytes))
        elif ev.id not in skip:
            out.append(("f", order.index(ev.id)))
    return out


def _model(run, n: int) -> list[tuple[str, int]]:
    b = Builder()
    run(b, n)
    return _shape_of(b.events, set())


@pytest.mark.parametrize("shape", SHAPES)
def test_to_nf4_sequence(shape: tuple[int, int]) -> None:
    src = torch.randn(*shape, dtype=torch.bfloat16)
    rec = AllocationRecorder()
    with rec:
        kept = to_nf4(src)
    # the source is counted from the first op that returns it (to(bfloat16)): not to_nf4's own
    source = {ev.id for ev in rec.events
              if isinstance(ev, Alloc) and ev.id == 1 and ev.size_bytes == 2 * src.numel()}
    assert _shape_of(rec.events, source) == _model(nf4_init.to_nf4, src.numel())
    assert kept.quantized_data.dtype == torch.uint8


@pytest.mark.parametrize("shape", SHAPES)
def test_get_original_weight_sequence(shape: tuple[int, int]) -> None:
    weight = to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
    rec = AllocationRecorder()
    with rec:
        rec.register([getattr(weight, name) for name in PIECES], "parameters")
        stored = {ev.id for ev in rec.events}
        out = weight.get_original_weight()
    assert out.dtype == torch.bfloat16
    assert _shape_of(rec.events, stored) == _model(nf4_init.get_original_weight,
                                                   shape[0] * shape[1])
