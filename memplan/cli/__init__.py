"""The ``memplan`` command: thin typer commands over the core, one file per command group.

Errors in user input print one line (``memplan: error: ...``) and exit 2; ``MEMPLAN_DEBUG=1``
shows the traceback instead.
"""

from __future__ import annotations

import os
import sys

import typer
from pydantic import ValidationError
from typer.exceptions import Abort, Exit, TyperException

from memplan.errors import MemplanError

app = typer.Typer(
    name="memplan",
    help="Per-GPU memory budgets for LLM training, before the job starts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

from memplan.cli import (  # noqa: E402  (commands register on `app`)
    analyze,
    calibrate,
    catalog,
    diagnose,
    estimate,
    monitor,
    plan,
    profile,
    trace,
)

EXIT_USAGE = 2


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
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="memplan", standalone_mode=False)
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


__all__ = ["analyze", "app", "calibrate", "catalog", "diagnose", "estimate", "main", "monitor", "plan", "profile", "run", "trace"]
