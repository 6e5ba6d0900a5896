"""Two lethe replicas behind HAProxy with chain affinity (deploy/haproxy.cfg, docs/deploy.md).

Two CPU replicas (SmolLM2-135M, small KV pools, --replica) on loopback behind HAProxy run with the
shipped deploy/haproxy.cfg; `lethe bench replay` replays generated multi-agent traces through the
proxy in chain mode.

- loading: a replica still loading its model (/health 503) takes no traffic: new chains all go to
  the other one;
- affinity: every turn after the first of each chain resumed it, and a replica only resumes chains it
  holds, so it was served by the replica that created the chain: per replica (its /metrics through
  the proxy's /replicas/NAME/ pages) the finished requests are exactly its created + resumed chain
  turns, nothing was refused, recreated or reclaimed, and the two add up to the trace;
- failover: a replica killed (SIGKILL) mid-run takes its chains with it; their next turn answers
  410 chain_gone on the survivor (counted there by code), the replayer recreates each one there
  (counted in its report), and no turn is lost.

The numbers of the failover run go to docs/deploy.md (printed with -s).
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import requests

from lethe_server import BIN, MODEL, ROOT, Server

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # a shared 2-core machine

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
REPLICA_ARGS = ("--prefix-cache-mode", "chain", "--replica", "--max-connections-per-client", "0",
                "--max-model-len", "1024", "--max-num-seqs", "8", "--kv-cache-bytes", "96M", "--threads", "1")
TRACE_ARGS = ("--system-tokens", "20", "--task-tokens", "30", "--tool-min", "10", "--tool-max", "30",
              "--out-min", "3", "--out-max", "5")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """HAProxy on deploy/haproxy.cfg in front of replicas r0, r1."""

    def __init__(self, r0, r1, wait):
        assert os.path.exists(HAPROXY), "haproxy is not installed (scripts/setup.sh installs the Debian package)"
        self.port, self.stats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, LETHE_PROXY_BIND=f"127.0.0.1:{self.port}", LETHE_R0=f"127.0.0.1:{r0.port}",
                   LETHE_R1=f"127.0.0.1:{r1.port}", LETHE_CHECK_INTER="200ms",
                   LETHE_PROXY_STATS_BIND=f"127.0.0.1:{self.stats_port}")
        self.log = tempfile.NamedTemporaryFile(prefix="lethe-haproxy-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", os.path.join(ROOT, "deploy", "haproxy.cfg")], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.wait_status(wait)

    def status(self):
        """{server: "UP" | "DOWN" | ...} of backend lethe, from HAProxy's stats CSV."""
        text = requests.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = [l.split(",") for l in text.splitlines() if l.startswith("lethe,")]
        return {r[1]: r[17].split(" ")[0] for r in rows if r[1] in ("r0", "r1")}

    def wait_status(self, want):
        """Until backend lethe's checks put the replicas in these states ({name: "UP" | "DOWN"})."""
        deadline = time.time() + 60
        got = None
        while time.time() < deadline:
            assert self.proc.poll() is None, "haproxy exited:\n" + open(self.log.name).read()
            try:
                got = self.status()
                if all(got.get(n) == s for n, s in want.items()):
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"haproxy: {got}, not {want}:\n" + open(self.log.name).read())

    def metrics(self, replica):
        """One replica's /metrics through the proxy: {name or name{label}: value}."""
        r = requests.get(f"{self.url}/replicas/{replica}/metrics", timeout=10)
        assert r.status_code == 200, r.text
        out = {}
        for name, labels, value in re.findall(r'^(lethe:[a-z_]+)\{([^}]*)\} (\S+)$', r.text, re.M):
            extra = [l for l in labels.split(",") if not l.startswith("model_name=")]
            out[name + ("{" + ",".join(extra) + "}" if extra else "")] = float(value)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def finished(m):
    return sum(v for k, v in m.items() if k.startswith("lethe:request_success_total"))


def refused(m, code=None):
    return sum(v for k, v in m.items()
               if k.startswith("lethe:chain_turns_refused_total") and (code is None or f'code="{code}"' in k))


