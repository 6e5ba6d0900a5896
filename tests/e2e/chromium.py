"""Headless Chromium for the dashboard's tests and screenshots: one page
driven over the DevTools protocol (Debian's `chromium`, websocket-client),
and a small PNG decoder to check what a screenshot shows."""
import json
import re
import shutil
import struct
import subprocess
import tempfile
import time
import zlib

import requests
import websocket

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium page over the DevTools protocol."""

    def __init__(self, width=1400, height=900):
        self.size = (width, height)
        assert CHROMIUM, "chromium is not installed (scripts/setup.sh installs the Debian package)"
        self.profile = tempfile.mkdtemp(prefix="lethe-chromium-")
        # its log goes to a file: a pipe nobody reads after start-up could fill and block it
        self.log = open(f"{self.profile}/stderr.log", "w+")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--disable-extensions", "--disable-background-networking", f"--window-size={width},{height}",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=self.log)
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self):
        port = None
        deadline = time.time() + 60
        while time.time() < deadline and port is None and self.proc.poll() is None:
            with open(self.log.name) as f:
                m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", f.read())
            if m:
                port = int(m.group(1))
            else:
                time.sleep(0.05)
        assert port, "chromium did not start its DevTools endpoint"
        page = next(t for t in requests.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
                    if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0
        self.requests = []  # every URL the page asked for

    def open(self, url):
        """Loads url at the browser's size (the viewport, not the window)."""
        self.call("Network.enable")
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=self.size[0], height=self.size[1],
                  deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)

    def screenshot(self):
        import base64
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("method") == "Network.requestWillBeSent":
                self.requests.append(msg["params"]["request"]["url"])
            if msg.get("id") == self.next_id:
                assert "error" not in msg, msg
                return msg.get("result", {})

    def js(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    def wait(self, expr, timeout=180):
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = self.js(expr)
            if v:
                return v
            time.sleep(0.2)
        raise TimeoutError(f"{expr} stayed false")

    def close(self):
        try:
            if getattr(self, "ws", None):
                self.ws.close()
        finally:
            self.proc.kill()
            self.proc.wait()
            self.log.close()
            shutil.rmtree(self.profile, ignore_errors=True)


def png_pixels(data):
    """(width, height, set of distinct colours) of an 8-bit RGB(A) PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride = zlib.decompress(idat), w * bpp
    prev, colours = bytearray(stride), set()
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):  # PNG filters: none, sub, up, average, paeth
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if y % 4 == 0:
            colours.update(bytes(line[x:x + 3]) for x in range(0, stride, bpp * 4))
        prev = line
    return w, h, colours
