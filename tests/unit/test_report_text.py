"""``memplan.report.text`` lays text out as rich does: every case here is compared, byte for
byte, with what rich's own ``Console`` prints for the same parts (``to_rich``), not with a
recorded copy. ``memplan estimate`` prints through it when its output is no terminal, so the
command's text is rich's without importing rich.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import memplan
from memplan.report.estimate import estimate_text, render_estimate
from memplan.report.text import (
    NO_COLOR,
    PLAIN,
    STYLED,
    Paragraph,
    TextTable,
    console_layout,
    render,
    to_rich,
)

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "calibration" / "profiles" / "cpu-example.json"
WIDTHS = (240, 160, 120, 100, 80, 60, 40, 24, 12)

# configurations whose reports differ in shape: several pipeline stages (the stages table's
# rows, the worst stage marked), virtual stages, experts, LoRA, the paged-optimizer line, host
# memory rows, a calibrated estimate (the phases table's analytic columns), the model-load row,
# a configuration that fits and ones that do not (the why-not paragraph)
ESTIMATES: dict[str, dict[str, Any]] = {
    "llama-7b, 64 GPUs": dict(model="llama-7b", gpus=64),
    "four stages": dict(model="llama-7b", gpus=64, tp=2, pp=4),
    "virtual stages": dict(model="llama-3-70b", gpus=512, tp=8, pp=4, vpp=5, zero=1),
    "experts": dict(model="gpt-oss-20b", gpus=64, ep=8, zero=3),
    "experts, uneven stages": dict(model="deepseek-v3", gpus=2048, pp=16, ep=64, zero=1,
                                   stage_layers="3,4,4,4,4,4,4,4,4,4,4,4,4,4,4,2"),
    "lora": dict(model="llama-3-8b", gpus=8, lora_rank=16, base_quant="nf4"),
    "model load": dict(model="llama-3-8b", gpus=1, lora_rank=16, lora_targets="all-linear",
                       base_quant="nf4-torchao-0.1", seq_len=256),
    "paged optimizer": dict(model="llama-7b", gpus=8, zero=3, optimizer="paged-adamw8bit"),
    "offload": dict(model="llama-7b", gpus=8, zero=3, offload="optimizer,activations"),
    "fits": dict(model="gpt2", gpus=8),
}


def rich_prints(renderable: Any, width: int, env: dict[str, str] | None = None) -> str:
    """What rich's console prints for ``renderable`` to output that is no terminal, or with
    ``env`` to a terminal in that environment (TERM, COLORTERM, NO_COLOR)."""
    out = io.StringIO()
    terminal = dict(force_terminal=True, _environ=env) if env is not None else {}
    Console(file=out, width=width, **terminal).print(renderable)
    return out.getvalue()


# terminals: each colour system rich detects (standard, 256 colours, truecolor), NO_COLOR
TERMINALS = [({"TERM": "xterm"}, STYLED), ({"TERM": "xterm-256color"}, STYLED),
             ({"COLORTERM": "truecolor"}, STYLED), ({"TERM": "xterm", "NO_COLOR": "1"}, NO_COLOR)]


def estimate_of(case: dict[str, Any]) -> memplan.Estimate:
    kwargs = dict(case)
    return memplan.estimate(kwargs.pop("model"), **kwargs)


@pytest.mark.parametrize("name", list(ESTIMATES))
def test_estimate_text_is_what_rich_prints(name: str) -> None:
    est = estimate_of(ESTIMATES[name])
    for width in WIDTHS:
        assert estimate_text(est, width=width) == rich_prints(render_estimate(est), width), width


@pytest.mark.parametrize("name", ["llama-7b, 64 GPUs", "four stages", "experts, uneven stages",
                                  "fits"])
def test_estimate_text_on_a_terminal_is_what_rich_prints(name: str) -> None:
    """On a terminal: the verdict bold green or red, the notes dim, the tables' titles italic
    and headers bold, each piece wrapped in its own escape codes as rich writes them."""
    est = estimate_of(ESTIMATES[name])
    for width in (240, 80, 40, 20):
        for env, mode in TERMINALS:
            assert estimate_text(est, width=width, mode=mode) == rich_prints(
                render_estimate(est), width, env), (width, env)


def test_the_cases_reach_every_part_of_the_report() -> None:
    """The cases above cover several stages, the why-not paragraph and one that fits, the
    paged line and the model-load row (the calibrated columns: the next test)."""
    ests = [estimate_of(case) for case in ESTIMATES.values()]
    assert max(len(e.stages) for e in ests) == 16
    assert {e.fits for e in ests} == {True, False}
    assert any(e.worst.paged_bytes for e in ests)
    assert any(e.worst.load_bytes for e in ests)
    assert any(e.worst.host_bytes for e in ests)
    assert any(e.parallel.ep > 1 for e in ests)


def test_calibrated_estimate_text_is_what_rich_prints() -> None:
    """A calibration adds the phases table's two analytic columns and its correction row."""
    est = memplan.estimate("llama-7b", gpus=64, calibration=str(PROFILE))
    assert est.worst.analytic_phases is not None
    for width in WIDTHS:
        assert estimate_text(est, width=width) == rich_prints(render_estimate(est), width)


