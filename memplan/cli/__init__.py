"""The ``memplan`` command: thin typer commands over the core, one file per command group.

Errors in user input print one line (``memplan: error: ...``) and exit 2; ``MEMPLAN_DEBUG=1``
shows the traceback instead. Ctrl-C prints one line (``memplan: interrupted: ...``: what was
saved, the command that resumes) and exits 130.
"""

from __future__ import annotations

import enum
import importlib
import os
import shlex
import sys
from functools import lru_cache
from typing import Any

import typer
from typer import BadParameter
from typer.exceptions import Abort, Exit, TyperException
from typer._click.core import ParameterSource

from memplan.choices import lax_value
from memplan.errors import (
    EXIT_INTERRUPTED,
    NOTHING_WRITTEN,
    Interrupted,
    MemplanError,
    ValidationError,
    shown,
    validation_message,
)

_SETTINGS = dict(name="memplan",
                 help="Per-GPU memory budgets for LLM training, before the job starts. "
                 "memplan --version says which; --width N lays tables out N columns wide "
                 "(default: the terminal's, or 240 when the output is no terminal).",
                 no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False)

# Every command: its name -> (module of memplan.cli, function), the one list the app is built
# from. A command line imports and builds only the command it names (the others' imports and
# typer's building of their options cost every run ~40 ms); ``app`` has them all.
COMMANDS: dict[str, tuple[str, str]] = {
    "estimate": ("estimate", "estimate"),
    "plan": ("plan", "plan"),
    "diagnose": ("diagnose", "diagnose"),
    "models": ("catalog", "models"),
    "gpus": ("catalog", "gpus"),
    "trace": ("trace", "trace"),
    "profile": ("profile", "profile"),
    "calibrate": ("calibrate", "calibrate"),
    "analyze-trace": ("analyze", "analyze_trace"),
    "monitor-summary": ("monitor", "monitor_summary"),
}

EXIT_USAGE = 2


def _app_of(names: list[str]) -> typer.Typer:
    """A typer app with the commands ``names``, in table order."""
    app = typer.Typer(**_SETTINGS)
    for name in names:
        module, function = COMMANDS[name]
        app.command(name)(getattr(importlib.import_module(f"memplan.cli.{module}"), function))
    return app


@lru_cache(maxsize=1)
def _full_app() -> typer.Typer:
    return _app_of(list(COMMANDS))


def __getattr__(name: str) -> object:
    """``app``: the typer app with every command registered (imported on first use)."""
    if name == "app":
        return _full_app()
    if name in {module for module, _ in COMMANDS.values()}:  # the command modules
        return importlib.import_module(f"memplan.cli.{name}")
    raise AttributeError(f"module 'memplan.cli' has no attribute {name!r}")


def _command_for(args: list[str]) -> typer.core.TyperGroup | typer.core.TyperCommand:
    """The click command for ``args``: a group holding only the command named first (its
    help, options and errors are the same), or every command when none is named."""
    name = next((a for a in args if not a.startswith("-")), None)
    if name not in COMMANDS:
        return _plain_help(typer.main.get_command(_full_app()))
    one = _app_of([name])
    one.callback()(_group)  # a group even with one command: ``memplan NAME ...`` parses as always
    return _plain_help(typer.main.get_command(one))


# Value types the help shows: numbers (a value must parse as one) and choices; an on/off flag
# takes no value, and a name or a path says what it is in its own help text.
_SHOWN_TYPES = frozenset({int, float})


# Command-line values converted without building a pydantic validator per option.
#
# typer (0.29, ``typer/_coercion.py`` ``build_runtime_param``) converts every option's value
# with a pydantic ``TypeAdapter`` (``typer/_adapters.py`` ``build_leaf_adapter``), built on the
# first value the option processes - and every option processes one, given or not
# (``typer/core.py`` ``_TyperParameter.process_value``). The first adapter costs what building a
# pydantic model class costs (196M instructions, valgrind, pydantic 2.14: half a cold
# ``memplan estimate`` beyond its imports). ``plain_value`` gives each option whose type is a
# plain one (``int``, ``float``, ``str``, ``bool``, an enum, ``list[str]``; no parser or clamp;
# a range checked as typer's ``Field(ge, le)``) a conversion that does what that adapter does,
# with its messages (pydantic's lax int and float parsing: ``memplan.choices.lax_value``;
# typer's ``coerce_cli_choice`` for choices); any other option (a path) keeps typer's own, built
# when a value is given.


