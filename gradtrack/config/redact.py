"""Secrets never leave in gradtrack's own output: credentials inside URIs and query strings.

Every warning and log line gradtrack writes about a tracker passes through `redact`.
"""

from __future__ import annotations

import re

# scheme://user:password@host → scheme://***@host (any userinfo, a token alone included)
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/@\s'\"]+@")
# ?token=…&password=… and the like
_SECRET_PARAMETER = re.compile(
    r"(?P<name>[?&;](?:[\w.\-]*(?:token|password|passwd|secret|key|auth)[\w.\-]*))=[^&;\s'\"]+",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with URI credentials and secret query parameters replaced by ``***``.

    >>> redact("cannot reach http://alice:s3cr3t@mlflow.example:5000/api (timeout)")
    'cannot reach http://***@mlflow.example:5000/api (timeout)'
    >>> redact("postgresql://mlflow:pw@db/mlflow?sslmode=require&password=pw2")
    'postgresql://***@db/mlflow?sslmode=require&password=***'
    >>> redact("sqlite:///mlflow.db")
    'sqlite:///mlflow.db'
    """
    return _SECRET_PARAMETER.sub(r"\g<name>=***", _USERINFO.sub(r"\g<scheme>***@", text))
