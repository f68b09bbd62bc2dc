"""The exceptions gradtrack raises, and `require_module`: the error of an optional extra
(``pip install gradtrack[wandb]`` …) that is missing, raised before its SDK is imported.

Every error is a `GradtrackError`, so one `except` catches them all.
"""

from __future__ import annotations

import importlib.util


class GradtrackError(RuntimeError):
    """Base class of every error gradtrack raises on purpose."""


class GradtrackConfigError(GradtrackError, ValueError):
    """A configuration value, file or environment variable is invalid."""


class GradientAlertError(GradtrackError):
    """Raised in the training thread by an alert rule whose action is ``"raise"``.

    ``event`` is the `AlertEvent` that tripped; with an optimizer the error comes out of
    ``optimizer.step()`` before the bad gradient is applied.
    """

    def __init__(self, event: object) -> None:
        super().__init__(getattr(event, "message", str(event)))
        self.event = event


class GradientWarning(RuntimeWarning):
    """The warning an alert whose rule's action is ``"warn"`` gives (filter it by this class)."""


def require_module(module: str, extra: str) -> None:
    """Fail early, without importing it, if a backend's optional SDK is missing."""
    if importlib.util.find_spec(module) is None:
        raise GradtrackError(
            f"the {module} backend needs the {module} package: pip install gradtrack[{extra}]"
        )