class PlainValue:
    """An option's conversion (typer's ``RuntimeParam.coerce`` interface)."""

    __slots__ = ("descriptor", "kind", "fallback")

    def __init__(self, descriptor: Any) -> None:
        self.descriptor = descriptor
        self.kind = _plain_kind(descriptor)
        self.fallback: Any = None

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        multi = param.multiple or param.nargs == -1
        if value is None:  # (typer's RuntimeParam.coerce)
            return () if multi else None
        kind = self.kind
        if kind is None:
            if (value is param.default
                    and ctx.get_parameter_source(param.name) is ParameterSource.DEFAULT):
                return value  # an option left unset: its default, which coerces to itself
            if self.fallback is None:
                from typer._coercion import build_runtime_param

                self.fallback = build_runtime_param(self.descriptor)
            return self.fallback.coerce(value, param=param, ctx=ctx)
        if multi and isinstance(value, str):
            raise BadParameter("Value must be an iterable.", ctx=ctx, param=param)
        if kind is list:  # list[str]: typer's parse_list of _parse_cli_str
            items = value if isinstance(value, (list, tuple)) else [value]
            return [str(item) for item in items]
        if kind is str:
            return str(value)
        if issubclass(kind, enum.Enum):
            from typer._param_types import coerce_cli_choice

            try:
                return coerce_cli_choice(value, choices=list(kind), ctx=ctx,
                                         case_sensitive=self.descriptor.parameter_info
                                         .case_sensitive)
            except ValueError as err:
                message = f"Value error, {err}"
                cause = ValidationError(param.name or "value", [
                    {"type": "value_error", "loc": (), "msg": message, "input": value}])
                raise BadParameter(message, ctx=ctx, param=param) from cause
        if kind is bool and isinstance(value, str):  # (typer's _parse_cli_bool)
            value = value.strip() or False
        info = self.descriptor.parameter_info
        try:  # typer's _build_number_adapter: Field(ge=min, le=max)
            return lax_value(kind, value, ge=info.min, le=info.max)
        except ValidationError as err:
            raise BadParameter(err.errors()[0]["msg"], ctx=ctx, param=param) from err


def _plain_kind(descriptor: Any) -> Any:
    """What ``PlainValue`` converts itself (a type), or None: typer's own conversion."""
    info = descriptor.parameter_info
    if (descriptor.file_annotation is not None or getattr(info, "parser", None) is not None
            or getattr(info, "clamp", None)):
        return None
    annotation = descriptor.annotation
    if annotation in (int, float, str, bool):
        return annotation
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation
    if getattr(annotation, "__origin__", None) is list and annotation.__args__ == (str,):
        return list
    return None


def plain_value(param: Any) -> None:
    """A typer option (or argument) converted by ``PlainValue`` from now on."""
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None and getattr(param, "_runtime_param", False) is None:
        param._runtime_param = PlainValue(descriptor)


def _plain_help(group: typer.core.TyperGroup) -> typer.core.TyperGroup:
    """``group`` with the help's type column kept for numbers and choices only: no ``<bool>``
    beside a flag, no ``<str>`` beside a name; each value converted without a pydantic
    validator (``PlainValue``)."""
    for command in [group, *group.commands.values()]:
        # the help flag is made on first use, from the context's names: made here, once
        helper = command.get_help_option(typer.Context(command))
        for param in [*command.params, *([helper] if helper is not None else [])]:
            desc = getattr(param, "type_descriptor", None)
            if (param.param_type_name == "option" and param.metavar is None
                    and desc is not None and not desc.is_choice
                    and desc.annotation not in _SHOWN_TYPES):
                param.metavar = ""
            plain_value(param)
    return group


def _group() -> None:
    """Per-GPU memory budgets for LLM training, before the job starts."""


def warn(message: str) -> None:
    """One line on stderr for a result that stands but is partial (a damaged file read as far
    as it goes): ``memplan: warning: ...``; stdout keeps the result (and ``--json`` its JSON)."""
    print(f"memplan: warning: {' '.join(message.split())}", file=sys.stderr)


def _invalid(err: BaseException | None) -> bool:
    """A typed input refused: a record's ``ValidationError`` or pydantic's (the calibration
    files' records; told by its type's name, so no command imports pydantic to catch it)."""
    return isinstance(err, ValidationError) or (
        isinstance(err, ValueError) and type(err).__name__ == "ValidationError"
        and type(err).__module__.startswith("pydantic"))


def _one_line(err: BaseException) -> str:

    if _invalid(err):
        return validation_message(err)
    if isinstance(err, TyperException):
        text = err.format_message().replace("Value error, ", "")
        cause = err.__cause__  # a value PlainValue (or typer's adapter) refused: quote it
        if _invalid(cause) and cause.errors():
            got = shown(cause.errors()[0].get("input"))
            text += "" if got in text else f" (got {got})"
        return " ".join(text.split())

    if isinstance(err, OSError):  # a file the command reads or writes, named by the OS
        return f"{err.filename}: {err.strerror or err}"
    return " ".join(str(err).split())


def _is_file_error(err: BaseException) -> bool:
    """An OSError about a named file (a full disk, a folder turned read-only mid-run): the
    user's to fix, so one line; any other OSError is a bug and keeps its traceback."""
    return isinstance(err, OSError) and err.filename is not None


