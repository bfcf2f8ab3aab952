"""The ``memplan`` command: thin typer commands over the core, one file per command group.

Errors in user input print one line (``memplan: error: ...``) and exit 2; ``MEMPLAN_DEBUG=1``
shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer
from pydantic import ValidationError
from typer.exceptions import Abort, Exit, TyperException

from memplan.errors import MemplanError

_SETTINGS = dict(name="memplan",
                 help="Per-GPU memory budgets for LLM training, before the job starts.",
                 no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
_app = typer.Typer(**_SETTINGS)  # every command registers here when its module is imported

# The module that registers each command: a command line imports and builds only its own
# command (the others' imports and typer's building of their options cost every run ~40 ms).
_MODULES = {"analyze-trace": "analyze", "calibrate": "calibrate", "models": "catalog",
            "gpus": "catalog", "diagnose": "diagnose", "estimate": "estimate",
            "monitor-summary": "monitor", "plan": "plan", "profile": "profile", "trace": "trace"}

EXIT_USAGE = 2


def _register_all() -> typer.Typer:
    for module in dict.fromkeys(_MODULES.values()):
        importlib.import_module(f"memplan.cli.{module}")
    return _app


def __getattr__(name: str) -> object:
    """``app``: the typer app with every command registered (imported on first use)."""
    if name == "app":
        return _register_all()
    if name in _MODULES.values():  # the command modules, as attributes of the package
        return importlib.import_module(f"memplan.cli.{name}")
    raise AttributeError(f"module 'memplan.cli' has no attribute {name!r}")


def _command_for(args: list[str]) -> typer.core.TyperGroup | typer.core.TyperCommand:
    """The click command for ``args``: a group holding only the command named first (its
    help, options and errors are the same), or every command when none is named."""
    name = next((a for a in args if not a.startswith("-")), None)
    if name not in _MODULES:
        return typer.main.get_command(_register_all())
    importlib.import_module(f"memplan.cli.{_MODULES[name]}")
    one = typer.Typer(**_SETTINGS)
    one.registered_commands = [c for c in _app.registered_commands
                               if (c.name or c.callback.__name__.replace("_", "-")) == name]
    one.callback()(_group)  # a group even with one command: ``memplan NAME ...`` parses as always
    return typer.main.get_command(one)


def _group() -> None:
    """Per-GPU memory budgets for LLM training, before the job starts."""


def _one_line(err: BaseException) -> str:
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        return f"{field}: {first['msg']}"
    if isinstance(err, TyperException):
        return err.format_message().replace("\n", " ")
    return str(err).replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Returns the exit code (0 ok, 2 bad input)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        command = _command_for(args)
        code = command.main(args=args, prog_name="memplan", standalone_mode=False)
    except Exit as done:
        return done.exit_code
    except Abort:
        return 1
    except (MemplanError, ValidationError, TyperException) as err:
        if os.environ.get("MEMPLAN_DEBUG") == "1":
            raise
        message = _one_line(err)
        if message:  # no arguments: the help was printed, with nothing more to say
            print(f"memplan: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    return code if isinstance(code, int) else 0


def run() -> None:
    sys.exit(main())


__all__ = ["app", "main", "run"]
