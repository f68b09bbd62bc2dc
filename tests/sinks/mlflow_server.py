"""A real `mlflow server` process on a free loopback port, for the tests."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MlflowServer:
    """``mlflow server`` with one worker and no job runner, on 127.0.0.1."""

    def __init__(self, backend_store_uri: str, root: Path, port: int | None = None) -> None:
        self.backend_store_uri = backend_store_uri
        self.root = root
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    scheme = "http"

    @property
    def uri(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        command = [
            str(Path(sys.executable).parent / "mlflow"), "server",
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", self.backend_store_uri,
            "--artifacts-destination", str(self.root / "artifacts"), *self.app_args(),
        ]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **self.app_env()}
        env.pop("MLFLOW_TRACKING_URI", None)
        with (self.root / "server.log").open("ab") as log:  # the child keeps its own handle
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited: {(self.root / 'server.log').read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(
                    f"{self.uri}/health", timeout=2, context=self.client_tls()
                ) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server not healthy after {timeout_s}s")

    def app_args(self) -> list[str]:
        return []

    def client_tls(self) -> ssl.SSLContext | None:
        return None

    def app_env(self) -> dict[str, str]:
        return {}

    def freeze(self, seconds: float) -> None:
        """Stop the server's processes (SIGSTOP) for ``seconds``, then let them go on."""
        self.pause()
        time.sleep(seconds)
        self.resume()

    def pause(self) -> None:
        """Stop the server's processes (SIGSTOP) until `resume`."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGCONT)

    def restart(self, after_s: float) -> None:
        """Kill the server, and start it again on the same store after ``after_s``."""
        self.stop()
        time.sleep(after_s)
        self.start()

    def start_after(self, seconds: float) -> None:
        """A server that is late: start it only after ``seconds``."""
        time.sleep(seconds)
        self.start()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)


class AuthMlflowServer(MlflowServer):
    """``mlflow server --app-name basic-auth``: MLflow's own authentication, its users and
    permissions in a sqlite file of their own, every user allowed to READ by default — or as
    ``config`` (an auth config file) says, with ``env`` added to its environment."""

    admin = "admin"

    def __init__(
        self,
        backend_store_uri: str,
        root: Path,
        config: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(backend_store_uri, root)
        self.admin_password = secrets.token_urlsafe(18)
        self.config = config
        self.env = env or {}

    def app_args(self) -> list[str]:
        return ["--app-name", "basic-auth"]

    def app_env(self) -> dict[str, str]:
        """The basic-auth app's settings: its config file (by default written here), secrets."""
        config = self.config or self.root / "basic_auth.ini"
        if self.config is None:
            config.write_text(
                "[mlflow]\n"
                "default_permission = READ\n"
                f"database_uri = sqlite:///{self.root / 'basic_auth.db'}\n"
                f"admin_username = {self.admin}\n"
            )
        return {
            **self.env,
            "MLFLOW_AUTH_CONFIG_PATH": str(config),
            "MLFLOW_AUTH_ADMIN_PASSWORD": self.admin_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
        }

    @property
    def admin_login(self) -> dict[str, str]:
        """The admin's credentials, as MLflow's client takes them."""
        return {
            "MLFLOW_TRACKING_USERNAME": self.admin,
            "MLFLOW_TRACKING_PASSWORD": self.admin_password,
        }


class TlsMlflowServer(MlflowServer):
    """``mlflow server`` over HTTPS with a self-signed certificate for 127.0.0.1 (made with
    ``openssl``), as behind a team's TLS proxy with its own CA."""

    scheme = "https"

    @property
    def certificate(self) -> Path:
        return self.root / "cert.pem"

    def app_args(self) -> list[str]:
        key = self.root / "key.pem"
        if not self.certificate.exists():
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                 "-keyout", str(key), "-out", str(self.certificate), "-subj", "/CN=127.0.0.1",
                 "-addext", "subjectAltName=IP:127.0.0.1"],
                check=True, capture_output=True,
            )  # fmt: skip
        return ["--uvicorn-opts", f"--ssl-keyfile {key} --ssl-certfile {self.certificate}"]

    def client_tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.certificate)


def lock_sqlite(path: Path, seconds: float) -> None:
    """Another process holds an exclusive lock on the sqlite store ``path`` for ``seconds``
    (a backup, a second writer, a `sqlite3` shell left in a transaction)."""
    code = (
        "import sqlite3, sys, time\n"
        "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "db.execute('BEGIN EXCLUSIVE')\n"
        "print('locked', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n"
        "db.execute('COMMIT')\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        holder.wait(timeout=seconds + 60)
