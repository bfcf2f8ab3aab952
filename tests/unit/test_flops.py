"""Forward FLOPs per token from the blocks (``memplan.model.flops``), which the step-time model
reads, derived by hand: sliding windows and MLA's value head."""

from __future__ import annotations

from memplan.model.flops import head_flops_per_token, layer_flops
from memplan.spec import load_model
from memplan.planning.timing import forward_flops_per_token


def test_sliding_window_layers_attend_over_their_window() -> None:
    """gemma-2-9b: 16 heads of 256 (q = 4,096), a window of 4,096 on every other layer
    (pattern 2: layers 0, 2, ...), 42 layers. At seq 8,192 a full layer's core is 2 * 8,192 *
    4,096 = 67,108,864; a sliding one's average context is 4,096 - 4,096^2 / (2 * 8,192) =
    3,072 keys: 4 * 3,072 * 4,096 = 50,331,648. The model's attention: 21 of each,
    2,466,250,752. At seq 4,096 (not beyond the window) both are 2 * 4,096 * 4,096 =
    33,554,432."""
    spec = load_model("gemma-2-9b")
    layers = layer_flops(spec, 8192)
    assert (layers[0].attention, layers[1].attention) == (50_331_648, 67_108_864)
    assert layers[0].matmul == layers[1].matmul
    assert forward_flops_per_token(spec, 8192)[1] == 2_466_250_752
    assert {layer.attention for layer in layer_flops(spec, 4096)} == {33_554_432}


def test_mla_core_reads_the_value_head() -> None:
    """deepseek-v3: 128 heads, QK^T over the 192-wide query/key head and PV over the 128-wide
    value head, each over the causal average context s/2, 2 FLOPs per multiply-add: at seq
    4,096, 2 * 2,048 * 128 * (192 + 128) = 167,772,160 per layer."""
    layers = layer_flops(load_model("deepseek-v3"), 4096)
    assert {layer.attention for layer in layers} == {167_772_160}


def test_head_projection_counts_the_whole_vocabulary_tied_or_not() -> None:
    """2 FLOPs per output-projection weight, the whole vocabulary: llama-2-7b (untied) 2 *
    32,000 * 4,096 = 262,144,000; gemma-2-9b (tied to its embedding, still a matmul) 2 *
    256,000 * 3,584 = 1,835,008,000. The step-time model's head term: the projection and head
    matmuls of ``forward_flops_per_token`` are the layers' plus it."""
    llama, gemma = load_model("llama-2-7b"), load_model("gemma-2-9b")
    assert head_flops_per_token(llama) == 262_144_000
    assert head_flops_per_token(gemma) == 1_835_008_000
    layers = sum(layer.matmul for layer in layer_flops(llama, 4096))
    assert forward_flops_per_token(llama, 4096)[0] == layers + 262_144_000
