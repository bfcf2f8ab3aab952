"""torchtune's QLoRA set-up with torchao 0.1's NF4Tensor as allocation events
(``memplan.model.nf4_init``): the patterns' bytes against the counts derived by hand in
``memplan.model.adapters`` (each traced on CPU in tests/traced/test_torchao_nf4.py)."""

from __future__ import annotations

import pytest

from memplan.model.adapters import nf4_torchao_01_bytes, torchao_quantize_bytes
from memplan.model.alloc_sequence import Builder
from memplan.model.nf4_init import get_original_weight, qlora_setup, stored_bytes, to_nf4

SIZES = [1 << 20, 4096 * 4096, 11008 * 4096]


@pytest.mark.parametrize("n", SIZES)
def test_to_nf4_leaves_the_stored_weight_and_peaks_at_its_working_set(n: int) -> None:
    """What to_nf4 leaves is the stored weight (1024 x 1024: 573,474 B); its peak with the
    bf16 source (2 n, alive before) is ``torchao_quantize_bytes`` (1024 x 1024: 71,385,122)."""
    b = Builder()
    src = b.alloc(2 * n)
    kept = to_nf4(b, n)
    b.free(src)
    assert len(kept) == 5
    assert b.alive == stored_bytes(n) == nf4_torchao_01_bytes(n)
    assert b.peak == torchao_quantize_bytes(n)


@pytest.mark.parametrize("n", SIZES)
def test_get_original_weight_returns_the_bf16_weight(n: int) -> None:
    """Beyond the stored weight, get_original_weight holds at most 14 n + n / 32 bytes
    (``adapters.torchao_dequant_bytes``, 1024 x 1024: 14,712,832) and returns 2 n bytes."""
    b = Builder()
    out = get_original_weight(b, n)
    assert b.alive == 2 * n
    assert b.peak == 14 * n + n // 32
    b.free(out)
    assert b.alive == 0


def test_setup_leaves_the_weights_and_the_rest() -> None:
    """Two layers of two 1 MiB-element NF4 weights and 1,000 bytes of other tensors: after
    construction, cloning, the template's end and the load, what is alive is 4 stored weights
    (4 x 573,474 B) and the 1,000 bytes."""
    b = Builder()
    qlora_setup(b, ((1 << 20, 1 << 20), (1 << 20, 1 << 20)), [600, 400])
    assert b.alive == 4 * 573_474 + 1_000
