"""The shape of ``memplan/model/`` the house rules ask for, read from the source (``ast``):
no function longer than 60 lines, and a walk (``moments.py``, ``walk.py``) that names no
framework and no sharding scheme, so a new mechanism is a new event, not a new branch."""

from __future__ import annotations

import ast
import re
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "memplan" / "model"
MAX_LINES = 60  # docs/contributing.md, the house rules: functions in memplan/model/ at most 60
# frameworks and data-parallel schemes, as words (``zero`` alone, ``zero2``, ``zero-3``)
NAMES = re.compile(r"\b(fsdp\d?|zero[-_ ]?\d?|ddp|megatron|torchtitan|deepspeed|lightning|"
                   r"litgpt|transformers)\b", re.IGNORECASE)


def test_no_function_in_the_model_is_longer_than_60_lines() -> None:
    """Every function and method of ``memplan/model/``, decorators and docstring included."""
    long = []
    for path in sorted(MODEL.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > MAX_LINES:
                    long.append(f"{path.name}:{node.name} ({node.end_lineno - start + 1})")
    assert not long, long


def test_the_walk_names_no_framework_and_no_sharding_scheme() -> None:
    for name in ("moments.py", "walk.py"):
        found = NAMES.findall((MODEL / name).read_text())
        assert not found, (name, found)


def test_the_name_check_finds_what_it_looks_for() -> None:
    """The pattern finds the names it looks for, and not words that only contain them."""
    assert NAMES.findall("FSDP2 units, ZeRO-2's bucket, DDP, Megatron-LM") == [
        "FSDP2", "ZeRO-2", "DDP", "Megatron"]
    assert not NAMES.findall("zeroed gradients, a frozen ddp_like name")