def table(title: str, headers: list[str], rows: list[tuple[str, ...]],
          **column: Any) -> TextTable:
    out = TextTable(title)
    for header in headers:
        out.add_column(header, **column)
    for row in rows:
        out.add_row(*row)
    return out


WORDS = ("a", "peak", "12,345,678,901", "optimizer states", "x" * 37,
         "reserved by PyTorch's caching allocator, stage 3", "")


@pytest.mark.parametrize("column", [dict(), dict(justify="right"), dict(overflow="fold"),
                                    dict(no_wrap=True), dict(justify="right", no_wrap=True),
                                    dict(justify="center"), dict(justify="right",
                                                                 overflow="fold")])
def test_tables_wrap_fold_and_cut_as_rich_does(column: dict[str, Any]) -> None:
    """Columns wider than the console are shrunk (rich's collapse, then an even cut), their
    text wrapped at words, folded or cut with an ellipsis; a header wraps from the bottom up,
    a short cell is padded below; a title longer than its table wraps, centred."""
    parts = [
        table("A title longer than the table it sits on, wrapped and centred",
              ["one", "a longer header", "n"],
              [(WORDS[i % 7], WORDS[(i + 3) % 7], WORDS[(i + 5) % 7]) for i in range(7)],
              **column),
        table("", [f"column {i}" for i in range(12)], [tuple(WORDS[:6]) * 2], **column),
        table("one column", ["only"], [("x" * 300,), ("",)], **column),
    ]
    for width in (300, 240, 120, 80, 61, 40, 33, 20, 9, 5, 1):
        assert render(parts, width) == rich_prints(to_rich(parts), width), width
        for env, mode in TERMINALS:
            assert render(parts, width, mode) == rich_prints(to_rich(parts), width, env), width


def test_paragraphs_wrap_as_rich_does() -> None:
    """Words move whole to the next line, a word wider than the line is folded, a space at
    the line's end is kept unless past the width, blank lines, lines of spaces and indents
    stay."""
    text = ("assumptions:\n  - " + "word " * 30 + "\n\n  - " + "y" * 95 + " tail\n"
            + "exact " * 16 + "\n   leading spaces and trailing   \n      \n  two  spaces  apart")
    parts = [Paragraph(text), Paragraph(""), Paragraph("FITS", "bold green"),
             Paragraph(text, "dim"), Paragraph("DOES NOT FIT\n\nover", "bold red")]
    for width in range(1, 130):
        assert render(parts, width) == rich_prints(to_rich(parts), width), width
        for env, mode in TERMINALS:
            assert render(parts, width, mode) == rich_prints(to_rich(parts), width, env), width


