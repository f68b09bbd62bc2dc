"""Headless Chromium driven over its DevTools pipe (``--remote-debugging-pipe``: JSON messages
ending in NUL on fds 3 and 4), to read a page's rendered DOM, shadow roots included."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest


class Chromium:
    """One headless Chromium; `evaluate` runs JavaScript in the page it opened."""

    def __init__(self, url: str, profile: Path) -> None:
        browser = shutil.which("chromium")
        if browser is None:
            if os.environ.get("CI"):
                pytest.fail("CI must install Debian's chromium (.ci/run does)")
            pytest.skip("chromium is not installed here (.ci/run installs it)")
        to_browser, self._to_browser = os.pipe()
        self._from_browser, from_browser = os.pipe()
        # Chromium reads commands on fd 3 and writes replies to fd 4.
        self._process = subprocess.Popen(
            [
                browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", f"--user-data-dir={profile}", "--remote-debugging-pipe",
                "--window-size=1400,1000", "about:blank",
            ],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4),  # kept open by number: the preexec dup2 puts the pipes there
            preexec_fn=lambda: (os.dup2(to_browser, 3), os.dup2(from_browser, 4)),
        )  # fmt: skip
        os.close(to_browser)
        os.close(from_browser)
        self._next_id = 0
        self._buffer = b""
        target = self.call("Target.createTarget", {"url": url})["targetId"]
        attached = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        self._session = attached["sessionId"]

    def call(self, method: str, params: dict[str, Any], session: str | None = None) -> Any:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_browser, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}, self._session
        )
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float) -> Any:
        """The first truthy value of ``expression``, polled until ``timeout_s``; else the last."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.5)

    def close(self) -> None:
        self._process.kill()
        self._process.wait(timeout=30)
        os.close(self._to_browser)
        os.close(self._from_browser)
