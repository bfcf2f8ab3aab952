"""Real training steps under PyTorch. Imported lazily: ``import memplan.profile`` loads no torch.

``profile_step`` (a user's own step's memory timeline by phase) and ``phase`` (a label a step
function can put on a region) are loaded on first use.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("profile_step", "phase"):
        from memplan.profile import step

        return getattr(step, name)
    raise AttributeError(f"module 'memplan.profile' has no attribute {name!r}")


__all__ = ["phase", "profile_step"]