_ARGS: list[str] = []  # the command line being run, for messages that say how to rerun it


def command_line(*extra: str) -> str:
    """The command line being run (``memplan calibrate --quick``), with the options in
    ``extra`` (``"--resume"``, ``"--name", "cpu"``) appended where it lacks them: what an
    interrupted command prints to resume."""
    args = list(_ARGS)
    groups: list[list[str]] = []
    for item in extra:  # an option and the values after it
        if item.startswith("-") or not groups:
            groups.append([item])
        else:
            groups[-1].append(item)
    for group in groups:
        if group[0] not in args:
            args += group
    return shlex.join(["memplan", *args])


# Tables a pipe or a file receives are laid out this wide (rich lays out 80 columns when stdout
# is no terminal): a table is as wide as its content, so none is cut or folded.
PIPED_WIDTH = 240
MIN_WIDTH = 40
# a table line rich lays out is built whole in memory: wider than any screen or log viewer
MAX_WIDTH = 10_000


def _take_width(args: list[str]) -> tuple[list[str], str | None]:
    """``args`` without ``--width N`` / ``--width=N``, and N as given (None when absent)."""
    out, width, rest = [], None, iter(args)
    for item in rest:
        if item == "--width":
            width = next(rest, "")
        elif item.startswith("--width="):
            width = item.partition("=")[2]
        else:
            out.append(item)
    return out, width


def _width_columns(width: str | None) -> str | None:
    """The COLUMNS a command runs with: ``--width N``; without it, output that is no terminal
    (a pipe, a file, a CI log) gets ``PIPED_WIDTH`` unless COLUMNS says; else None (rich
    asks the terminal)."""
    if width is not None:
        if (not (width.isascii() and width.isdigit()) or len(width) > len(str(MAX_WIDTH))
                or not MIN_WIDTH <= int(width) <= MAX_WIDTH):
            raise MemplanError(f"--width must be a whole number of columns from {MIN_WIDTH} "
                               f"to {MAX_WIDTH}, got {shown(width)}")
        return width
    if "COLUMNS" not in os.environ and not sys.stdout.isatty():
        return str(PIPED_WIDTH)
    return None


# Environment a command runs with and restores after, so a caller's process keeps its own:
# COLUMNS (the output width, set by _main from --width or a pipe), and pydantic's plugins off.
# pydantic looks for plugins when it builds its first validator by reading the entry points of
# every installed distribution (pydantic/plugin/_loader.py get_plugins; PYDANTIC_DISABLE_PLUGINS
# skips it, pydantic docs "Plugins"): tens of milliseconds in a training environment of a
# hundred packages, for validation hooks a command line has no use for. A value the user set is
# kept.
_SCOPED_ENV = ("COLUMNS", "PYDANTIC_DISABLE_PLUGINS")


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Returns the exit code (0 ok, 2 bad input, 130 interrupted)."""
    args = sys.argv[1:] if argv is None else list(argv)
    _ARGS[:] = args
    before = {name: os.environ.get(name) for name in _SCOPED_ENV}
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    try:
        return _main(args)
    finally:  # the command's environment, not the caller's process's
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _main(args: list[str]) -> int:
    try:
        args, width = _take_width(args)
        columns = _width_columns(width)
        if columns is not None:
            os.environ["COLUMNS"] = columns
        if args[:1] in (["--version"], ["-V"]):
            from memplan import __version__

            print(f"memplan {__version__}")
            return 0
        command = _command_for(args)
        code = command.main(args=args, prog_name="memplan", standalone_mode=False)
    except Exit as done:
        return done.exit_code
    except SystemExit as done:  # typer's completion options end the program themselves
        return done.code if isinstance(done.code, int) else 0
    except Abort:
        return 1
    except (Interrupted, KeyboardInterrupt) as err:
        if os.environ.get("MEMPLAN_DEBUG") == "1":
            raise
        print(f"memplan: interrupted: {_one_line(err) or 'nothing was saved'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (MemplanError, ValueError, TyperException, OSError) as err:
        if os.environ.get("MEMPLAN_DEBUG") == "1" or (isinstance(err, OSError)
                                                       and not _is_file_error(err)) or (
                isinstance(err, ValueError) and not isinstance(err, MemplanError)
                and not _invalid(err)):
            raise
        message = _one_line(err)
        if message:  # no arguments: the help was printed, with nothing more to say
            print(f"memplan: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    if code == EXIT_INTERRUPTED:  # typer's answer to a Ctrl-C no command turned into a line
        print(NOTHING_WRITTEN, file=sys.stderr)
    return code if isinstance(code, int) else 0


def run() -> None:
    sys.exit(main())


__all__ = ["app", "command_line", "main", "run", "warn"]


