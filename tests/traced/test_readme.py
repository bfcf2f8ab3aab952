"""The README and the pages of docs/ work as written: every command they show runs, from a copy
of the repository's files, and prints what the page shows after it.

A command is a ``$ memplan ...`` line of a text block (its ``# comment`` is not part of it);
the lines after it, up to the next command or the block's end, are what it prints. Each such
line must appear in the command's output, with spaces and table borders collapsed (a line
the README elides with ``...`` up to the ``...``). A shown ``memplan: error:`` line means the
command exits 2 (its one-line error); otherwise it exits 0. A command whose comment says it
runs on CUDA GPUs prints, on a machine without one, the one-line error saying so (exit 2);
those run on a GPU in ``tests/traced/test_calibrate.py::test_cuda_quick_calibration``.

The two set-up commands at the top are checked too: the first one's estimate runs (its
install is what ``.ci/run`` does), and ``.ci/run`` runs the second one verbatim.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# the README and every page of docs/: a command moved from one to another is still run
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MEMPLAN = Path(sys.executable).with_name("memplan")
# the repository files the commands read, copied: commands write into the copy (profile --out,
# calibrate's calibration/ folder), never into the repository
COPIED = ("calibration", "docs", "model_specs", "tests/data")
BORDERS = re.compile(r"[│┃┏┓┗┛┡┩┠┨┣┫╇╈╋━─┳┻┬┴┼└┘┌┐╭╮╰╯═║]+")
CUDA_COMMENT = re.compile(r"\bCUDA GPUs?\b")


class Shown(NamedTuple):
    line: int  # line number of the command in its page
    command: str
    comment: str
    output: list[str]
    page: str = "README.md"


def shown_commands(text: str, page: str = "README.md") -> list[Shown]:
    """Each ``$ memplan`` command of a page's text blocks, with what it shows."""
    out: list[Shown] = []
    in_block = False
    current: Shown | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("```"):
            in_block = raw.strip() == "```text" if not in_block else False
            current = None
            continue
        if not in_block:
            continue
        if raw.startswith("$ "):
            command, _, comment = raw[2:].partition("  #")
            current = Shown(number, command.strip(), comment.strip(), [], page)
            out.append(current)
        elif current is not None and raw.strip():
            current.output.append(raw)
    return out


def _normal(text: str) -> str:
    return " ".join(BORDERS.sub(" ", text).split())


