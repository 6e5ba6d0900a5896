#!/usr/bin/env python3
"""Soak test of `lethe serve`: many concurrent clients on loopback for a given
time, then checks that the server accounted for every request and gave back
every resource.

Each client loops until the deadline, one request per connection (so the
server's connection counter counts every request), from one of several
loopback source addresses (127.0.x.y, like distinct clients), picking:

  stream      a streaming completion, prompt of 1..~300 tokens, 1..max_tokens
              tokens; every chunk must be valid JSON, the stream must end
              with a finish reason and [DONE]
  disconnect  the same, closed by the client after 0..3 chunks
  chat        a streaming chat turn of a conversation the client keeps: with
              --prefix-cache-mode chain its chain id (resumed next turn;
              410 chain_gone after the server reclaimed an idle chain starts
              a new conversation), otherwise the history resent (radix reuse)
  whole       a non-streaming completion
  bad         a malformed request with a known answer: invalid JSON,
              trailing data, invalid UTF-8, a NUL in a role, a bad
              temperature, an over-long prompt, an unknown route or chain,
              a malformed request line, an oversized Content-Length

Anything else counts as an unexpected error: a status other than the one
expected, a body or chunk that is not valid JSON, a stream without [DONE], a
connection reset. A 503 (overloaded, chain capacity) is backpressure: counted
and reported, the client waits and retries; --max-503 bounds its share.

After the load drains it checks /metrics against the client's own counts:
  - lethe:http_connections_total grew by exactly the connections opened
    (requests + this script's scrapes); lethe:http_bad_requests_total by the
    malformed requests the HTTP layer answers;
  - every generation request that got a 200 finished exactly once:
    the lethe:request_success_total delta over all reasons equals them,
    error stays 0 and abort is at most the disconnects;
  - nothing is left: requests_in_flight, running and waiting are 0, the KV in
    use (lethe:kv_cache_usage_perc) is back to its value before the load;
  - the server's RSS other than the KV pool's pages is at most --rss-growth (5%) above
    its value at the end of the warm-up (--warmup seconds, default 20% of the run, and not
    before the engine first ran its peak number of requests). The KV pool's buffers
    (--kv-cache-bytes) are allocated once and untouched; their pages join the RSS as slots
    are first written, up to the pool's size. The server measures them at each scrape
    (lethe:kv_cache_host_resident_bytes, mincore over its buffers), so that part is taken
    out exactly; everything else (heap, stacks, forward workspace, weights) must stay flat.
With --leak-check (a LeakSanitizer build, --bin build-fuzz/lethe) the server must also shut
down with exit code 0 and no sanitizer report; the RSS criterion is then skipped.
Prints a JSON report (also to --report) and exits non-zero on any failure.

Usage: tests/soak/soak.py [--duration S] [--clients N] [--max-tokens N] ...
       (the binary: $LETHE_BIN or $LETHE_BUILD/lethe, as the e2e tests)
"""
import argparse
import asyncio
import json
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from lethe_server import Server  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her an which be this are were "
         "river mountain city light story music winter garden market ocean engine letter window morning "
         "history question voice friend village number silver forest road dinner paper colour").split()


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Stats:
    def __init__(self):
        self.conns = 0            # connections opened (one request each)
        self.accepted = 0         # generation requests answered 200 (submitted to the engine)
        self.completed = 0        # ... read to their end (finish reason + [DONE] / whole body)
        self.disconnects = 0      # ... closed by the client before the end
        self.bad = 0              # malformed requests answered as expected
        self.http_bad = 0         # ... of them answered by the HTTP layer (lethe:http_bad_requests_total)
        self.backpressure = 0     # 503 answers (retried)
        self.chain_gone = 0       # 410 chain_gone: an idle chain the server reclaimed
        self.chain_resumed = 0
        self.tokens = 0           # completion tokens streamed
        self.timeouts = 0         # accepted requests the client gave up on (counted in disconnects)
        self.unanswered = 0       # requests given up before any answer (maybe queued, then aborted)
        self.unexpected = []      # descriptions (the first ones)
        self.n_unexpected = 0
        self.by_kind = {}

    def fail(self, what):
        self.n_unexpected += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(what)


