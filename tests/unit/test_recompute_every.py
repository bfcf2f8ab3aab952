"""Full recompute of every n-th layer (``recompute_every``, ``--recompute-every``): torchtitan's
``selective_ac_option = n``.

torchtitan v0.2.2 (distributed/activation_checkpoint.py ``_apply_layer_sac``) counts the blocks
it wraps in one process-wide counter, starting at 1, each model part of the rank in turn, and
wraps a block in full AC when the count is a multiple of n. Each pipeline rank is its own
process, so the count starts again on every rank and runs across its virtual stages.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memplan import api
from memplan.cli import app
from memplan.errors import MemplanError
from memplan.model.stage_parts import layer_keys, stage_layer_indices
from memplan.spec import load_model
from memplan.workload import Recompute, Workload

F, N = Recompute.FULL, Recompute.NONE


def _policies(wl: Workload, layers: list[int]) -> list[Recompute]:
    spec = load_model("llama-3-8b")
    return [key[1] for key in layer_keys(spec, wl, layers)]


def test_every_second_layer_of_one_rank() -> None:
    """debug_model.toml's 6 layers with n = 2: counts 1..6, the even counts wrapped: layers
    1, 3, 5 (0-based)."""
    wl = Workload(recompute="full", recompute_every=2)
    assert _policies(wl, list(range(6))) == [N, F, N, F, N, F]


def test_every_third_layer() -> None:
    """n = 3 over 7 layers: counts 3 and 6, layers 2 and 5."""
    wl = Workload(recompute="full", recompute_every=3)
    assert _policies(wl, list(range(7))) == [N, N, F, N, N, F, N]


def test_the_count_restarts_on_each_pipeline_rank_and_runs_over_its_chunks() -> None:
    """Llama-3-8B (32 layers) on pp 2, vpp 2: rank 0 holds chunks [0..7] and [16..23] (8 layers
    each, its stages 0 and 2), counted 1..16 in that order; n = 3 wraps counts 3, 6, ..., 15:
    positions 2, 5, 8, 11, 14 = layers 2, 5, 16, 19, 22."""
    spec = load_model("llama-3-8b")
    layers = list(stage_layer_indices(spec, 2, 2, 0))
    assert layers == [*range(8), *range(16, 24)]
    wl = Workload(recompute="full", recompute_every=3)
    full = [i for i, p in zip(layers, _policies(wl, layers)) if p is F]
    assert full == [2, 5, 16, 19, 22]


def test_every_first_layer_is_full_recompute() -> None:
    """n = 1: every count a multiple: the same estimate as full recompute of every layer."""
    every = api.estimate("llama-3-8b", gpus=8, zero=3, recompute="full", recompute_every=1,
                         seq_len=2048)
    full = api.estimate("llama-3-8b", gpus=8, zero=3, recompute="full", seq_len=2048)
    assert every.peak_bytes == full.peak_bytes


def test_every_layer_count_past_the_stage_recomputes_nothing() -> None:
    """n larger than a rank's layers (32): no count reaches it, as no recompute."""
    every = api.estimate("llama-3-8b", gpus=8, zero=3, recompute="full", recompute_every=33,
                         seq_len=2048)
    none = api.estimate("llama-3-8b", gpus=8, zero=3, recompute="none", seq_len=2048)
    assert every.peak_bytes == none.peak_bytes


@pytest.mark.parametrize(("extra", "match"), [
    ({"recompute": "selective", "recompute_every": 2}, "applies only to recompute full"),
    ({"recompute": "full", "recompute_every": 2, "recompute_layers": 4}, "give one"),
    ({"recompute": "full", "recompute_every": 0}, "recompute-every"),
])
def test_refused(extra: dict, match: str) -> None:
    with pytest.raises(MemplanError, match=match):
        api.estimate("llama-3-8b", gpus=8, **extra)


def test_cli_flag() -> None:
    result = CliRunner().invoke(app, ["estimate", "-m", "llama-3-8b", "-n", "8", "--zero", "3",
                                      "--recompute", "full", "--recompute-every", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert '"recompute_every": 2' in result.output
