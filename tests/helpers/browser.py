"""Headless Chromium for tests that look at a page as a browser renders it.

Debian's ``chromium`` package, driven over the DevTools protocol with tornado's websocket client
(tornado comes with distributed: no browser-automation package is needed). ``find_chromium``
installs the package with apt-get where it is missing and the tests run as root on a machine
that has apt-get (CI's containers); elsewhere it says how to install it.

A ``Page`` opens one tab, records every request the page makes (``requests``), evaluates
JavaScript in it and takes screenshots. It runs its own event loop on the calling thread.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL = "apt-get install -y chromium"


def find_chromium(install: bool = True) -> str | None:
    """The Chromium binary; installs Debian's package first where it is missing and this process
    may (root, apt-get present, ``install``). None where there is none."""
    for name in CANDIDATES:
        if path := shutil.which(name):
            return path
    if install and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], env=env, check=False, capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], env=env, check=False, capture_output=True,
                       timeout=600)
        return find_chromium(install=False)
    return None


class Page:
    """One headless Chromium tab of ``width`` x ``height`` CSS pixels (see the module docstring)."""

    def __init__(self, binary: str, width: int = 1280, height: int = 900):
        self.width, self.height = width, height
        self.profile = tempfile.mkdtemp(prefix="dtrain-chromium-")
        args = [binary, "--headless=new", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-default-apps", "--disable-extensions", "--mute-audio", "--disable-breakpad",
                "--disable-crash-reporter", "--hide-scrollbars=false",
                f"--window-size={width},{height}", "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0", f"--user-data-dir={self.profile}", "about:blank"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.requests: list[str] = []
        self.errors: list[str] = []
        self._ws: Any = None
        self._id = 0
        self._loop = asyncio.new_event_loop()
        try:
            port = self._port(timeout=30)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                targets = json.loads(r.read())
            url = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
            self._run(self._connect(url))
            for domain in ("Page", "Network", "Runtime"):
                self.call(f"{domain}.enable")
            self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                      mobile=False)
        except BaseException:
            self.close()
            raise

    def _port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode} before listening")
            if m := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line):
                return int(m.group(1))
        raise TimeoutError("chromium did not start listening for DevTools")

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    async def _connect(self, url: str) -> None:
        from tornado.websocket import websocket_connect

        self._ws = await websocket_connect(url, max_message_size=256 << 20)

    def _event(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params") or {}
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.exceptionThrown":
            self.errors.append(json.dumps(params.get("exceptionDetails", {}))[:2000])

    async def _call(self, method: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
        self._id += 1
        mine = self._id
        await self._ws.write_message(json.dumps({"id": mine, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            raw = await asyncio.wait_for(self._ws.read_message(), max(deadline - time.monotonic(), 0.01))
            if raw is None:
                raise RuntimeError("chromium closed the DevTools connection")
            msg = json.loads(raw)
            if msg.get("id") == mine:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def call(self, method: str, timeout: float = 30, **params: Any) -> dict[str, Any]:
        """One DevTools command; the events that arrive meanwhile are recorded."""
        return self._run(self._call(method, params, timeout))

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression[:80]!r}: {out['exceptionDetails']}")
        return out.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float, every: float = 0.25) -> Any:
        """The first truthy value of ``expression``, evaluated every ``every`` s for up to ``timeout``
        (the last value after that; an evaluation that fails while the page reloads counts as none)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None
            if value or time.monotonic() > deadline:
                return value
            time.sleep(every)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """A PNG of the page (its whole height with ``full_page``), written to ``path``."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            height = int(self.evaluate("document.documentElement.scrollHeight") or self.height)
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": self.width, "height": min(height, 16000), "scale": 1})
        data = self.call("Page.captureScreenshot", **params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        """Close the browser (asked over DevTools, then signalled): every process it started goes,
        its helpers too (they share the process group it leads)."""
        if self._ws is not None:
            try:
                self._run(self._call("Browser.close", {}, 5))
            except Exception:  # it closes the connection as it goes
                pass
            try:
                self._ws.close()
            except Exception:
                pass
            self._ws = None
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._signal(signal.SIGKILL)  # a helper left behind (a crash handler, a zygote)
        deadline = time.monotonic() + 10
        while self._signal(0) and time.monotonic() < deadline:  # until the last of them is reaped
            time.sleep(0.05)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        self._loop.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def _signal(self, sig: int) -> bool:
        """Signal the process group the browser leads (it started it alone); False where it is empty."""
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