class Client:
    def __init__(self, port, src):
        self.port, self.src = port, src

    async def open(self):
        return await asyncio.open_connection("127.0.0.1", self.port, local_addr=(self.src, 0))

    async def request(self, st, raw, stream_cb=None):
        """Sends raw request bytes on a new connection; returns (status, headers, body bytes).
        stream_cb(chunk_bytes) -> False closes the connection early (returns status -1 body)."""
        st.conns += 1
        self.last_status = None
        r, w = await self.open()
        try:
            w.write(raw)
            await w.drain()
            head = await r.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = self.last_status = int(lines[0].split()[1])
            hdr = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:] if l)}
            if hdr.get("transfer-encoding") == "chunked":
                body = b""
                while True:
                    size = int((await r.readuntil(b"\r\n")).strip(), 16)
                    if size == 0:
                        await r.readuntil(b"\r\n")
                        break
                    data = await r.readexactly(size + 2)
                    body += data[:-2]
                    if stream_cb and stream_cb(data[:-2]) is False:
                        return status, hdr, None
                return status, hdr, body
            n = int(hdr.get("content-length", "0"))
            return status, hdr, await r.readexactly(n)
        finally:
            w.close()
            try:
                await w.wait_closed()
            except (ConnectionError, OSError):
                pass


def post(path, body, extra=b""):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\nConnection: close\r\n%s"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), extra, len(data), data))


PROMPT_WORDS = (1, 3, 8, 20, 40, 80, 160, 250)


def prompt_text(rng, max_words):
    n = rng.choice([w for w in PROMPT_WORDS if w <= max_words] or [max_words])
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sse_events(body):
    """data: lines of an SSE body -> list of payload strings."""
    out = []
    for line in body.decode("utf-8").split("\n"):
        if line.startswith("data: "):
            out.append(line[6:])
    return out


# malformed requests: (raw bytes, expected status, answered by the HTTP layer)
def bad_requests():
    return [
        (post("/v1/completions", b'{"prompt": "hi", "max_tokens": 2'), 400, False),
        (post("/v1/completions", b'{"prompt": "hi", "max_tokens": 2} trailing'), 400, False),
        (post("/v1/completions", b'{"prompt": "caf\xc3 ok", "max_tokens": 2}'), 400, False),
        (post("/v1/chat/completions", b'{"messages": [{"role": "us\\u0000er", "content": "hi"}]}'), 400, False),
        (post("/v1/completions", {"prompt": "hi", "temperature": -1}), 400, False),
        (post("/v1/completions", {"prompt": "word " * 2000, "max_tokens": 2}), 400, False),
        (post("/v1/nothing", {"prompt": "hi"}), 404, False),
        (b"NONSENSE\r\n\r\n", 400, True),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 900000000\r\n\r\n", 413, True),
    ]


