"""Reading the files a user gives memplan: regular files only, sizes and depths bounded.

Every reader of user input (model files, calibration profiles, OOM logs, monitor records,
profiler traces, profile summaries, snapshots) reads through here, so each refuses in one
line, naming the file: a path that is missing, a folder, or not a regular file (``/dev/zero``,
a FIFO: reading one would never end); a file over its size limit (checked before reading, and
while reading, for a file that grows or a gzip stream that expands); text that is not UTF-8
(with the byte offset); JSON or TOML that does not parse (with the line and column) or nests
deeper than ``MAX_DEPTH``. Each limit is stated in the message that enforces it.

A file cut short by a killed job is read as far as it goes where that is evidence worth having:
``memplan.measure.trace_files`` (profiler traces) and ``memplan.diagnose.monitored`` (monitor
records).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tomllib
import zlib
from pathlib import Path
from typing import Any, NamedTuple

from memplan.errors import MemplanError, shown
from memplan.units import MAX_INT64, GiB, KiB, MiB

# Size limits by kind of file, each far above what the tools that write them produce, so
# only a wrong file (a disk image, a device, a bomb) meets them:
# - a model spec or HF config.json is a few KiB (Llama-3-405B's config.json: under 1 KiB);
MODEL_FILE_BYTES = 1 * MiB
# - a calibration profile is tens of KiB (calibration/profiles/*.json);
PROFILE_BYTES = 16 * MiB
# - an OOM message is a few lines; a whole training log given with --oom may be long;
LOG_BYTES = 256 * MiB
# - a MemoryMonitor file holds ~1.5 KiB per step: a million steps of one rank;
MONITOR_BYTES = 2 * GiB
# - a torch.profiler chrome trace of a few steps is tens to hundreds of MiB (decompressed);
TRACE_BYTES = 2 * GiB
# - a memory snapshot pickle with stack frames is tens to hundreds of MiB;
SNAPSHOT_BYTES = 4 * GiB
# - a `memplan profile` summary.json is a few KiB.
SUMMARY_BYTES = 64 * MiB
# Nesting deeper than this is not a spec, a profile or a trace (theirs are under 10 levels);
# Python's parsers recurse per level and would fail with RecursionError near 1000.
MAX_DEPTH = 64
GZIP_MAGIC = b"\x1f\x8b"
# The UTF-8 byte-order mark (U+FEFF encoded) Notepad and some exporters put before the text.
UTF8_BOM = b"\xef\xbb\xbf"
_CHUNK = 1 * MiB


def size_text(num_bytes: int) -> str:
    """A limit in words for messages: "16 MiB" (binary units, labelled)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if num_bytes >= size and num_bytes % size == 0:
            return f"{num_bytes // size} {unit}"
    return f"{num_bytes} bytes"


