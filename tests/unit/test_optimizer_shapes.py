"""Optimizers whose states or step read each tensor's shape: torch.optim.Adafactor (factored
second moments) and torch.optim.Muon beside AdamW (``memplan.model.optimizer``), by hand on
the tiny spec, and the shapes the blocks give (``StageParams.tensor_shapes``).

Tiny (2 layers, h 64, 4 heads / 2 KV heads of 16, f 176, V 128, untied, RMSNorm): per layer
norm (64), q (64, 64), k and v (32, 64), o (64, 64), norm (64), gate and up (176, 64), down
(64, 176); the embedding and the head (128, 64), the final norm (64). 108,864 parameters,
320 of them in the five norms. bf16-pure: the optimizer updates the bf16 weights, 2 bytes.
"""

from __future__ import annotations

import glob
import math
from pathlib import Path

import pytest

from memplan.api import estimate
from memplan.errors import MemplanError
from memplan.model.embedding import EmbeddingBlock
from memplan.model.head import HeadBlock
from memplan.model.layer import layer_tensor_shapes, layer_tensor_sizes
from memplan.spec import load_model


def _tiny(optimizer: str, impl: str = "foreach"):
    return estimate("tiny", optimizer=optimizer, optimizer_impl=impl, precision="bf16-pure",
                    seq_len=128).worst


def test_adafactor_factored_states() -> None:
    """Row + column factors per matrix, the whole vector otherwise: embedding and head
    128 + 64 = 192 each; per layer q and o 128, k and v 96, gate, up and down 240, two norms
    64 -> 1296; final norm 64. 2 x 192 + 2 x 1296 + 64 = 3040 elements x 2 B = 6080."""
    assert _tiny("adafactor").optimizer_bytes == 6080


def test_adafactor_step_temporaries() -> None:
    """foreach: a var_estimate per parameter, all alive at once: 108,864 x 2 = 217,728.
    for-loop: the previous tensor's update beside the current matrix's var_estimate (a
    vector's two): largest up after gate (or down after up), 11,264 + 11,264 = 22,528
    elements = 45,056 B."""
    assert _tiny("adafactor").optimizer_temp_bytes == 217_728
    assert _tiny("adafactor", "forloop").optimizer_temp_bytes == 45_056


def test_muon_states_and_step() -> None:
    """Momentum buffers for the 2-D parameters: (108,864 - 320) x 2 = 217,088; AdamW's two
    states for the norms: 320 x 2 x 2 = 1280; 218,368 in all. Step: gate/up (176, 64), k 64,
    K 176: the lerp 11,264 x 2 = 22,528 and Newton-Schulz 2 x (2 x 64^2 + 2 x 64 x 176) =
    61,440 -> 83,968 (AdamW's foreach over the norms, 640, is smaller); fused AdamW keeps
    5 device step counts for the norms (20 B)."""
    muon = _tiny("muon")
    assert muon.optimizer_bytes == 218_368
    assert muon.optimizer_temp_bytes == 83_968
    assert _tiny("muon", "fused").optimizer_bytes == 218_368 + 5 * 4


@pytest.mark.parametrize("path", sorted(glob.glob("model_specs/models/*.toml")))
def test_shapes_hold_the_sizes(path: str) -> None:
    """Every block's tensor shapes multiply out to its tensor sizes, at every TP degree."""
    spec = load_model(Path(path).stem)
    for t in (1, 2, 8):
        for moe in {spec.is_moe_layer(i) for i in range(spec.num_layers)}:
            assert ([math.prod(s) for s in layer_tensor_shapes(spec, t, 1, moe)]
                    == layer_tensor_sizes(spec, t, 1, moe))
        for block in (EmbeddingBlock(), HeadBlock()):
            assert ([math.prod(s) for s in block.tensor_shapes(spec, t, 1)]
                    == block.tensor_sizes(spec, t, 1))


def test_muon_with_zero_is_refused() -> None:
    with pytest.raises(MemplanError, match="optimizer muon with zero 1"):
        estimate("tiny", gpus=2, zero=1, optimizer="muon")
