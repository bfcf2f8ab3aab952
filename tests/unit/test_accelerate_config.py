"""``--accelerate-config``: an Accelerate config YAML read as memplan's inputs
(``memplan.config_import.accelerate``), the mapping printed, what is not modelled refused by
name (one line, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.api import estimate
from memplan.cli import app, main
from memplan.config_import import Imported
from memplan.config_import.accelerate import parse_yaml, read
from memplan.errors import MemplanError

DATA = Path(__file__).resolve().parents[1] / "data" / "accelerate"
EXAMPLE = DATA / "fsdp1_full_shard.yaml"  # as `accelerate config` writes it (safe_dump, sorted)


def _write(tmp_path: Path, fsdp: dict, **top) -> Path:
    lines = ["distributed_type: FSDP", "num_processes: 4", "mixed_precision: bf16",
             *(f"{k}: {v}" for k, v in top.items()), "fsdp_config:",
             "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
             *(f"  {k}: {v}" for k, v in fsdp.items())]
    path = tmp_path / "config.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_example_config_maps_key_by_key() -> None:
    imp = read(EXAMPLE, 1)
    assert [(m.key, m.target, m.value) for m in imp.mapping] == [
        ("num_processes", "gpus", 8),
        ("mixed_precision", "precision", "fsdp-bf16"),
        ("fsdp_config.fsdp_version", "fsdp_version", 1),
        ("fsdp_config.fsdp_sharding_strategy", "zero", 3),
        ("fsdp_config.fsdp_use_orig_params", "use_orig_params", False),
        ("fsdp_config.fsdp_backward_prefetch", "backward_prefetch", "pre"),
    ]
    assert any("LlamaDecoderLayer" in note for note in imp.notes)


def test_the_estimate_is_the_one_of_the_same_flags() -> None:
    """The mapped config, through the CLI, prints the mapping and the estimate the same
    flags give."""
    out = CliRunner().invoke(app, ["estimate", "-m", "tiny", "--accelerate-config", str(EXAMPLE),
                                   "--seq", "64", "--json"])
    assert out.exit_code == 0, out.output
    import json

    got = json.loads(out.output)
    same = estimate("tiny", gpus=8, zero=3, fsdp_version=1, backward_prefetch="pre",
                    use_orig_params=False,
                    precision="fsdp-bf16", framework="hf", seq_len=64)
    assert got["config"]["mapping"][0]["input"] == "--gpus"
    assert got["stages"][0]["peak_bytes"] == same.stages[0].peak_bytes


def test_left_out_keys_take_the_plugins_defaults(tmp_path: Path) -> None:
    """FullyShardedDataParallelPlugin.__post_init__: version 1, FULL_SHARD, NO_PREFETCH."""
    imp = read(_write(tmp_path, {}), 1)
    got = {m.target: m.value for m in imp.mapping}
    assert (got["fsdp_version"], got["zero"], got["backward_prefetch"]) == (1, 3, "none")


def test_activation_checkpointing_and_hybrid_shard(tmp_path: Path) -> None:
    """fsdp_activation_checkpointing wraps every unit in a checkpoint (recompute full);
    HYBRID_SHARD over 2 machines of 8 processes shards within a machine (dp_shard 8)."""
    path = _write(tmp_path, {"fsdp_activation_checkpointing": "true",
                             "fsdp_reshard_after_forward": "HYBRID_SHARD"},
                  num_machines=2)
    path.write_text(path.read_text().replace("num_processes: 4", "num_processes: 16"))
    got = {m.target: m.value for m in read(path, 1).mapping}
    assert (got["recompute"], got["dp_shard"], got["gpus"]) == ("full", 8, 16)


@pytest.mark.parametrize(("fsdp", "top", "named"), [
    ({"fsdp_sharding_strategy": "NO_SHARD"}, {}, "fsdp_config.fsdp_sharding_strategy"),
    ({"fsdp_sharding_strategy": 5}, {}, "fsdp_config.fsdp_sharding_strategy"),
    ({"fsdp_use_orig_params": "yes please"}, {}, "fsdp_config.fsdp_use_orig_params"),
    ({"fsdp_forward_prefetch": "true"}, {}, "fsdp_config.fsdp_forward_prefetch"),
    ({"fsdp_offload_params": "true"}, {}, "fsdp_config.fsdp_offload_params"),
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, {}, "fsdp_config.fsdp_auto_wrap_policy"),
    ({"fsdp_limit": 3}, {}, "fsdp_config.fsdp_limit"),
    ({}, {"mixed_precision": "fp16"}, "mixed_precision"),
    ({}, {"zero_stage": 2}, "zero_stage"),
])
def test_what_is_not_modelled_is_refused_by_name(tmp_path: Path, fsdp: dict, top: dict,
                                                 named: str) -> None:
    path = _write(tmp_path, fsdp, **top)
    if "mixed_precision" in top:
        path.write_text(path.read_text().replace("mixed_precision: bf16\n", ""))
    with pytest.raises(MemplanError, match=named.replace(".", r"\.")):
        read(path, 1)
    assert main(["estimate", "-m", "tiny", "--accelerate-config", str(path)]) == 2


def test_other_launchers_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ddp.yaml"
    path.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    with pytest.raises(MemplanError, match="distributed_type"):
        read(path, 1)


def test_the_yaml_subset() -> None:
    """Quoted strings, booleans, numbers, null, [] and {}, block lists and comments, as
    yaml.safe_dump writes and yaml.safe_load reads them; anything else refused with its line."""
    imp = Imported(source="t")
    got = parse_yaml("a: 'no'\nb: true\nc: 3\nd: 0.5\ne: null\nf: []\ng:\n  h: x # c\n"
                     "i:\n- 0\n- 1\n", imp)
    assert got == {"a": "no", "b": True, "c": 3, "d": 0.5, "e": None, "f": [], "g": {"h": "x"},
                   "i": [0, 1]}
    with pytest.raises(MemplanError, match="line 2"):
        parse_yaml("a: 1\nnot yaml\n", imp)


@pytest.mark.parametrize("given", ["SHARD_GRAD_OP", 2])
def test_shard_grad_op_keeps_units_gathered(tmp_path: Path, given) -> None:
    """SHARD_GRAD_OP (by name or by its number, 2): zero 3 without resharding after forward."""
    got = {m.target: m.value for m in read(_write(tmp_path, {"fsdp_sharding_strategy": given}),
                                           1).mapping}
    assert (got["zero"], got["reshard_after_forward"]) == (3, False)
