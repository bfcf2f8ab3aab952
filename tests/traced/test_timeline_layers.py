"""The timeline plot's optimizer layers on a real profile: the master copy from setup, the
moments from step 1's optimizer step, as the model's first-step peaks count them
(``memplan.model.stage``: ``peaks(st.master_bytes + st.setup_bytes, ...)`` for step 1).

The ``tiny`` spec holds 108,864 parameters: embedding 128 x 64 = 8,192, two layers of
46,208 (attention q and o 64 x 64, k and v 64 x 32 (2 kv heads of 16) = 12,288; SwiGLU
3 x 64 x 176 = 33,792; two norms of 64), the final norm's 64 and an untied head of 8,192.
Under bf16-mixed the weights are 2 B each (217,728 bytes), the fp32 master copy 4 B each
(435,456 bytes), AdamW's two fp32 moments 8 B each (870,912 bytes).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from memplan.api import resolve
from memplan.model.model_states import stage_params, state_bytes
from memplan.profile.reference_profile import profile_reference
from memplan.report.plot_timeline import (
    SETUP_LAYER,
    STATES_LAYER,
    setup_optimizer_bytes,
    stack_layers,
)

PARAMS = 8_192 + 2 * 46_208 + 64 + 8_192


def test_master_layer_starts_where_the_model_says():
    spec, par, wl = resolve("tiny", micro_batch_size=2, seq_len=64)
    assert PARAMS == 108_864
    tl = profile_reference(spec, par, wl, steps=2)
    first = next(k for k, s in enumerate(tl.samples) if s.step == 1)
    assert tl.samples[first].by_category["parameters"] == 2 * PARAMS
    # what the model holds from optimizer setup through step 1 until its optimizer step
    st = state_bytes(stage_params(spec, par, list(range(spec.num_layers)), first=True,
                                  last=True), par, wl)
    assert st.master_bytes + st.setup_bytes == 4 * PARAMS == setup_optimizer_bytes(tl)
    layers = stack_layers(tl)
    step1 = [k for k, s in enumerate(tl.samples) if s.step == 1]
    assert {layers[SETUP_LAYER][k] for k in step1} == {4 * PARAMS}
    # no moments before step 1's optimizer step; the two fp32 moments from there on
    states = [k for k in step1 if layers[STATES_LAYER][k]]
    assert states and {tl.samples[k].phase for k in states} == {"optimizer"}
    assert {layers[STATES_LAYER][k] for k, s in enumerate(tl.samples) if s.step == 2} == {
        8 * PARAMS}
