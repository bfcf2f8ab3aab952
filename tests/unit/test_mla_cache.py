"""What a training forward's key/value cache does to DeepSeek's latent attention
(``Workload.mla_cache``, memplan.model.mla): transformers 5.23 caches the latents and rebuilds
the key and value from them (DeepseekV3Attention.expand_kv), the core's value a view of
kv_b_proj's whole output; 5.3 cached the expanded key and value, which the core saved instead.
Bytes by hand; traced on both versions in tests/traced/test_frameworks.py (deepseek-v3-toy),
whose harness reads the installed version's cache off the attention module."""

from __future__ import annotations

from memplan.api import make_layout, make_workload
from memplan.model.dims import Dims
from memplan.model.mla import mla_terms
from memplan.spec import load_model
from memplan.workload import Recompute


def _value_terms(**fields) -> dict[str, int]:
    spec = load_model("deepseek-v3")
    wl = make_workload(spec, framework="hf", seq_len=16, micro_batch_size=1,
                       precision="bf16-pure", **fields)
    dm = Dims.of(spec, make_layout(1), wl)
    return {t.name: t.size_bytes for t in mla_terms(spec, wl, dm, Recompute.NONE)
            if t.name in ("mla.v", "mla.kv_up")}


def test_latent_cache_keeps_the_kv_b_output() -> None:
    """deepseek-v3: 128 heads, qk_nope 128, v 128; one sequence of 16 tokens in bf16. With
    the latents cached (the default) the core's value keeps kv_b_proj's output: 16 x 128 x
    (128 + 128) x 2 = 1,048,576 B; with the expanded key and value cached (5.3) the core
    saves the cache's value copy instead: 16 x 128 x 128 x 2 = 524,288 B; without a cache,
    the kv_b output as with the latents."""
    assert _value_terms(kv_cache=True) == {"mla.kv_up": 1_048_576}
    assert _value_terms(kv_cache=True, mla_cache="expanded") == {"mla.v": 524_288}
    assert _value_terms(kv_cache=False, mla_cache="expanded") == {"mla.kv_up": 1_048_576}