class Soak:
    def __init__(self, a, port, chain):
        self.a, self.port, self.chain = a, port, chain
        self.st = Stats()
        self.deadline = 0.0
        self.bad = bad_requests()

    def expect(self, kind, cond, what):
        if not cond:
            self.st.fail(f"{kind}: {what}")
        return cond

    async def stream(self, cl, rng, kind, body, path, conv=None):
        st = self.st
        cut = rng.randint(0, 3) if kind == "disconnect" else None
        seen = {"chunks": 0}

        def on_chunk(_data):
            seen["chunks"] += 1
            return cut is None or seen["chunks"] <= cut

        status, hdr, data = await cl.request(st, post(path, body), on_chunk)
        if status == 503:
            st.backpressure += 1
            return
        if conv is not None and status == 410:
            e = json.loads(data)["error"]
            if self.expect(kind, e["code"] == "chain_gone", f"410 {e}"):
                st.chain_gone += 1
                conv.clear()
            return
        if not self.expect(kind, status == 200, f"status {status}: {data[:200] if data else ''}"):
            return
        st.accepted += 1
        if data is None:
            st.disconnects += 1
            return
        ev = sse_events(data)
        if not self.expect(kind, ev and ev[-1] == "[DONE]", f"no [DONE]: {ev[-2:] if ev else ev}"):
            return
        text, finish, chain_id = "", None, None
        for e in ev[:-1]:
            try:
                c = json.loads(e)
            except ValueError:
                return self.expect(kind, False, f"chunk is not JSON: {e[:120]}")
            if "error" in c:
                return self.expect(kind, False, f"error event {c['error']}")
            chain_id = c.get("chain_id", chain_id)
            for ch in c.get("choices", []):
                d = ch.get("delta", {}).get("content") if "delta" in ch else ch.get("text")
                text += d or ""
                finish = ch.get("finish_reason") or finish
            if c.get("usage"):
                st.tokens += c["usage"]["completion_tokens"]
        if not self.expect(kind, finish in ("stop", "length"), f"finish_reason {finish}"):
            return
        st.completed += 1
        if conv is not None:
            if self.chain:
                if not self.expect(kind, chain_id, "no chain_id in the stream"):
                    return
                if conv.get("id") == chain_id:
                    st.chain_resumed += 1
                conv["id"] = chain_id
            conv.setdefault("msgs", []).append({"role": "assistant", "content": text})

    async def whole(self, cl, rng, body):
        status, _, data = await cl.request(self.st, post("/v1/completions", body))
        if status == 503:
            self.st.backpressure += 1
            return
        if not self.expect("whole", status == 200, f"status {status}: {data[:200]}"):
            return
        self.st.accepted += 1
        try:
            r = json.loads(data)
        except ValueError:
            return self.expect("whole", False, f"body is not JSON: {data[:120]}")
        if self.expect("whole", r["choices"][0]["finish_reason"] in ("stop", "length"), f"{r}"):
            self.st.completed += 1
            self.st.tokens += r["usage"]["completion_tokens"]

    async def bad_one(self, cl, rng):
        raw, want, http_layer = rng.choice(self.bad)
        status, hdr, data = await cl.request(self.st, raw)
        if not self.expect("bad", status == want, f"status {status} (want {want}) for {raw[:60]!r}"):
            return
        try:
            e = json.loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            return self.expect("bad", False, f"error body is not JSON: {data[:120]!r}")
        if self.expect("bad", e.get("message"), f"no message: {e}"):
            self.st.bad += 1
            self.st.http_bad += http_layer

    async def client(self, i):
        rng = random.Random(self.a.seed * 100003 + i)
        a = self.a
        src = f"127.0.{10 + i // 50}.{1 + i % 50}"
        cl = Client(self.port, src)
        conv = {}
        weights = [("stream", 45), ("disconnect", 12), ("chat", 25), ("whole", 8), ("bad", 10)]
        kinds = [k for k, w in weights for _ in range(w)]
        while time.time() < self.deadline:
            kind = rng.choice(kinds)
            self.st.by_kind[kind] = self.st.by_kind.get(kind, 0) + 1
            mt = rng.randint(1, a.max_tokens)
            # a client gives up (closes the connection) after --request-timeout, and
            # --grace seconds after the end of the load at the latest
            limit = self.deadline + a.grace - time.time()
            if a.request_timeout > 0:
                limit = min(limit, a.request_timeout)
            try:
                await asyncio.wait_for(self.action(cl, rng, kind, mt, conv), max(limit, 0.1))
            except asyncio.TimeoutError:
                if cl.last_status == 200:  # accepted, then closed by the client
                    self.st.accepted += 1
                    self.st.disconnects += 1
                    self.st.timeouts += 1
                elif cl.last_status is None:  # no answer yet: maybe queued in the engine
                    self.st.unanswered += 1
                else:
                    self.st.fail(f"{kind}: timed out after status {cl.last_status}")
            except (ConnectionError, asyncio.IncompleteReadError, OSError, ValueError) as e:
                self.st.fail(f"{kind}: {type(e).__name__}: {e}")
            if self.st.backpressure and rng.random() < 0.5:
                await asyncio.sleep(rng.uniform(0.05, 0.5))

    async def action(self, cl, rng, kind, mt, conv):
        a = self.a
        if kind in ("stream", "disconnect"):
            body = {"prompt": prompt_text(rng, a.max_prompt_words), "max_tokens": mt,
                    "temperature": rng.choice(a.temperatures), "stream": True,
                    "stream_options": {"include_usage": True}}
            await self.stream(cl, rng, kind, body, "/v1/completions")
        elif kind == "chat":
            if len(conv.get("msgs", [])) >= 6:  # a conversation of 3 turns, then a new one
                conv.clear()
            words = rng.choice([w for w in (1, 3, 8, 20, 40) if w <= a.max_prompt_words] or [1])
            conv.setdefault("msgs", []).append(
                {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))})
            body = {"messages": conv["msgs"], "max_tokens": mt, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            if self.chain and conv.get("id"):
                body["chain_id"] = conv["id"]
            await self.stream(cl, rng, kind, body, "/v1/chat/completions", conv)
        elif kind == "whole":
            await self.whole(cl, rng, {"prompt": prompt_text(rng, a.max_prompt_words), "max_tokens": mt})
        else:
            await self.bad_one(cl, rng)

    async def scrape(self):
        st = self.st
        cl = Client(self.port, "127.0.0.1")
        status, _, data = await cl.request(st, b"GET /metrics HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
        assert status == 200, status
        out = {}
        for line in data.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, v = line.rpartition(" ")
            name, _, labels = name_labels.partition("{")
            extra = ",".join(l for l in labels.rstrip("}").split(",") if l and not l.startswith("model_name="))
            out[name + ("{" + extra + "}" if extra else "")] = float(v)
        return out

    async def run(self, pid):
        a = self.a
        m0 = await self.scrape()
        t0 = time.time()
        self.deadline = t0 + a.duration
        # (t, RSS kB, KV pool kB in RAM): the KV pool's buffers are allocated untouched and
        # their pages join the RSS as slots are first written (up to --kv-cache-bytes); the
        # server measures them (mincore) at the scrape, right before this RSS reading
        rss = []
        self.stop_sampling = False
        self.running = []  # (t, requests running in the engine)
        self.heap = []  # (malloc in use, free) kB, with each RSS sample

        async def sample():
            while not self.stop_sampling:
                m = await self.scrape()
                rss.append((time.time() - t0, rss_kb(pid), kv_kb(m)))
                self.heap.append(heap_kb(m))
                self.running.append((time.time() - t0, m["lethe:num_requests_running"]))
                await asyncio.sleep(1.0)

        sampler = asyncio.ensure_future(sample())
        await asyncio.gather(*(self.client(i) for i in range(a.clients)))
        load_s = time.time() - t0
        # drain: the engine finishes or aborts what the closed connections left
        drain_deadline = time.time() + 600
        while True:
            m1 = await self.scrape()
            idle = (m1["lethe:requests_in_flight"] == 0 and m1["lethe:num_requests_running"] == 0
                    and m1["lethe:num_requests_waiting"] == 0 and m1["lethe:http_connections"] <= 1)
            if idle or time.time() > drain_deadline:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        self.stop_sampling = True
        await sampler  # its last scrape is counted before the final one
        m1 = await self.scrape()
        rss_end = (rss_kb(pid), kv_kb(m1))
        self.heap_end = heap_kb(m1)
        return m0, m1, rss, rss_end, load_s


def heap_kb(m):
    """malloc's chunks in use and free in its arenas (kB), from /metrics (glibc)."""
    return tuple(round(m.get(f'lethe:process_heap_bytes{{state="{k}"}}', 0) / 1024) for k in ("in_use", "free"))


def kv_kb(m):
    """KV pool pages in RAM (kB), from the server's own measurement; 0 on a device backend."""
    return round(m.get("lethe:kv_cache_host_resident_bytes", 0) / 1024)


def delta(m0, m1, key):
    return m1.get(key, 0.0) - m0.get(key, 0.0)


def check(a, s, m0, m1, rss, rss_end, load_s):
    st = s.st
    reasons = ("stop", "length", "abort", "error")
    fin = {r: delta(m0, m1, f'lethe:request_success_total{{finished_reason="{r}"}}') for r in reasons}
    # warm-up: --warmup seconds (default 20% of the run) and until the engine first ran
    # as many requests as it ever did (per-request buffers at peak concurrency)
    warm = a.warmup if a.warmup is not None else 0.2 * a.duration
    peak_running = max([r for _, r in s.running] or [0])
    t_peak = next((t for t, r in s.running if r == peak_running), 0.0)
    warm = max(warm, t_peak)
    after = [(kb, kv, h) for (t, kb, kv), h in zip(rss, s.heap) if t >= warm]
    rss_warm, kv_warm, heap_warm = after[0] if after else rss_end + (s.heap_end,)
    rss_last, kv_end = rss_end
    growth = rss_last / rss_warm - 1 if rss_warm else 0.0
    # the criterion: the RSS other than the KV pool's pages (heap, stacks, workspace, weights),
    # from the end of the warm-up to the end, relative to its own value after the warm-up
    other_warm, other_end = rss_warm - kv_warm, rss_last - kv_end
    growth_other = other_end / other_warm - 1 if other_warm > 0 else 0.0
    failures = []

    def need(cond, what):
        if not cond:
            failures.append(what)

    need(st.n_unexpected == 0, f"{st.n_unexpected} unexpected errors")
    # this script's scrapes after the first one opened connections too (counted in st.conns)
    need(delta(m0, m1, "lethe:http_connections_total") == st.conns - 1,
         f"connections_total grew by {delta(m0, m1, 'lethe:http_connections_total'):.0f}, "
         f"the client opened {st.conns - 1}")
    need(delta(m0, m1, "lethe:http_bad_requests_total") == st.http_bad,
         f"http_bad_requests_total grew by {delta(m0, m1, 'lethe:http_bad_requests_total'):.0f}, "
         f"sent {st.http_bad}")
    # every accepted request finished once; one given up before an answer may have been queued
    need(st.accepted <= sum(fin.values()) <= st.accepted + st.unanswered,
         f"finished {sum(fin.values()):.0f} (by reason {fin}), accepted {st.accepted} "
         f"(+ {st.unanswered} given up unanswered)")
    need(fin["error"] == 0, f"{fin['error']:.0f} requests finished with an error")
    need(fin["abort"] <= st.disconnects + st.unanswered,
         f"{fin['abort']:.0f} aborts but {st.disconnects} disconnects + {st.unanswered} unanswered")
    need(fin["stop"] + fin["length"] >= st.completed, "fewer stop+length finishes than completed requests")
    for k in ("lethe:requests_in_flight", "lethe:num_requests_running", "lethe:num_requests_waiting"):
        need(m1[k] == 0, f"{k} = {m1[k]} after the load")
    # KV in use after the load: exactly the slots resident in idle chains (requests hold none)
    used = round(m1["lethe:kv_cache_usage_perc"] * s.kv_slots)
    resident = m1.get("lethe:chain_cache_resident_slots", 0)
    need(m0["lethe:kv_cache_usage_perc"] == 0, f"KV usage {m0['lethe:kv_cache_usage_perc']} before the load")
    need(used == resident, f"{used} KV slots in use after the load, {resident:.0f} resident in idle chains")
    if "lethe:chain_cache_active" in m1:
        need(m1["lethe:chain_cache_active"] == 0, f"{m1['lethe:chain_cache_active']} chains still active")
    # (under ASan the quarantine of freed memory and the shadow make RSS meaningless)
    need(a.leak_check or growth_other <= a.rss_growth,
         f"RSS other than the KV pool's pages grew {100 * growth_other:.1f}% after the warm-up "
         f"({other_warm} -> {other_end} kB; RSS {rss_warm} -> {rss_last} kB, KV pool in RAM "
         f"{kv_warm} -> {kv_end} kB)")
    answered = st.accepted + st.bad + st.chain_gone
    need(st.backpressure <= a.max_503 * max(1, answered + st.backpressure),
         f"{st.backpressure} answers were 503 (more than {100 * a.max_503:.0f}%)")
    need(st.completed > 0, "no request completed")
    report = {
        "duration_s": a.duration, "load_s": round(load_s, 1), "clients": a.clients, "max_tokens": a.max_tokens,
        "prefix_cache_mode": a.prefix_cache_mode, "connections": st.conns, "requests_by_kind": st.by_kind,
        "accepted": st.accepted, "completed": st.completed, "disconnects": st.disconnects,
        "client_timeouts": st.timeouts, "unanswered_given_up": st.unanswered,
        "bad_answered": st.bad, "http_layer_bad": st.http_bad, "backpressure_503": st.backpressure,
        "chain_resumed": st.chain_resumed, "chain_gone": st.chain_gone, "completion_tokens": st.tokens,
        "finished_by_reason": fin, "unexpected_errors": st.n_unexpected, "unexpected_first": st.unexpected,
        "kv_slots": s.kv_slots, "kv_slots_used_after": used, "chain_resident_slots_after": resident,
        "rss_kb_start": rss[0][1] if rss else None, "rss_kb_after_warmup": rss_warm,
        "rss_kb_peak": max(kb for _, kb, _ in rss) if rss else None, "rss_kb_end": rss_last,
        "rss_growth_pct": round(100 * growth, 2), "kv_resident_kb_start": rss[0][2] if rss else None,
        "kv_resident_kb_after_warmup": kv_warm, "kv_resident_kb_end": kv_end,
        "other_kb_after_warmup": other_warm, "other_kb_end": other_end,
        "other_growth_pct": round(100 * growth_other, 2), "warmup_s": round(warm, 1),
        "heap_in_use_free_kb_after_warmup": heap_warm, "heap_in_use_free_kb_end": s.heap_end,
        "peak_running": peak_running,
        # every 10th sample: (s, RSS kB, KV pool kB in RAM), (s, running), (s, heap in use kB, free kB)
        "series_rss_kv_kb": [(round(t), kb, kv) for t, kb, kv in rss[::10]],
        "series_running": [(round(t), r) for t, r in s.running[::10]],
        "series_heap_kb": [(round(t), *h) for (t, _, _), h in list(zip(rss, s.heap))[::10]],
        "failures": failures,
    }
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=60, help="seconds of load (default 60)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens a request asks (default 16)")
    p.add_argument("--max-prompt-words", type=int, default=250, help="longest prompt, in words (default 250)")
    p.add_argument("--temperatures", default="0,0.8", help="sampling temperatures to pick from (default 0,0.8)")
    p.add_argument("--request-timeout", type=float, default=0, help="a client gives up after S seconds (0: never)")
    p.add_argument("--grace", type=float, default=60, help="seconds in-flight requests get after the load (60)")
    p.add_argument("--kv-cache-bytes", default="1G", help="server --kv-cache-bytes (default 1G)")
    p.add_argument("--max-model-len", default="1024", help="server --max-model-len (default 1024)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline (default 20%%)")
    p.add_argument("--rss-growth", type=float, default=0.05, help="allowed RSS growth after warm-up (0.05)")
    p.add_argument("--max-503", type=float, default=0.05, help="largest share of 503 answers (0.05)")
    p.add_argument("--prefix-cache-mode", default="chain", choices=("chain", "radix"))
    p.add_argument("--threads", default="2", help="server --threads")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--report", help="write the JSON report here too")
    p.add_argument("--bin", help="the lethe binary (default $LETHE_BIN or $LETHE_BUILD/lethe)")
    p.add_argument("--leak-check", action="store_true",
                   help="the binary is built with LeakSanitizer (make fuzz-build: build-fuzz/lethe): "
                        "after a clean shutdown it must report no leak and no sanitizer error")
    p.add_argument("server_args", nargs="*", help="more `lethe serve` arguments (after --)")
    a = p.parse_args(argv)
    a.temperatures = [float(t) for t in a.temperatures.split(",")]
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    env = {}
    if a.leak_check:  # leaks and sanitizer errors at exit: exit code 23 and a report in the log
        env = {"ASAN_OPTIONS": "detect_leaks=1:exitcode=23:abort_on_error=0",
               "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
    srv = Server("--max-model-len", a.max_model_len, "--threads", a.threads, "--prefix-cache-mode", a.prefix_cache_mode,
                 "--max-connections-per-client", "64", "--max-queued-requests", str(max(1024, 2 * a.clients)),
                 "--kv-cache-bytes", a.kv_cache_bytes, *a.server_args, bin=a.bin, env=env,
                 timeout=600 if a.leak_check else 120, stop_timeout=120 if a.leak_check else 10)
    try:
        s = Soak(a, srv.port, a.prefix_cache_mode == "chain")
        # "KV N slots per layer (shared rows" or "(per-layer rows": all slot spaces together
        m = re.search(r"KV (\d+) slots per layer \((shared|per-layer) rows", srv.read_log())
        assert m, "no KV size in the server log"
        s.kv_slots = int(m.group(1)) * (1 if m.group(2) == "shared" else int(
            re.search(r"(\d+) layers, KV", srv.read_log()).group(1)))
        m0, m1, rss, rss_end, load_s = asyncio.run(s.run(srv.proc.pid))
        report = check(a, s, m0, m1, rss, rss_end, load_s)
        report["server_alive"] = srv.alive()
        if not srv.alive():
            report["failures"].append("the server exited")
    finally:
        srv.stop()
        if srv.proc.returncode not in (0, None):
            print(srv.read_log()[-4000:], file=sys.stderr)
        log = srv.read_log()
        srv.cleanup()
    if a.leak_check:
        report["exit_code"] = srv.proc.returncode
        sanitizer = re.findall(r"ERROR: (?:LeakSanitizer|AddressSanitizer)[^\n]*|runtime error:[^\n]*", log)
        report["sanitizer_reports"] = sanitizer[:10]
        if srv.proc.returncode != 0 or sanitizer:
            report["failures"].append(f"leak check: exit code {srv.proc.returncode}, {sanitizer[:3]}")
    text = json.dumps(report, indent=1)
    print(text)
    if a.report:
        with open(a.report, "w") as f:
            f.write(text + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
