"""The configs people already have, read as memplan's inputs: a torchtitan job TOML
(``memplan.config_import.torchtitan``) and Megatron-LM launch arguments
(``memplan.config_import.megatron``).

Each reader returns an ``Imported``: the model (a catalog name or a ``ModelSpec``), the
``memplan.api`` keyword arguments the config sets, and for every key it read the memplan input
it became (``Mapped``), so the mapping can be shown. What a config sets that memplan cannot
express is refused by name (``MemplanError``, one line); what memplan reads but does not model
(MX linears, a compiled loss) is a note beside the estimate; keys it neither reads nor knows to hold
no memory are listed as not modelled, keys that hold none (learning rates, logging, data
paths) are left out. torch-free.
"""

from __future__ import annotations

from typing import Any

# The reader's types load with the first reader (``memplan.config_import.imported``): a
# command line without a config imports this package and nothing more.
_LAZY = frozenset({"Imported", "Mapped", "flag", "merge"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from memplan.config_import import imported

        return getattr(imported, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
