"""The records of traces (tests/traced/recorded.py): a record is used exactly when nothing that
made it has changed. Each test writes a small module into a temporary tree standing for the
repository, records a call of it, edits the source, and checks whether the call runs again."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import recorded  # tests/traced/recorded.py

TABLES = '''
OFFSETS = {"a": 1}
WIDTH = 2
'''

# a module that imports the same table and whose code never runs
OTHER = '''
from recorded_tables import OFFSETS

LIMIT = 1
'''

SOURCE = '''
from recorded_tables import OFFSETS, WIDTH

SCALE = 3
CALLS = []


def helper(x):
    return x * SCALE


def untouched(x):
    return x - 1


def traced(x):
    CALLS.append(x)

    def inner(y):
        return y + 1

    return Box(inner(helper(x)) + OFFSETS["a"] * WIDTH - 2)


class Box:
    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return self.value == other.value
'''


class Tree:
    """A temporary repository: its ``src`` folder is a source tree the records follow."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        (root / "src").mkdir()
        # each load compiles the source as it is now: no bytecode cache, whose check (mtime in
        # seconds and size) misses a same-size edit within a second
        monkeypatch.setattr(sys, "dont_write_bytecode", True)
        monkeypatch.setattr(recorded, "ROOT", root)
        monkeypatch.setattr(recorded, "RECORDS", root / "records")
        monkeypatch.setattr(recorded, "_SOURCES", (str(root / "src") + "/",))
        monkeypatch.setattr(recorded, "environment", lambda libraries=(): {"fixed": 1,
                                                                         "versions": {}})
        self.write(SOURCE)
        self.write(TABLES, "tables.py")
        self.write(OTHER, "other.py")

    def write(self, text: str, name: str = "mod.py") -> None:
        (self.root / "src" / name).write_text(textwrap.dedent(text))

    def load(self) -> Any:
        """The module as its source is now (a fresh module object each time)."""
        for name, file in (("recorded_tables", "tables.py"), ("recorded_other", "other.py")):
            found = importlib.util.spec_from_file_location(name, self.root / "src" / file)
            sys.modules[name] = importlib.util.module_from_spec(found)
            found.loader.exec_module(sys.modules[name])
        name = "recorded_probe"  # one name: a value's class pickles alike from each load
        spec = importlib.util.spec_from_file_location(name, self.root / "src" / "mod.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # pickle finds the value's class here
        spec.loader.exec_module(module)
        return module

    def call(self, mode: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
        """(the value, how many times the function ran) of one recorded call of
        ``traced(2)``, under ``mode``."""
        monkeypatch.setenv("MEMPLAN_TRACES", mode)
        module = self.load()
        value = recorded.recorded(module.traced, 2)
        return value.value, len(module.CALLS)

    def records(self) -> list[Path]:
        return sorted((self.root / "records").rglob("*.pkl.gz"))


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tree:
    return Tree(tmp_path, monkeypatch)


def test_a_record_is_used_until_code_that_ran_changes(tree: Tree, monkeypatch) -> None:
    # 2 x 3 + 1 = 7, run and recorded
    assert tree.call("record", monkeypatch) == (7, 1)
    assert len(tree.records()) == 1
    # the record: the function does not run
    assert tree.call("use", monkeypatch) == (7, 0)
    # lines moved and a function that never ran edited: still the record
    tree.write("\n\n" + SOURCE.replace("return x - 1", "return x - 2"))
    assert tree.call("use", monkeypatch) == (7, 0)
    # a function that ran: it runs again (2 x 3 + 2 = 8), nothing written in "use"
    tree.write(SOURCE.replace("return y + 1", "return y + 2"))
    assert tree.call("use", monkeypatch) == (8, 1)
    assert tree.call("record", monkeypatch) == (8, 1)
    assert tree.call("use", monkeypatch) == (8, 0)
    assert len(tree.records()) == 1  # replaced, not added to


@pytest.mark.parametrize("edit", [
    ("SCALE = 3", "SCALE = 4"),  # the module's top level
    ("return x * SCALE", "return SCALE * x"),  # a function called by the one recorded
    ("return self.value == other.value", "return self.value is other.value"),  # a class held
])
def test_each_thing_that_made_the_value_counts(tree: Tree, monkeypatch, edit) -> None:
    tree.call("record", monkeypatch)
    tree.write(SOURCE.replace(*edit))
    assert tree.call("use", monkeypatch)[1] == 1


@pytest.mark.parametrize("edit,value", [
    (("{\"a\": 1}", "{\"a\": 2}"), 9),  # 2 x 3 + 1 + 2 x 2 - 2
    (("WIDTH = 2", "WIDTH = 3"), 8)])  # 2 x 3 + 1 + 1 x 3 - 2
def test_values_read_from_another_module_count(tree: Tree, monkeypatch, edit, value) -> None:
    """A table and a constant imported from another module, none of whose code runs: its top
    level counts as a whole."""
    assert tree.call("record", monkeypatch) == (7, 1)
    # another importer of the table is not where it is defined: its edits keep the record
    tree.write(OTHER.replace("LIMIT = 1", "LIMIT = 2"), "other.py")
    assert tree.call("use", monkeypatch)[1] == 0
    tree.write(TABLES.replace(*edit), "tables.py")
    assert tree.call("use", monkeypatch) == (value, 1)


def test_fresh_ignores_and_verify_checks_the_records(tree: Tree, monkeypatch) -> None:
    tree.call("record", monkeypatch)
    assert tree.call("fresh", monkeypatch) == (7, 1)
    assert tree.call("verify", monkeypatch) == (7, 1)
    # a record that no longer holds what the same code makes: verify says so
    path = tree.records()[0]
    tree.write(SOURCE)
    module = tree.load()
    monkeypatch.setenv("MEMPLAN_TRACES", "record")
    head = recorded._load(path, f"recorded_probe.traced{recorded.canonical(((2,), {}))}")
    assert head is not None and head["value"].value == 7
    recorded._write(path, head["call"], module.Box(70), head["code"], head["environment"])
    monkeypatch.setenv("MEMPLAN_TRACES", "verify")
    with pytest.raises(recorded.RecordMismatch):
        recorded.recorded(module.traced, 2)


def test_a_record_of_another_environment_is_not_used(tree: Tree, monkeypatch) -> None:
    tree.call("record", monkeypatch)
    monkeypatch.setattr(recorded, "environment", lambda libraries=(): {"fixed": 2,
                                                                         "versions": {}})
    assert tree.call("use", monkeypatch)[1] == 1


def test_an_unreadable_record_is_no_record(tree: Tree, monkeypatch) -> None:
    tree.call("record", monkeypatch)
    tree.records()[0].write_bytes(b"not a record")
    assert tree.call("use", monkeypatch) == (7, 1)


def test_values_are_the_same_by_equality_or_bytes() -> None:
    shared = [1]
    # equal values whose pickles differ (one list held twice against two equal lists)
    assert recorded._same((shared, shared), ([1], [1]))
    assert not recorded._same(([1], [1]), ([1], [2]))


def test_a_bad_mode_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("MEMPLAN_TRACES", "sometimes")
    with pytest.raises(ValueError, match="MEMPLAN_TRACES='sometimes'"):
        recorded.mode()


def test_canonical_text_is_the_same_in_any_order() -> None:
    c = recorded.canonical
    assert c({"b": 1, "a": {2, 1}}) == c({"a": {1, 2}, "b": 1}) == \
        "{'a': set({1, 2}), 'b': 1}"
    assert c((1, [2])) != c([1, [2]])

    def make(k: int):
        return lambda: k

    # a closure counts with what it holds
    assert c(make(1)) != c(make(2))
    assert c(make(1)) == c(make(1))
    with pytest.raises(TypeError, match="no canonical text"):
        c(object())


def test_digests_ignore_lines_and_follow_nested_code() -> None:
    def index(text: str) -> dict[str, frozenset[str]]:
        return recorded._index_of("x.py", textwrap.dedent(text).encode())

    base = index("def f():\n    def g():\n        return 1\n    return g\n\nK = 1\n")
    moved = index("\n\n\ndef f():\n    def g():\n        return 1\n    return g\n\nK = 1\n")
    nested = index("def f():\n    def g():\n        return 2\n    return g\n\nK = 1\n")
    assert base == moved
    # the nested function's edit changes its own and its parent's digest, not the module's
    assert nested["f"] != base["f"] and nested["f.<locals>.g"] != base["f.<locals>.g"]
    assert nested["<module>"] == base["<module>"]
    assert index("def f():\n    def g():\n        return 1\n    return g\n\nK = 2\n")[
        "<module>"] != base["<module>"]


def test_a_record_names_the_libraries_whose_code_ran() -> None:
    import json

    torch = pytest.importorskip("torch")
    assert recorded._libraries([torch.__file__, json.__file__]) == {"torch"}
    env = recorded.environment(["torch"])
    assert env["versions"] == {"torch": torch.__version__}
    assert env["threads"] == torch.get_num_threads()


def test_prune_deletes_the_records_no_call_looked_up(tree: Tree, monkeypatch,
                                                      tmp_path: Path) -> None:
    used = tmp_path / "used.txt"
    monkeypatch.setenv("MEMPLAN_TRACES_USED", str(used))
    tree.call("record", monkeypatch)
    stale = tree.root / "records" / "gone" / "0.pkl.gz"
    stale.parent.mkdir()
    stale.write_bytes(b"")
    assert recorded.prune(used) == [stale]
    assert tree.records() and not stale.exists()
