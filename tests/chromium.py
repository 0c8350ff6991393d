"""A small DevTools-protocol client for headless Chromium over ``--remote-debugging-pipe`` (stdlib only).

Why the DevTools protocol and not ``--dump-dom`` + log scraping: new headless Chromium does not write
page console messages to its stderr log, so a console error would go unseen. Over the protocol
the browser itself reports every console call (``Runtime.consoleAPICalled``), uncaught exception
(``Runtime.exceptionThrown``), browser-side error such as a failed load or a Content-Security-Policy
refusal (``Log.entryAdded``), and every request the page makes (``Network.requestWillBeSent``):
that last one is the network check, whatever the element or CSS rule that would cause the request.
The browser also runs with ``--host-resolver-rules="MAP * ~NOTFOUND"``, so nothing can leave the
machine even if a request were made; the request itself is still reported and fails the test.

Messages are JSON objects separated by a NUL byte: commands go to the browser's fd 3, replies and
events come from its fd 4.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) executable, or None."""
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


_SHIM = """import os, sys
a, b = int(sys.argv[1]), int(sys.argv[2])
os.dup2(a, 3); os.dup2(b, 4); os.close(a); os.close(b)
os.execv(sys.argv[3], sys.argv[3:])
"""


def _above_9(fd: int) -> int:
    """``fd`` moved to a number above 9, so that placing two of them at 3 and 4 cannot clobber one."""
    import fcntl

    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class Page:
    """One page in a fresh headless browser; use as a context manager."""

    def __init__(self, executable: str, *, width: int = 1280, height: int = 900, timeout: float = 60.0):
        self.timeout = timeout
        self.events: list[dict] = []
        self._next = 0
        self._buffer = b""
        self._profile = tempfile.mkdtemp(prefix="stagetool-chromium-")
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        cmd_r, out_w = _above_9(cmd_r), _above_9(out_w)
        # The browser reads commands from fd 3 and writes to fd 4. A small Python shim puts the pipes
        # there and execs it (no preexec_fn: forking this process, which runs JAX's threads, through
        # Python's fork hooks warns; a shell like dash cannot name descriptors above 9).
        args = [executable, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}", "--hide-scrollbars", "about:blank"]
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SHIM, str(cmd_r), str(out_w), *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(cmd_r, out_w))
        os.close(cmd_r)
        os.close(out_w)
        self._w, self._r = cmd_w, out_r
        self.session: str | None = None

    def __enter__(self) -> "Page":
        targets = self.send("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.send(f"{domain}.enable", session=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.send("Browser.close")
        except Exception:  # noqa: BLE001 - the browser may be gone already
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._w)
        os.close(self._r)
        shutil.rmtree(self._profile, ignore_errors=True)

    # ---- protocol

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, *, session: bool = False, **params: Any) -> dict:
        """Send a command and return its result; events that arrive meanwhile are kept in ``events``."""
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        for e in self.events:
            if e["method"] == method:
                return e
        while True:
            e = self._read_message(deadline)
            if "method" in e:
                self.events.append(e)
                if e["method"] == method:
                    return e

    # ---- what the tests use

    def load(self, path: Path) -> None:
        """Open a local file and wait for its load event."""
        self.send("Page.navigate", session=True, url=path.resolve().as_uri())
        self.wait_for("Page.loadEventFired")
        self.evaluate("1")  # drain events sent right after the load

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression evaluated in the page (DevTools bypasses the
        page's CSP, which forbids the page's own scripts)."""
        result = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluate failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions and browser-reported errors so far."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif e["method"] == "Runtime.exceptionThrown":
                out.append(str(p.get("exceptionDetails", {}).get("text")))
            elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
                out.append(f"{p['entry'].get('source')}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def requests(self) -> list[str]:
        """URLs of every request the page made."""
        return [e["params"]["request"]["url"] for e in self.events if e["method"] == "Network.requestWillBeSent"]

    def screenshot(self, path: Path, *, max_height: int | None = None) -> None:
        """A PNG of the whole page (beyond the viewport), or of its top ``max_height`` pixels."""
        width, height = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        height = min(height, max_height) if max_height else height
        data = self.send("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})["data"]
        path.write_bytes(base64.b64decode(data))

    def screenshot_of(self, path: Path, selector: str, *, pad: int = 12) -> None:
        """A PNG of the first element matching ``selector``: its box plus ``pad`` pixels around it,
        in page coordinates (not the viewport's)."""
        x, y, w, h = self.evaluate(
            "(() => { const e = document.querySelector(%s); const r = e.getBoundingClientRect();"
            " return [r.left + scrollX, r.top + scrollY, r.width, r.height]; })()" % json.dumps(selector))
        data = self.send("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True,
                         clip={"x": max(x - pad, 0), "y": max(y - pad, 0), "width": w + 2 * pad,
                               "height": h + 2 * pad, "scale": 1})["data"]
        path.write_bytes(base64.b64decode(data))