def _missing(shown: list[str], output: str) -> list[str]:
    lines = [_normal(line) for line in output.splitlines()]
    missing = []
    for line in shown:
        want = _normal(line.split("...")[0]) if "..." in line else _normal(line)
        if want and not any(want in got for got in lines):
            missing.append(line)
    return missing


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("readme")
    for name in COPIED:
        shutil.copytree(ROOT / name, work / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return work


COMMANDS = [shown for page in PAGES
            for shown in shown_commands(page.read_text(), str(page.relative_to(ROOT)))]


def test_the_readme_shows_commands() -> None:
    assert {c.page for c in COMMANDS} >= {"README.md", "docs/cli.md", "docs/diagnosis.md",
                                          "docs/profiling.md", "docs/tracing.md",
                                          "docs/calibration.md"}
    names = {shlex.split(c.command)[1] for c in COMMANDS}
    assert {"estimate", "plan", "diagnose", "profile", "trace", "calibrate", "models",
            "gpus"} <= names
    assert all(shlex.split(c.command)[0] == "memplan" for c in COMMANDS)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The commands that run torch (calibrate, trace, profile) run through memplan.cli.main in this
# interpreter, where torch is imported already (cwd the copy, COLUMNS 240); every other command
# runs the ``memplan`` script. docs/calibration.md's ``memplan calibrate --device cpu --quick``
# traces the quick CPU grid, whose ten points tests/traced/test_calibrate.py traces too: each
# point is traced once in the session (tests/traced/calibration_points.py).
IN_PROCESS = {"calibrate", "trace", "profile"}
QUICK_CPU_GRID = ["memplan", "calibrate", "--device", "cpu", "--quick"]
# what a ``memplan trace`` command (it writes nothing) printed and returned, by its arguments:
# one shown on two pages (docs/tracing.md and docs/ground_truth.md) runs once
_TRACED: dict[tuple[str, ...], tuple[int, str]] = {}


def _run(argv: list[str], workdir: Path, monkeypatch: pytest.MonkeyPatch,
         capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit code and the printed output (stdout, then stderr) of ``argv`` run in the
    copy of the repository."""
    key = tuple(argv)
    if key in _TRACED:
        return _TRACED[key]
    if argv[1] in IN_PROCESS:
        from memplan.cli import main

        monkeypatch.chdir(workdir)
        monkeypatch.setenv("COLUMNS", "240")
        monkeypatch.setenv("MEMPLAN_DEBUG", "")
        if argv == QUICK_CPU_GRID:
            from calibration_points import cpu_points_traced_once  # tests/traced

            cpu_points_traced_once(monkeypatch)
        capsys.readouterr()
        code = main(argv[1:])
        printed = capsys.readouterr()
        ran = code, printed.out + printed.err
    else:
        env = {**os.environ, "COLUMNS": "240", "MEMPLAN_DEBUG": ""}
        proc = subprocess.run([str(MEMPLAN), *argv[1:]], cwd=workdir, capture_output=True,
                              text=True, env=env, timeout=600, check=False)
        ran = proc.returncode, proc.stdout + proc.stderr
    if argv[1] == "trace":
        _TRACED[key] = ran
    return ran


@pytest.mark.parametrize("shown", COMMANDS, ids=[f"{c.page}:L{c.line}" for c in COMMANDS])
def test_readme_command_runs_as_shown(shown: Shown, workdir: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    argv = shlex.split(shown.command)
    needs_cuda = bool(CUDA_COMMENT.search(shown.comment))
    if needs_cuda and _cuda():
        pytest.skip("a CUDA command: run on the GPU by test_calibrate.py")
    if "--module" in argv and "calibration/examples/hf_factory.py:build" in argv:
        pytest.importorskip("transformers")
    returncode, output = _run(argv, workdir, monkeypatch, capsys)
    if needs_cuda:
        assert returncode == 2, output
        assert output.count("\n") == 1 and "no CUDA device" in output, output
        return
    errors = [line for line in shown.output if line.startswith("memplan: error:")]
    assert returncode == (2 if errors else 0), output
    missing = _missing(shown.output, output)
    assert not missing, f"{shown.page} line {shown.line}: not in the output: {missing}\n{output}"


def test_setup_commands() -> None:
    """The first set-up command's estimate runs; ``.ci/run`` runs the second verbatim."""
    text = README.read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    first, second = commands
    assert first.startswith("python3 -m venv .venv && .venv/bin/pip install -q -e . && ")
    estimate = first.rsplit(" && ", 1)[1]
    assert estimate.startswith(".venv/bin/memplan estimate ")
    proc = subprocess.run([str(MEMPLAN), *shlex.split(estimate)[1:]], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(("FITS: peak", "DOES NOT FIT: peak")), proc.stdout
    ci = (ROOT / ".ci" / "run").read_text()
    assert second in ci


def test_the_comparison_reads_what_a_line_shows() -> None:
    """The matching rule itself: borders and spacing do not matter, words and numbers do."""
    output = "┃ params │  1,333,829,632 │  1,333,829,632 │   +0 │ +0.000 │\nother"
    assert not _missing(["  params                 1,333,829,632    1,333,829,632     +0"],
                        output)
    assert _missing(["  params  1,333,829,633"], output)
    assert not _missing(["  other ... anything"], output)
    assert _missing(["  params 1,333,829,632 +0.000 ..."], output)


def test_python_api_example_runs(workdir: Path) -> None:
    """The Python API block of docs/cli.md runs as written, from the repository's files."""
    text = (ROOT / "docs" / "cli.md").read_text()
    block = text.split("## Python API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    proc = subprocess.run([sys.executable, "-c", block], cwd=workdir, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import memplan

    count = memplan.load_model(str(ROOT / "tests/data/hf/Meta-Llama-3-8B/config.json"))
    assert "# 8,030,261,248" in block and count.num_params == 8_030_261_248