def replay_cmd(proxy, out, agents, turns, seed, *extra):
    return [BIN, "bench", "replay", "--generate", "--agents", str(agents), "--min-turns", str(turns),
            "--max-turns", str(turns), *TRACE_ARGS, "--seed", str(seed), "--base-url", proxy.url, "--mode", "chain",
            "--timeout", "120", "--result-json", str(out), *extra]


def result(out):
    res = json.load(open(out))["results"]
    assert len(res) == 1
    return res[0]


def test_two_replicas_behind_haproxy(tmp_path):
    t_start = time.time()
    r0 = Server(*REPLICA_ARGS)
    r1 = Server(*REPLICA_ARGS, "--load-delay-ms", "5000", wait_ready=False)  # listens, loads for a while
    proxy = None
    try:
        proxy = Proxy(r0, r1, wait={"r0": "UP", "r1": "DOWN"})
        # while r1 loads, its /health 503 keeps it out: the proxy names new chains (routed by that
        # id) and r0 creates every one of them, returning the id as a header too
        during_load = 0
        for i in range(3):
            loading = requests.get(r1.url + "/health", timeout=10).status_code == 503
            created0 = proxy.metrics("r0")["lethe:chain_cache_created_total"]
            r = requests.post(proxy.url + "/v1/chat/completions", timeout=60,
                              json={"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 1})
            assert r.status_code == 200, r.text
            cid = r.headers["X-Lethe-Chain-Id"]
            assert re.fullmatch(r"chain_[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", cid)
            assert r.json()["chain_id"] == cid and r.headers["X-Lethe-Chain-Status"] == "created"
            if loading and requests.get(r1.url + "/health", timeout=10).status_code == 503:
                assert proxy.metrics("r0")["lethe:chain_cache_created_total"] == created0 + 1
                during_load += 1
        assert during_load >= 1, "r1 finished loading before a chat could check that it takes none"
        load = requests.get(f"{proxy.url}/replicas/r0/v1/worker/load", timeout=10).json()
        assert load["chains"]["held"] >= during_load and load["requests_running"] == 0, load
        r1.wait_ready()
        proxy.wait_status({"r0": "UP", "r1": "UP"})
        load = requests.get(f"{proxy.url}/replicas/r1/v1/worker/load", timeout=10).json()
        assert load["chains"]["held"] == 0 and load["kv_slots_total"] > 0, load
        assert requests.get(proxy.url + "/metrics", timeout=10).status_code == 404  # per replica only

        # ---- affinity: 6 agents x 3 turns, all at once ----
        before = {n: proxy.metrics(n) for n in ("r0", "r1")}
        out = tmp_path / "affinity.json"
        p = subprocess.run(replay_cmd(proxy, out, 6, 3, 7, "--wait-scale", "0"), cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        res = result(out)
        assert res["turns_ok"] == res["turns"] == 18 and "first_error" not in res, res
        assert res["chains_created"] == 6 and res["chains_resumed"] == 12, res
        assert res["chains_gone_retried"] == 0 and res["turns_retried"] == 0, res
        created = resumed = 0
        for n in ("r0", "r1"):
            a, b = before[n], proxy.metrics(n)
            d = {k: b[k] - a.get(k, 0) for k in b}
            # every request this replica finished created a chain or resumed one it holds
            assert finished(b) - finished(a) == d["lethe:chain_cache_created_total"] + \
                d["lethe:chain_cache_resumed_total"], (n, d)
            assert d["lethe:chain_cache_recreated_total"] == 0 and d["lethe:chain_cache_reclaimed_total"] == 0, d
            assert refused(b) - refused(a) == 0, (n, d)
            created += d["lethe:chain_cache_created_total"]
            resumed += d["lethe:chain_cache_resumed_total"]
        assert (created, resumed) == (6, 12)

        # ---- failover: 6 agents x 5 turns with tool waits; the replica with more of them dies mid-run ----
        before = {n: proxy.metrics(n) for n in ("r0", "r1")}
        out = tmp_path / "failover.json"
        t0 = time.time()
        rp = subprocess.Popen(replay_cmd(proxy, out, 6, 5, 11, "--max-wait", "0.8", "--wait-scale", "1"), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            while time.time() - t0 < 120:  # until about a quarter of the 30 turns are done
                done = sum(finished(proxy.metrics(n)) - finished(before[n]) for n in ("r0", "r1"))
                if done >= 8 or rp.poll() is not None:
                    break
                time.sleep(0.1)
            assert rp.poll() is None, "the replay ended before the kill:\n" + rp.communicate()[0]
            # chains of this run per replica (the earlier ones are idle and done)
            held = {n: proxy.metrics(n)["lethe:chain_cache_created_total"] - before[n]["lethe:chain_cache_created_total"]
                    for n in ("r0", "r1")}
            victim = max(held, key=held.get)
            survivor = "r1" if victim == "r0" else "r0"
            (r0 if victim == "r0" else r1).proc.send_signal(signal.SIGKILL)
            t_kill = time.time() - t0
            text = rp.communicate(timeout=300)[0]
        finally:
            if rp.poll() is None:
                rp.kill()
                rp.wait()
        wall = time.time() - t0
        assert rp.returncode == 0, text
        res = result(out)
        # no turn is lost
        assert res["turns_ok"] == res["turns"] == 30 and "first_error" not in res, (res, text)
        moved = res["chains_gone_retried"]
        assert moved >= 1, (held, res)  # the victim held chains with turns left
        assert res["chains_created"] == 6 + moved and res["chains_created"] + res["chains_resumed"] == 30, res
        # each 410 the replayer saw is the survivor answering for a chain it never held
        a, b = before[survivor], proxy.metrics(survivor)
        assert refused(b, "chain_gone") - refused(a, "chain_gone") == moved, (a, b)
        assert refused(b) - refused(a) == moved
        assert b["lethe:chain_cache_reclaimed_total"] == a["lethe:chain_cache_reclaimed_total"]
        # the dead replica's page says so instead of showing the survivor's
        assert requests.get(f"{proxy.url}/replicas/{victim}/metrics", timeout=10).status_code == 503
        print(f"\nscaleout: affinity 18/18 turns (6 chains, 12 resumed on their replica); failover: "
              f"{res['turns_ok']}/{res['turns']} turns, killed {victim} at {t_kill:.1f}s holding {held[victim]:.0f} "
              f"of the run's chains, {moved} chains moved (410, recreated on {survivor}), {res['turns_retried']} "
              f"turns sent again, replay {wall:.1f}s; whole test {time.time() - t_start:.1f}s")
    finally:
        if proxy:
            proxy.stop()
        for s in (r0, r1):
            s.stop()
            s.cleanup()


def test_worker_load_endpoint():
    """GET /v1/worker/load: behind --api-key like every /v1 route, 405 for other methods, the same
    numbers as the /metrics series; outside chain mode "chains" is null, the proxy's
    X-Lethe-New-Chain-Id is ignored and X-Lethe-Chain-Id is chain_mode_disabled."""
    srv = Server("--api-key", "k1", "--max-model-len", "512", "--threads", "1")
    try:
        auth = {"Authorization": "Bearer k1"}
        assert requests.get(srv.url + "/v1/worker/load", timeout=10).status_code == 401
        assert requests.post(srv.url + "/v1/worker/load", headers=auth, timeout=10).status_code == 405
        r = requests.post(srv.url + "/v1/chat/completions", headers={**auth, "X-Lethe-New-Chain-Id": "chain_ignored-here"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and "X-Lethe-Chain-Id" not in r.headers and "chain_id" not in r.json(), r.text
        r = requests.post(srv.url + "/v1/chat/completions", headers={**auth, "X-Lethe-Chain-Id": "chain_abcdefgh"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "chain_mode_disabled", r.text
        load = requests.get(srv.url + "/v1/worker/load", headers=auth, timeout=10).json()
        m = srv.metrics()  # /metrics needs no key unless --metrics-require-key
        assert load["object"] == "worker.load" and load["chains"] is None and load["prefix_cache_mode"] == "radix"
        assert load["requests_running"] == m["lethe:num_requests_running"] == 0
        assert load["requests_waiting"] == m["lethe:num_requests_waiting"] == 0
        assert load["requests_in_flight"] == m["lethe:requests_in_flight"] == 0
        assert load["kv_slots_total"] == m["lethe:kv_cache_total_slots"] > 0
        assert load["kv_slots_used"] == m["lethe:kv_cache_used_slots"]
        assert load["kv_cache_usage"] == m["lethe:kv_cache_usage_perc"]
    finally:
        srv.stop()
        srv.cleanup()
