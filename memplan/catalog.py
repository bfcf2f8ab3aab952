"""Where the catalog data lives, for editable and installed packages alike.

The catalogs are plain TOML under the repository's top-level ``model_specs/``. A wheel carries
them as ``memplan/model_specs`` (see ``pyproject.toml``); a source checkout reads them in place.
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def data_dir() -> Path:
    """The ``model_specs`` folder: inside the installed package, else the source tree's."""
    packaged = Path(__file__).resolve().parent / "model_specs"
    if packaged.is_dir():
        return packaged
    source = Path(__file__).resolve().parent.parent / "model_specs"
    if source.is_dir():
        return source
    raise FileNotFoundError(f"memplan catalog data not found at {packaged} or {source}")


def suggest(name: str, choices: list[str]) -> str:
    """A ", did you mean ...?" suffix naming the closest catalog names, or ""."""
    close = difflib.get_close_matches(name.lower(), choices, n=3, cutoff=0.5)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"
