"""Optional extras (``pip install gradtrack[wandb]`` …): checked before they are imported."""

from __future__ import annotations

import importlib.util

from gradtrack.errors import GradtrackError


def require_module(module: str, extra: str) -> None:
    """Fail early, without importing it, if a backend's optional SDK is missing."""
    if importlib.util.find_spec(module) is None:
        raise GradtrackError(
            f"the {module} backend needs the {module} package: pip install gradtrack[{extra}]"
        )
