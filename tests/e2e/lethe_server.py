"""Helpers for the end-to-end server tests: start `lethe serve` on a free
port, wait for /health, scrape /metrics, and always kill the process.

The binary is $LETHE_BIN (default $LETHE_BUILD/lethe, build/lethe), run from the repository root
on the default model. The server is started with --port 0 and the real port
is read from its "listening on http://HOST:PORT" log line, so parallel test
runs never race for a port. Its log goes to a temporary file (a pipe could
fill up and block the server) and is printed when a test fails.
"""
import os
import re
import signal
import subprocess
import tempfile
import time

import requests

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("LETHE_BIN") or os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


class Server:
    def __init__(self, *args, model=MODEL, wait_ready=True, timeout=120, env=None, bin=None, stop_timeout=10):
        self.log = tempfile.NamedTemporaryFile(prefix="lethe-serve-", suffix=".log", delete=False)
        self.stop_timeout = stop_timeout  # seconds SIGTERM gets before SIGKILL
        cmd = [bin or BIN, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0", *args]
        # Passive OpenMP waits: on a shared 2-core machine, spinning worker threads
        # slowed decoding about 10x when other processes competed for the cores.
        env = {**os.environ, **(env or {})}  # env: extra variables (LETHE_FAULT_TOKEN, ...)
        env.setdefault("OMP_WAIT_POLICY", "passive")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        try:
            self.port = self._wait_port(timeout)
            self.url = f"http://127.0.0.1:{self.port}"
            if wait_ready:
                self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_port(self, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.read_log())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"lethe serve exited with {self.proc.returncode}:\n{self.read_log()}")
            time.sleep(0.01)
        raise TimeoutError("lethe serve did not start listening:\n" + self.read_log())

    def wait_ready(self, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lethe serve exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise TimeoutError("lethe serve did not become ready:\n" + self.read_log())

    def read_log(self):
        with open(self.log.name, "r", errors="replace") as f:
            return f.read()

    def metrics(self):
        """Parses /metrics into {name: value} for unlabelled-by-reason samples and
        {name{finished_reason=...}: value} / {name_bucket{le=...}: value} otherwise."""
        text = requests.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\} (\S+)$', line)
            assert m, f"malformed metrics line: {line!r}"
            name, labels, value = m.groups()
            extra = [l for l in labels.split(",") if not l.startswith("model_name=")]
            key = name + ("{" + ",".join(extra) + "}" if extra else "")
            out[key] = float(value)
        return out

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()

    def cleanup(self):
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
