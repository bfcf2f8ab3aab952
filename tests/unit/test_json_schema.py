"""The ``--json`` outputs' published schema (docs/schema/output.schema.json): every command's
output carries ``schema_version`` and ``command`` and follows it. Every output any test makes
is validated (``tests/conftest.py``); these tests check the schema itself and that it has
teeth."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from memplan.cli import COMMANDS, main
from memplan.report.versioned import SCHEMA_VERSION

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "schema" /
                     "output.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def test_the_schema_covers_every_command_at_this_version() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert set(SCHEMA["properties"]["command"]["enum"]) == set(COMMANDS)
    assert SCHEMA["properties"]["schema_version"] == {"const": SCHEMA_VERSION}
    assert {rule["if"]["properties"]["command"]["const"] for rule in SCHEMA["allOf"]} == \
        set(COMMANDS)


@pytest.mark.parametrize("argv", [["estimate", "-m", "llama-7b", "-n", "8"],
                                  ["plan", "-m", "llama-7b", "-n", "8", "--top", "2"],
                                  ["diagnose", "-m", "llama-3-70b", "-n", "8"],
                                  ["models"], ["gpus"]])
def test_outputs_carry_the_version_and_follow_the_schema(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["schema_version"], out["command"]) == (SCHEMA_VERSION, argv[0])
    assert list(out)[:2] == ["schema_version", "command"]
    VALIDATOR.validate(out)


def test_the_schema_refuses_a_missing_field_and_a_wrong_type(
        capsys: pytest.CaptureFixture[str]) -> None:
    """An estimate without ``peak_bytes``, or with it fractional, or a stage's phase peaks
    without the backward, is not valid: the schema pins what readers rely on."""
    assert main(["estimate", "-m", "llama-7b", "-n", "8", "--json"]) == 0
    good = json.loads(capsys.readouterr().out)
    missing = {k: v for k, v in good.items() if k != "peak_bytes"}
    floated = {**good, "peak_bytes": good["peak_bytes"] + 0.5}  # (1.0 counts as an integer)
    stage = dict(good["stages"][0])
    stage["phases"] = {**stage["phases"], "steady": {"forward_bytes": 1, "optimizer_bytes": 1}}
    no_backward = {**good, "stages": [stage]}
    for bad in (missing, floated, no_backward, {**good, "schema_version": 2},
                {**good, "command": "estimat"}):
        with pytest.raises(jsonschema.ValidationError):
            VALIDATOR.validate(bad)