def test_wide_characters_are_measured_as_rich_measures_them() -> None:
    """Characters two cells wide (CJK) and the ellipsis: rich's own cell widths."""
    parts = [Paragraph("模型 " * 40 + "ok"),
             table("表", ["名前", "peak"], [("数据" * 9, "1.00"), ("é" * 30, "…")])]
    for width in (200, 80, 41, 20, 7):
        assert render(parts, width) == rich_prints(to_rich(parts), width), width
        for env, mode in TERMINALS:
            assert render(parts, width, mode) == rich_prints(to_rich(parts), width, env), width


@pytest.mark.parametrize("cell", ["[bold]x[/bold]", "a :smile: b", "tab\there", "[#f00]x",
                                  "[/]", "[@click]x", "\\[0,1]"])
def test_markup_emoji_and_tabs_are_left_to_rich(cell: str) -> None:
    """rich reads table strings as markup and emoji codes, and expands tabs: not laid out here
    (None), so the caller prints through rich."""
    assert render([table("t", ["h"], [(cell,)])], 80) is None
    assert render([Paragraph("ok")], 80) == "ok\n"


@pytest.mark.parametrize("cell", ["tp8+sp pp16 v8 [0,1x126,0] dp16 z1", "[1]", "[", "a]b[",
                                  "[ 3 ]", "x\\y[0]"])
def test_brackets_that_open_no_tag_are_text(cell: str) -> None:
    """A "[" that cannot open a markup tag (plan's pipeline splits) is text to rich: laid out
    here, as rich prints it."""
    parts = [table("t", ["h", "n"], [(cell, "1"), ("x", cell)])]
    for width in (80, 20, 7):
        assert render(parts, width) is not None
        assert render(parts, width) == rich_prints(to_rich(parts), width), width


class Stream(io.StringIO):
    def __init__(self, tty: bool = False, encoding: str | None = "utf-8") -> None:
        super().__init__()
        self._tty, self._encoding = tty, encoding

    def isatty(self) -> bool:
        return self._tty

    @property
    def encoding(self) -> str | None:  # type: ignore[override]
        return self._encoding


def test_console_layout_follows_richs_terminal_rules() -> None:
    """Plain text at COLUMNS' width for what rich would not treat as a terminal, styled text
    for what it would (NO_COLOR: without colours); None (print with rich) for a non-UTF-8
    stream or a dumb terminal. Each answer is checked against rich's own console."""
    cases = [
        (Stream(), {"COLUMNS": "240"}, (240, PLAIN)),
        (Stream(encoding=None), {"COLUMNS": "80"}, (80, PLAIN)),
        (Stream(tty=True), {"COLUMNS": "240", "TERM": "xterm"}, (240, STYLED)),
        (Stream(tty=True), {"COLUMNS": "100", "NO_COLOR": "1"}, (100, NO_COLOR)),
        (Stream(tty=True), {"COLUMNS": "240", "TTY_COMPATIBLE": "0"}, (240, PLAIN)),
        (Stream(), {"COLUMNS": "90", "TTY_COMPATIBLE": "1"}, (90, STYLED)),
        (Stream(), {"COLUMNS": "90", "FORCE_COLOR": "1"}, (90, STYLED)),
        (Stream(tty=True), {"COLUMNS": "77", "FORCE_COLOR": ""}, (77, PLAIN)),
        (Stream(), {"COLUMNS": "wide"}, None),  # the terminal's width, or 80: see below
        (Stream(encoding="ascii"), {"COLUMNS": "240"}, None),
        (Stream(tty=True), {"COLUMNS": "240", "TERM": "dumb"}, None),
    ]
    for stream, env, layout in cases:
        got = console_layout(stream, env)
        if layout is None and "wide" not in env.values():
            assert got is None, env
            continue
        console = Console(file=stream, _environ=env)
        assert got is not None
        assert got[0] == console.width, env
        assert (got[1] == PLAIN) == (console.color_system is None), env
        assert (got[1] == NO_COLOR) == console.no_color, env


