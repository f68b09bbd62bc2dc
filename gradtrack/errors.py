"""The exceptions gradtrack raises.

Every error is a `GradtrackError`, so one `except` catches them all.
"""

from __future__ import annotations


class GradtrackError(RuntimeError):
    """Base class of every error gradtrack raises on purpose."""


class GradtrackConfigError(GradtrackError, ValueError):
    """A configuration value, file or environment variable is invalid."""
