"""Paragraphs and boxed tables laid out as text, character for character as rich prints
them, without importing rich.

A command's text report is a list of parts: ``Paragraph`` (text wrapped at the width, in a
style) and ``TextTable`` (a titled table in rich's default box, ``box.HEAVY_HEAD``).
``to_rich`` makes the rich renderable of the parts (``--html``'s text, and whatever
``render`` declines); ``render`` writes them as a default ``rich.console.Console()`` prints
them, to output that is no terminal (a pipe, a file, a captured stdout) or to a terminal with
its styles (``console_layout`` says which, and when rich would do more than this follows).
Importing rich's console and table and building the renderables cost a cold
``memplan estimate`` about an eighth of its instructions. The layout is a port of the rich
14/15 code paths these parts take (rich/table.py ``Table._calculate_column_widths``,
``_collapse_widths``, ``_measure_column``, ``_render``; rich/padding.py; rich/text.py
``Text.wrap``; rich/containers.py ``Lines.justify``; rich/_wrap.py ``divide_line``;
rich/_ratio.py ``ratio_reduce``; rich/segment.py ``Segment.split_and_crop_lines``), checked
against rich's own output in tests/unit/test_report_text.py.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from itertools import pairwise
from typing import IO, Any, Literal

Justify = Literal["left", "right", "center", "default"]
Overflow = Literal["fold", "ellipsis"]


# plain classes: a dataclass compiles its methods when the module loads, a cost every cold
# command would pay


class Paragraph:
    """Text wrapped at the width; ``style`` (a rich style) only where rich draws it."""

    __slots__ = ("style", "text")

    def __init__(self, text: str, style: str = "") -> None:
        self.text, self.style = text, style


class Column:
    """A table column as ``rich.table.Table.add_column`` takes it (rich's defaults)."""

    __slots__ = ("header", "justify", "no_wrap", "overflow")

    def __init__(self, header: str, justify: Justify = "left", overflow: Overflow = "ellipsis",
                 no_wrap: bool = False) -> None:
        self.header, self.justify, self.overflow, self.no_wrap = (header, justify, overflow,
                                                                 no_wrap)


class TextTable:
    """A titled table of string cells in rich's default table style, or with ``simple`` as
    ``rich.table.Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True,
    pad_edge=False)`` draws it (``plan``'s: a rule under the header, one space between
    columns, none outside the first and last)."""

    __slots__ = ("columns", "rows", "simple", "title")

    def __init__(self, title: str, simple: bool = False) -> None:
        self.title, self.simple = title, simple
        self.columns: list[Column] = []
        self.rows: list[tuple[str, ...]] = []

    def add_column(self, header: str, *, justify: Justify = "left",
                   overflow: Overflow = "ellipsis", no_wrap: bool = False) -> None:
        self.columns.append(Column(header, justify, overflow, no_wrap))

    def add_row(self, *cells: str) -> None:
        self.rows.append(tuple(cells) + ("",) * (len(self.columns) - len(cells)))


Part = Paragraph | TextTable


def to_rich(parts: list[Part]) -> Any:
    """The parts as one rich renderable (a ``rich.console.Group``)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = []
    for part in parts:
        if isinstance(part, Paragraph):
            out.append(Text(part.text, style=part.style))
            continue
        table = (Table(title=part.title) if not part.simple else
                 _simple_table(part.title))
        for c in part.columns:
            table.add_column(c.header, justify=c.justify, overflow=c.overflow,
                             no_wrap=c.no_wrap)
        for row in part.rows:
            table.add_row(*row)
        out.append(table)
    return Group(*out)


def _simple_table(title: str) -> Any:
    from rich import box
    from rich.table import Table

    return Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False,
                 title=title)


# --- how rich's default console prints (rich/console.py Console.__init__, is_terminal,
# is_dumb_terminal, size, _detect_color_system, no_color, _render_buffer) ---

PLAIN, STYLED, NO_COLOR = "plain", "styled", "no-color"


def console_layout(file: IO[str] | None = None,
                   environ: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """How a default ``rich.console.Console()`` writing to ``file`` (stdout) prints: its
    width and ``PLAIN`` (no terminal: rich's test is TTY_COMPATIBLE, then FORCE_COLOR, then
    ``isatty``), ``STYLED`` (a terminal: bold, dim, italic and the standard colours, which
    every colour system rich detects writes alike) or ``NO_COLOR`` (a terminal, NO_COLOR set:
    the styles without their colours). None where rich does more than this module follows:
    a non-UTF-8 stream (ASCII boxes), a dumb terminal, Windows, a notebook, IDLE."""
    file = sys.stdout if file is None else file
    env = os.environ if environ is None else environ
    if sys.platform == "win32" or file is None:
        return None
    import builtins

    if hasattr(builtins, "get_ipython") or str(
            getattr(sys.stdin, "__module__", "")).startswith("idlelib"):
        return None
    tty_compatible = env.get("TTY_COMPATIBLE", "")
    force_color = env.get("FORCE_COLOR")
    if tty_compatible in ("0", "1"):
        terminal = tty_compatible == "1"
    elif force_color is not None:
        terminal = force_color != ""
    else:
        isatty = getattr(file, "isatty", None)
        try:
            terminal = bool(isatty is not None and isatty())
        except ValueError:
            terminal = False
    encoding = (getattr(file, "encoding", "utf-8") or "utf-8").lower()
    if not encoding.startswith("utf"):
        return None
    if terminal and env.get("TERM", "").lower() in ("dumb", "unknown"):
        return None
    columns = env.get("COLUMNS")
    if columns is not None and columns.isdigit():
        width = int(columns)
    else:
        width = 0
        for fd in (0, 1, 2):  # rich asks stdin, stdout, stderr in turn
            try:
                width = os.get_terminal_size(fd).columns
            except (AttributeError, ValueError, OSError):
                continue
            break
        width = width or 80
    if not terminal:
        return width, PLAIN
    return width, NO_COLOR if env.get("NO_COLOR", "") != "" else STYLED


# the styles the parts use, as rich writes them (rich/style.py Style._make_ansi_codes:
# attributes, then the colour; "table.title" and "table.header" from rich/default_styles.py)
_CODES = {"bold green": ("1", "32"), "bold red": ("1", "31"), "dim": ("2", ""),
          "italic": ("3", ""), "bold": ("1", ""), "": ("", "")}


# --- cells: one per character for printable ASCII and the box, rich's measure otherwise ---

# the box's lines and the ellipsis: one cell each (rich/cells.py cell_len)
_DRAWN_AS_SPACE = str.maketrans("┏━┳┓┃┡╇┩│└─┴┘\u2026", " " * 14)


def _simple(text: str) -> bool:
    """Every character one cell wide (printable ASCII, or drawn here): ``len`` is the width."""
    if not text.isascii():
        text = text.translate(_DRAWN_AS_SPACE)
    return text.isascii() and text.isprintable()


def _cell_len(text: str) -> int:
    if _simple(text):
        return len(text)
    from rich.cells import cell_len

    return cell_len(text)


def _set_cell_size(text: str, total: int) -> str:
    if _simple(text):
        return text + " " * (total - len(text)) if len(text) < total else text[:total]
    from rich.cells import set_cell_size

    return set_cell_size(text, total)


def _chop_cells(text: str, width: int) -> list[str]:
    if _simple(text):
        return [text[i:i + width] for i in range(0, len(text), width)]
    from rich.cells import chop_cells

    return chop_cells(text, width)


# --- text: rich/_wrap.py divide_line, rich/text.py Text.wrap, rich/containers.py Lines ---

_WORD = re.compile(r"\s*\S+\s*")
_TRAILING_SPACE = re.compile(r"\s+$")


def _divide_line(text: str, width: int, fold: bool) -> list[int]:
    breaks: list[int] = []
    offset = 0
    for match in _WORD.finditer(text):
        start, word = match.start(), match.group(0)
        word_length = _cell_len(word.rstrip())
        if width - offset >= word_length:
            offset += _cell_len(word)
        elif word_length > width:
            if fold:
                pieces = _chop_cells(word, width)
                for i, piece in enumerate(pieces):
                    if start:
                        breaks.append(start)
                    if i == len(pieces) - 1:
                        offset = _cell_len(piece)
                    else:
                        start += len(piece)
            else:
                if start:
                    breaks.append(start)
                offset = _cell_len(word)
        elif offset and start:
            breaks.append(start)
            offset = _cell_len(word)
    return breaks


def _truncate(line: str, width: int, overflow: Overflow, pad: bool = False) -> str:
    length = _cell_len(line)
    if length > width:
        line = (_set_cell_size(line, width - 1) + "\u2026" if overflow == "ellipsis"
                else _set_cell_size(line, width))
    if pad and length < width:
        line += " " * (width - length)
    return line


def _wrap(text: str, width: int, justify: Justify, overflow: Overflow,
          no_wrap: bool = False) -> list[str]:
    """``Text(text).wrap(console, width, justify=, overflow=, no_wrap=)``'s lines."""
    lines: list[str] = []
    for line in text.split("\n"):
        if no_wrap:
            pieces = [line]
        else:
            offsets = [0, *_divide_line(line, width, overflow == "fold"), len(line)]
            pieces = [line[a:b] for a, b in pairwise(offsets)]
            for i, piece in enumerate(pieces):  # Text.rstrip_end
                if len(piece) > width:
                    found = _TRAILING_SPACE.search(piece)
                    if found is not None:
                        cut = min(len(found.group(0)), len(piece) - width)
                        pieces[i] = piece[:len(piece) - cut]
        for i, piece in enumerate(pieces):  # Lines.justify
            if justify == "left":
                piece = _truncate(piece, width, overflow, pad=True)
            elif justify == "center":
                piece = _truncate(piece.rstrip(), width, overflow)
                piece = " " * ((width - _cell_len(piece)) // 2) + piece
                piece += " " * (width - _cell_len(piece))
            elif justify == "right":
                piece = _truncate(piece.rstrip(), width, overflow)
                piece = " " * (width - _cell_len(piece)) + piece
            pieces[i] = _truncate(piece, width, overflow)
        lines.extend(pieces)
    return lines


def _fit(line: str, width: int, pad: bool = True) -> str:
    """``Segment.adjust_line_length`` of one line: cropped to ``width``, or padded."""
    length = _cell_len(line)
    if length < width:
        return line + " " * (width - length) if pad else line
    return _set_cell_size(line, width) if length > width else line


# --- tables: rich/table.py with padding (0, 1), box.HEAVY_HEAD, show_edge, header; or
# box.SIMPLE_HEAD with collapse_padding and no pad_edge (``TextTable.simple``) ---


def _pads(table: TextTable, index: int) -> tuple[int, int]:
    """Column ``index``'s cells' (left, right) padding (``Table._get_cells``' get_padding):
    (1, 1); ``simple``: collapsed to the right one alone, none at the table's edges."""
    if not table.simple:
        return 1, 1
    return (0, 0) if index == len(table.columns) - 1 else (0, 1)


def _measure(text: str, max_width: int, pad: int = 2) -> tuple[int, int]:
    """``Measurement.get`` of a cell (a ``Padding`` of ``pad`` cells in all around ``text``)."""
    if max_width < 1:
        return 0, 0
    if max_width - pad < 1:
        lo = hi = max_width
    else:
        lines = text.splitlines()
        hi = max(map(_cell_len, lines)) if lines else 0
        words = text.split()
        lo = max(map(_cell_len, words)) if words else hi
        lo, hi = _normalize(lo, hi, max_width)  # the text's own measure
        lo, hi = min(lo + pad, max_width), min(hi + pad, max_width)
    return _normalize(lo, hi, max_width)


def _normalize(lo: int, hi: int, max_width: int) -> tuple[int, int]:
    """``Measurement.normalize().with_maximum(max_width)``, nothing below one cell, and
    ``normalize()`` again (rich/measure.py ``Measurement.get``)."""
    lo = max(0, min(max(0, lo), hi))
    hi = max(0, max(lo, hi))
    lo, hi = min(lo, max_width), min(hi, max_width)
    if hi < 1:
        return 0, 0
    lo = max(0, min(max(0, lo), hi))
    return lo, max(0, max(lo, hi))


def _column_max(table: TextTable, index: int, max_width: int) -> int:
    """``Table._measure_column(...).maximum``."""
    if max_width < 1:
        return 0
    cells = [table.columns[index].header, *(row[index] for row in table.rows)]
    pad = sum(_pads(table, index))
    return min(max(_measure(cell, max_width, pad)[1] for cell in cells), max_width)


def _ratio_reduce(total: int, ratios: list[int], maximums: list[int],
                  values: list[int]) -> list[int]:
    ratios = [r if m else 0 for r, m in zip(ratios, maximums)]
    total_ratio = sum(ratios)
    if not total_ratio:
        return values[:]
    remaining, out = total, []
    for ratio, maximum, value in zip(ratios, maximums, values):
        if ratio and total_ratio > 0:
            distributed = min(maximum, round(ratio * remaining / total_ratio))
            out.append(value - distributed)
            remaining -= distributed
            total_ratio -= ratio
        else:
            out.append(value)
    return out


def _collapse(widths: list[int], wrapable: list[bool], max_width: int) -> list[int]:
    total = sum(widths)
    excess = total - max_width
    if any(wrapable):
        while total and excess > 0:
            top = max(w for w, ok in zip(widths, wrapable) if ok)
            second = max(w if ok and w != top else 0 for w, ok in zip(widths, wrapable))
            ratios = [1 if (w == top and ok) else 0 for w, ok in zip(widths, wrapable)]
            if not any(ratios) or not top - second:
                break
            widths = _ratio_reduce(excess, ratios, [min(excess, top - second)] * len(widths),
                                   widths)
            total = sum(widths)
            excess = total - max_width
    return widths


def _column_widths(table: TextTable, max_width: int) -> list[int]:
    n = len(table.columns)
    widths = [_column_max(table, i, max_width) or 1 for i in range(n)]
    if sum(widths) > max_width:
        widths = _collapse(widths, [not c.no_wrap for c in table.columns], max_width)
        if sum(widths) > max_width:
            widths = _ratio_reduce(sum(widths) - max_width, [1] * n, widths, widths)
        widths = [_column_max(table, i, w) for i, w in enumerate(widths)]
    return widths


Segments = list[tuple[str, str]]  # a line: (text, style) pieces, as rich writes them


def _cell_lines(text: str, width: int, column: Column, pad: int = 2) -> list[str]:
    """A cell's lines of text, ``width - pad`` wide (none in a column too narrow to hold a
    character: rich's ``Console.render`` draws nothing)."""
    inner = width - pad
    if inner < 1:
        return []
    return [_fit(line, inner) for line in
            _wrap(text, inner, column.justify, column.overflow, column.no_wrap)]


# the box's top, header row's sides, rule under the header, bottom and a row's sides:
# box.HEAVY_HEAD, or box.SIMPLE_HEAD (rich/box.py) for a ``simple`` table
_BOXES = {False: ("┏━┳┓", "┃┃┃", "┡━╇┩", "└─┴┘", "│││"),
          True: ("    ", "   ", " ── ", "    ", "   ")}


def _table_lines(table: TextTable, max_width: int) -> list[Segments]:
    """The table's lines: the title in rich's "table.title" style, the header's cells in
    "table.header" (each cell's padding, text and blank lines their own pieces: rich's
    ``Padding`` and ``Segment.align_bottom``), the rows and the box unstyled."""
    extra = 2 + len(table.columns) - 1
    widths = _column_widths(table, max_width - extra)
    table_width = sum(widths) + extra

    def rule(chars: str) -> Segments:
        return [(chars[0] + chars[2].join(chars[1] * w for w in widths) + chars[3], "")]

    out = [] if not table.title else [
        [(line, "italic")] for line in _wrap(table.title, table_width, "center", "fold")]
    top, head, head_row, bottom, row_edge = _BOXES[table.simple]
    pads = [_pads(table, i) for i in range(len(table.columns))]
    out.append(rule(top))
    for index, row in enumerate([tuple(c.header for c in table.columns), *table.rows]):
        texts = [_cell_lines(text, w, c, sum(p))
                 for text, w, c, p in zip(row, widths, table.columns, pads)]
        height = max(map(len, texts))
        style = "bold" if index == 0 else ""
        cells: list[list[Segments]] = []
        for lines, w, (left, right) in zip(texts, widths, pads):
            cell = [[*([(" " * left, style)] if left else []), (line, style),
                     *([(" " * right, style)] if right else [])] for line in lines]
            blank = [[(" " * w, style)]] * (height - len(cell))
            # the header sits at the bottom, rows at the top; a row of nothing: one blank line
            cells.append((blank + cell if index == 0 else cell + blank) or [[(" " * w, "")]])
        edge = head if index == 0 else row_edge
        for line_no in range(max(1, height)):
            line: Segments = [(edge[0], "")]
            for i, cell in enumerate(cells):
                line += [*cell[line_no], *([(edge[1], "")] if i < len(cells) - 1 else [])]
            out.append([*line, (edge[2], "")])
        if index == 0:
            out.append(rule(head_row))
    out.append(rule(bottom))
    return out


# rich reads table strings as markup and emoji codes: a "[" that can open a tag (a letter,
# "#", "/" or "@" after it: rich/markup.py RE_TAGS), one escaped by a backslash (rich drops
# the backslash) or a ":name:" is left to rich; another "[" (a pipeline split,
# "[0,1x126,0]") is text to rich too
_MARKUP = re.compile(r"\[[a-z#/@]|\\\[|:\S*?:")


def print_parts(parts: list[Part]) -> None:
    """``parts`` on stdout as a default ``rich.console.Console().print`` writes them: laid out
    here (``console_layout``, ``render``; rich not loaded), else through rich."""
    layout = console_layout()
    text = None if layout is None else render(parts, layout[0], layout[1])
    if text is None:
        from rich.console import Console

        Console().print(to_rich(parts))
        return
    sys.stdout.write(text)  # (click's echo drops the styles off a terminal)
    sys.stdout.flush()


def render(parts: list[Part], width: int, mode: str = PLAIN) -> str | None:
    """What ``rich.console.Console(width=width).print(to_rich(parts))`` writes to output
    that is no terminal (``mode`` ``PLAIN``) or to a terminal (``STYLED``, ``NO_COLOR``:
    ``console_layout``), or None for content this port does not lay out as rich does (then
    print through rich)."""
    if width < 1:
        return None
    lines: list[Segments] = []
    for part in parts:
        if isinstance(part, Paragraph):
            if "\t" in part.text or part.style not in _CODES:
                return None
            lines.extend([(line, part.style)]
                         for line in _wrap(part.text, width, "default", "fold"))
            continue
        strings = [part.title, *(c.header for c in part.columns),
                   *(cell for row in part.rows for cell in row)]
        if any("\t" in s or _MARKUP.search(s) for s in strings):
            return None
        lines.extend(_table_lines(part, width))
    if mode == PLAIN:  # print's crop to the width
        return "".join(_fit("".join(text for text, _ in line), width, pad=False) + "\n"
                       for line in lines)
    out = []
    for line in lines:
        if sum(_cell_len(text) for text, _ in line) > width:  # Segment.adjust_line_length
            cropped: Segments = []
            length = 0
            for text, style in line:
                size = _cell_len(text)
                if length + size >= width:
                    cropped.append((_set_cell_size(text, width - length), style))
                    break
                cropped.append((text, style))
                length += size
            line = cropped
        for text, style in line:
            attrs, colour = _CODES[style]
            code = ";".join(filter(None, (attrs, colour))) if mode == STYLED else attrs
            out.append(f"\x1b[{code}m{text}\x1b[0m" if code and text else text)
        out.append("\n")
    return "".join(out)
