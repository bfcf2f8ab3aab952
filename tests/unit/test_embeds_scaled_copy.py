"""The unscaled embedding a model's forward keeps beside the first layer's scaled input
(``ModelSpec.embeds_scaled_copy``: Gemma2Model.forward, GemmaModel.forward ``hidden_states =
inputs_embeds``, then ``hidden_states * normalizer``), by hand on tiny (h 64) with an 8-token
vocabulary, so that the layers set the forward's peak: seq 128, micro-batch 2, bf16."""

from __future__ import annotations

from memplan.api import estimate
from memplan.spec import ModelSpec, load_model


def _peaks(copy: bool, recompute: str):
    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-v8",
                                     "vocab_size": 8, "embeds_scaled_copy": copy})
    return estimate(spec, seq_len=128, micro_batch_size=2, framework="hf", recompute=recompute,
                    precision="bf16-pure").stages[0]


def test_checkpointed_layers_hold_the_unscaled_embedding_beside() -> None:
    """Under full recompute no layer keeps the unscaled tensor (each checkpointed layer's input
    is the scaled one): the forward's peak holds it too, b x s x h x e = 2 x 128 x 64 x 2 =
    32,768 B more; it is freed after the final norm, before the backward; nothing saves it."""
    with_copy, without = _peaks(True, "full"), _peaks(False, "full")
    assert with_copy.first_step.forward - without.first_step.forward == 32_768
    assert with_copy.first_step.backward == without.first_step.backward
    assert with_copy.activations_bytes == without.activations_bytes


def test_catalog_gemma_2_and_gemma_keep_it_gemma_3_does_not() -> None:
    """Gemma 3 scales inside its embedding module (Gemma3TextScaledWordEmbedding.forward),
    whose unscaled output is freed at once."""
    assert load_model("gemma-2-9b").embeds_scaled_copy
    assert load_model("gemma-7b").embeds_scaled_copy
    assert not load_model("gemma-3-12b").embeds_scaled_copy