def regular_file(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` if it is a regular file (symlinks followed); otherwise one line saying what
    it is. ``what`` names the input in the message (``--oom``, ``model file``)."""
    p = Path(path)
    try:
        info = p.stat()
    except FileNotFoundError:
        raise MemplanError(f"{what}: {p}: no such file") from None
    except OSError as err:
        raise MemplanError(f"{what}: cannot read {p}: {err.strerror or err}") from None
    if stat.S_ISDIR(info.st_mode):
        raise MemplanError(f"{what}: {p} is a folder, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise MemplanError(f"{what}: {p} is not a regular file (a device, pipe or socket "
                           "never ends or cannot be read twice); give a file")
    return p


def _too_big(p: Path, what: str, limit: int, detail: str = "") -> MemplanError:
    return MemplanError(f"{what}: {p} is larger than the {size_text(limit)} limit for {what} "
                        f"files{detail}; is it the right file?")


def _read_all(fh: Any, p: Path, what: str, limit: int) -> bytes:
    """The rest of an open file, at most ``limit`` bytes, never holding more memory than the
    file has bytes: one read of the size the file says it has (``fh.read(limit + 1)`` would
    reserve the whole limit up front, 4 GiB for a snapshot, and fail under a memory cap such
    as ``ulimit -v``), then small reads only for what it gained since (a file still being
    written, or one whose size the OS does not know, as in /proc)."""
    size = os.fstat(fh.fileno()).st_size - fh.tell()
    if size > limit:
        raise _too_big(p, what, limit, f" ({size:,} bytes)")
    data = fh.read(size) if size > 0 else b""
    more = fh.read(1)
    if not more:
        return data
    out = bytearray(data)
    out += more
    while len(out) <= limit:
        chunk = fh.read(min(_CHUNK, limit + 1 - len(out)))
        if not chunk:
            return bytes(out)
        out += chunk
    raise _too_big(p, what, limit, " (it grew while read)")


def read_bytes(path: str | os.PathLike[str], what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes."""
    p = regular_file(path, what)
    try:
        with p.open("rb") as fh:
            return _read_all(fh, p, what, limit)
    except OSError as err:
        raise MemplanError(f"{what}: cannot read {p}: {err.strerror or err}") from None


def decode(data: bytes, p: Path | str, what: str) -> str:
    """``data`` as UTF-8 text, without the byte-order mark some Windows editors put first
    (``UTF8_BOM``), or one line with the byte offset of the first bad byte."""
    skip = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        at = err.start + skip
        raise MemplanError(f"{what}: {p} is not UTF-8 text (byte offset {at}: "
                           f"{data[at:at + 1]!r}); is it the right file?") from None


def read_text(path: str | os.PathLike[str], what: str, limit: int) -> str:
    """A regular file of at most ``limit`` bytes as UTF-8 text."""
    return decode(read_bytes(path, what, limit), path, what)


class Unpacked(NamedTuple):
    """A file's bytes, gunzipped when it is gzip (by its magic bytes, not its name).
    ``cut``: where a gzip stream ended early (a file still being written, or cut by a
    killed job): the compressed byte offset, else None."""

    data: bytes
    compressed: bool
    cut: int | None = None


def read_maybe_gzip(path: str | os.PathLike[str], what: str, limit: int) -> Unpacked:
    """A regular file, decompressed if it is gzip, at most ``limit`` bytes decompressed (so a
    gzip bomb stops at the limit). A damaged stream names its compressed byte offset; a
    stream cut short returns what decompressed before the cut (``Unpacked.cut``)."""
    p = regular_file(path, what)
    try:
        with p.open("rb") as fh:
            if fh.read(2) != GZIP_MAGIC:
                fh.seek(0)
                return Unpacked(_read_all(fh, p, what, limit), compressed=False)
            fh.seek(0)
            return _gunzip(fh, p, what, limit)
    except OSError as err:
        raise MemplanError(f"{what}: cannot read {p}: {err.strerror or err}") from None


def _gunzip(fh: Any, p: Path, what: str, limit: int) -> Unpacked:
    out = bytearray()
    consumed = 0  # compressed bytes decompressed so far
    inflate = zlib.decompressobj(wbits=31)  # gzip framing
    buf = b""
    while True:
        if not buf:
            buf = fh.read(_CHUNK)
            if not buf:  # the file ends: complete only if the last member did
                return Unpacked(bytes(out), compressed=True,
                                cut=None if inflate.eof else consumed)
        if inflate.eof:  # one member done and more bytes follow
            if not buf.startswith(GZIP_MAGIC):
                return Unpacked(bytes(out), compressed=True)  # trailing bytes: ignored
            inflate = zlib.decompressobj(wbits=31)  # another member (gzip -c a b > c)
        try:
            out += inflate.decompress(buf, limit + 1 - len(out))
        except zlib.error as err:
            raise MemplanError(f"{what}: {p} is damaged gzip data between compressed bytes "
                               f"{consumed:,} and {consumed + len(buf):,} ({err})") from None
        if len(out) > limit:
            raise _too_big(p, what, limit, " once decompressed")
        rest = inflate.unused_data if inflate.eof else inflate.unconsumed_tail
        consumed += len(buf) - len(rest)
        buf = rest


def depth(value: Any) -> int:
    """How deeply lists and dicts nest in a parsed document (a scalar is 0), without
    recursion."""
    return _walk(value)[0]


def too_large(value: Any) -> bool:
    """An integer outside the 64-bit range (``MAX_INT64``) that the tools writing these files
    store counts, sizes and times in (bools are not integers here)."""
    return type(value) is int and not -MAX_INT64 <= value <= MAX_INT64


def _walk(value: Any) -> tuple[int, int | None]:
    """(nesting depth, the first integer past ``MAX_INT64`` or None) of a parsed
    document, in one pass without recursion."""
    deepest, huge, stack = 0, None, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else None
        if children is None:
            if huge is None and too_large(item):
                huge = item
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest, huge


def checked(data: Any, p: Path | str, what: str) -> Any:
    """``data`` parsed from ``p``, if it nests at most ``MAX_DEPTH`` deep and holds no integer
    past ``MAX_INT64``; one line naming the file otherwise."""
    deepest, huge = _walk(data)
    if deepest > MAX_DEPTH:
        raise _too_deep(p, what)
    if huge is not None:
        raise too_large_number(p, what, huge)
    return data


def too_long_number(p: Path | str, what: str) -> MemplanError:
    """The line for an integer longer than Python reads (``int()`` refuses more than
    ``sys.get_int_max_str_digits()`` digits, 4300 by default, with a ValueError that is no
    syntax error: the JSON and TOML parsers let it through as it is)."""
    return MemplanError(f"{what}: {p} holds an integer of more than "
                        f"{sys.get_int_max_str_digits() or 4300} digits, more than any count "
                        "or size can be; is it the right file?")


def too_large_number(p: Path | str, what: str, value: int) -> MemplanError:
    """The line for an integer past ``MAX_INT64``."""
    return MemplanError(f"{what}: {p} holds the integer {shown(value)} ({len(str(value))} "
                        "digits), past the 64-bit range of any count, size or time these "
                        "files hold; is it the right file?")


def _too_deep(p: Path | str, what: str) -> MemplanError:
    return MemplanError(f"{what}: {p} nests lists or tables deeper than {MAX_DEPTH} levels "
                        "(memplan's limit); is it the right file?")


def parse_json(text: str, p: Path | str, what: str) -> Any:
    """JSON text as data: one line for a syntax error (line, column, byte offset) or nesting
    deeper than ``MAX_DEPTH``."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise _too_deep(p, what) from None
    except json.JSONDecodeError as err:
        raise MemplanError(f"{what}: {p} is not valid JSON: {err.msg} at line {err.lineno} "
                           f"column {err.colno} (char {err.pos})") from None
    except ValueError:  # not a syntax error: an integer over Python's digit limit
        raise too_long_number(p, what) from None
    return checked(data, p, what)


def parse_toml(text: str, p: Path | str, what: str) -> dict[str, Any]:
    """TOML text as data: one line for a syntax error (its line and column) or nesting deeper
    than ``MAX_DEPTH``."""
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise _too_deep(p, what) from None
    except tomllib.TOMLDecodeError as err:
        raise MemplanError(f"{what}: {p} is not valid TOML: {err}") from None
    except ValueError:  # not a syntax error: an integer over Python's digit limit
        raise too_long_number(p, what) from None
    return checked(data, p, what)


def read_json(path: str | os.PathLike[str], what: str, limit: int) -> Any:
    return parse_json(read_text(path, what, limit), path, what)


def read_toml(path: str | os.PathLike[str], what: str, limit: int) -> dict[str, Any]:
    return parse_toml(read_text(path, what, limit), path, what)


def read_stream(stream: Any, what: str, limit: int) -> str:
    """Text from a stream (stdin), at most ``limit`` bytes; bytes that are not UTF-8 are
    replaced (a pasted log may hold any)."""
    source = getattr(stream, "buffer", stream)
    parts, size = [], 0
    while size <= limit:  # small reads: a read of limit + 1 would reserve all of it up front
        chunk = source.read(min(_CHUNK, limit + 1 - size))
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    data = (b"" if not parts or isinstance(parts[0], bytes) else "").join(parts)
    if size > limit:
        raise MemplanError(f"{what}: standard input is over the {size_text(limit)} limit; "
                           "give the error message only (e.g. grep -A3 OutOfMemoryError)")
    return data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data


__all__ = ["GZIP_MAGIC", "MAX_DEPTH", "UTF8_BOM", "Unpacked", "checked", "decode",
           "depth", "parse_json", "parse_toml", "read_bytes", "read_json", "read_maybe_gzip",
           "read_stream", "read_text", "read_toml", "regular_file", "size_text", "too_large",
           "too_large_number", "too_long_number"]