CHILD = r"""
import contextlib, io, json, sys
import memplan.cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = memplan.cli.main(sys.argv[1:])
print(json.dumps({"code": code, "stdout": out.getvalue(),
                  "rich": sorted(m for m in sys.modules if m.startswith("rich"))}))
"""


def _command(command: str, args: list[str], terminal: bool, **env_more: str) -> dict:
    """``CHILD`` running ``memplan command args`` in a fresh interpreter, its stdout no
    terminal (or one by FORCE_COLOR): what it printed, its exit code 0, no rich module
    loaded."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR", "TERM")}
    env.update(PYTHONPATH=str(ROOT), **env_more)
    if terminal:
        env.update(FORCE_COLOR="1", TERM="xterm-256color")
    run = subprocess.run([sys.executable, "-c", CHILD, command, *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    got = json.loads(run.stdout)
    assert got["code"] == 0
    assert got["rich"] == []
    return got


@pytest.mark.parametrize(("args", "terminal"), [
    (["--model", "llama-7b", "--gpus", "64"], False),
    (["-m", "llama-7b", "-n", "64", "--tp", "2", "--pp", "4", "--width", "80"], False),
    (["--model", "llama-7b", "--gpus", "64"], True),
    (["-m", "llama-7b", "-n", "64", "--tp", "2", "--pp", "4", "--width", "100"], True)])
def test_estimate_command_prints_richs_text_without_rich(args: list[str],
                                                         terminal: bool) -> None:
    """The command in a fresh interpreter, its stdout no terminal (or one by FORCE_COLOR):
    the text rich prints at the command's width (240 for a pipe, or --width), and no rich
    module loaded."""
    got = _command("estimate", args, terminal)
    width = int(args[args.index("--width") + 1]) if "--width" in args else 240
    model, gpus = args[1], int(args[3])
    kwargs = dict(tp=2, pp=4) if "--tp" in args else {}
    expected = rich_prints(render_estimate(memplan.estimate(model, gpus=gpus, **kwargs)), width,
                           {"FORCE_COLOR": "1", "TERM": "xterm-256color"} if terminal else None)
    assert got["stdout"] == expected
    assert got["stdout"].startswith("\x1b[1;3") == terminal  # the verdict, red or green


@pytest.mark.parametrize(("args", "terminal"), [
    (["--model", "tiny", "--gpus", "8"], False),
    (["--model", "tiny", "--gpus", "8", "--top", "3", "--width", "60"], True),
    (["--model", "gpt2", "--gpus", "8", "--width", "70"], False)])
def test_plan_command_prints_richs_text_without_rich(args: list[str], terminal: bool) -> None:
    """``memplan plan`` in a fresh interpreter: its table (box.SIMPLE_HEAD, collapsed padding,
    no padded edge; pipeline splits in brackets among its layouts), notes and rejections as
    rich prints them (``render_plan``, the same parts through rich) at the command's width,
    and no rich module loaded."""
    from memplan.report.plan import render_plan

    got = _command("plan", args, terminal, MEMPLAN_JOBS="1")
    width = int(args[args.index("--width") + 1]) if "--width" in args else 240
    top = int(args[args.index("--top") + 1]) if "--top" in args else 10
    spec = memplan.load_model(args[1])
    result = memplan.plan(spec, gpus=int(args[3]), top=top)
    expected = rich_prints(render_plan(result, spec.name, spec.num_layers, int(args[3]),
                                       "h100-sxm", top), width,
                           {"FORCE_COLOR": "1", "TERM": "xterm-256color"} if terminal else None)
    assert got["stdout"] == expected
    if args[1] == "tiny" and top == 10:  # a pipeline split among the layouts
        assert "[0,1x2,0]" in got["stdout"]
