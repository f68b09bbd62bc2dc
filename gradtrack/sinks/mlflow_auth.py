"""What a tracking server's refusal tells the user: which of MLflow's variables to set, or
which permission on which experiment the user lacks — and that nothing is lost meanwhile.

gradtrack takes no credentials of its own: MLflow's client reads MLFLOW_TRACKING_USERNAME /
MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), and for TLS
MLFLOW_TRACKING_SERVER_CERT_PATH / MLFLOW_TRACKING_INSECURE_TLS, from the environment at each
connection, so only the user name, never a secret, appears here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from gradtrack.sinks.mlflow_tracking import Refusal, UntrustedTlsError

USERNAME = "MLFLOW_TRACKING_USERNAME"
PASSWORD = "MLFLOW_TRACKING_PASSWORD"
TOKEN = "MLFLOW_TRACKING_TOKEN"
CERT_PATH = "MLFLOW_TRACKING_SERVER_CERT_PATH"
INSECURE_TLS = "MLFLOW_TRACKING_INSECURE_TLS"
KEPT = (
    "nothing is lost: the steps stay in gradtrack's spool and are retried, and "
    "`gradtrack sync` (run where those variables are right) delivers what this run could not"
)


def refusal_message(
    error: Refusal, tracking_uri: str | None, experiment: str, env: Mapping[str, str] = os.environ
) -> str:
    """One message for a 401/403 or an untrusted certificate at first contact;
    ``experiment`` names where the run is, ``env`` holds MLflow's variables.

    >>> from gradtrack.sinks.mlflow_tracking import AuthError
    >>> error = AuthError(403, "/api/2.0/mlflow/runs/create", "EDIT")
    >>> print(refusal_message(
    ...     error, "https://mlflow.team", "experiment 'vision' (id 4)", {USERNAME: "bob"}
    ... ))  # doctest: +ELLIPSIS
    MLflow at https://mlflow.team denied user 'bob' EDIT permission on experiment 'vision' (id 4)
    (HTTP 403 on /api/2.0/mlflow/runs/create): an admin grants it (docs/team-server.md), or set
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to a user who has it; nothing is lost...
    """
    if isinstance(error, UntrustedTlsError):
        return (
            f"gradtrack does not trust the TLS certificate of MLflow at {tracking_uri} "
            f"({error}): set {CERT_PATH} to the certificate of the CA that signed it "
            f"(docs/team-server.md), or {INSECURE_TLS}=true to skip the check; {KEPT}"
        )
    user = env.get(USERNAME)
    if error.status == 403:
        who = f"user {user!r}" if user else f"the user of {TOKEN}"
        return (
            f"MLflow at {tracking_uri} denied {who} {error.permission} permission on "
            f"{experiment} ({error}): an admin grants it (docs/team-server.md), or set {USERNAME} "
            f"and {PASSWORD} to a user who has it; {KEPT}"
        )
    if user:
        return (
            f"MLflow at {tracking_uri} refused the login of user {user!r} ({error}): check "
            f"{PASSWORD} (and {USERNAME}); {KEPT}"
        )
    if env.get(TOKEN):
        return f"MLflow at {tracking_uri} refused the token in {TOKEN} ({error}); {KEPT}"
    return (
        f"MLflow at {tracking_uri} requires a login and this process has none ({error}): set "
        f"{USERNAME} and {PASSWORD} (or {TOKEN}) where training runs; {KEPT}"
    )
