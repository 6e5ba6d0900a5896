"""End-to-end hardening tests of `lethe serve`: a connection layer that one
client cannot starve (thousands of half-open connections, per-client caps,
header/body deadlines, immediate 413, JSON bodies for every HTTP-layer error),
strict request bodies, chain tenancy (a chain belongs to the API key or
tenant header that created it), and crash safety of state (a failed model
step answers 500 for its own requests; the others go on, no KV stays held)."""
import json
import resource
import socket
import threading
import time

import pytest
import requests

from lethe_server import Server


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raw(srv, data, src="127.0.0.1", timeout=10, read=True):
    """Sends raw bytes, returns (status, headers, body) of the answer (or the socket)."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout, source_address=(src, 0))
    if data:
        s.sendall(data)
    if not read:
        return s
    resp = read_response(s)
    s.close()
    return resp


_leftover = {}


def read_response(s):
    """One response from s; bytes of the next (pipelined) one are kept for the next call."""
    buf = _leftover.pop(s.fileno(), b"")
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and lines[0].startswith("HTTP/1.1 ") else 0
    headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    if rest[n:]:
        _leftover[s.fileno()] = rest[n:]
    return status, headers, rest[:n]


def json_error(resp, status):
    code, headers, body = resp
    assert code == status, (code, body)
    assert headers.get("content-type") == "application/json", headers
    e = json.loads(body.decode("utf-8"))["error"]  # valid UTF-8 JSON whatever the request held
    assert e["code"] == status
    return e


@pytest.fixture(scope="module")
def srv():
    raise_nofile()
    s = Server("--max-model-len", "512", "--max-connections-per-client", "64", "--header-timeout", "1.5",
               "--body-timeout", "1.5", "--max-request-bytes", "1M", "--threads", "2")
    yield s
    s.stop()
    s.cleanup()


def completion(srv, **kw):
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, **kw}
    return requests.post(srv.url + "/v1/completions", json=body, timeout=30)


# ---- the connection layer ----

def test_thousands_of_half_open_connections(srv):
    """3000 connections that send a request line and never finish their headers,
    from 50 addresses (each below its cap), while /health and a completion answer."""
    n_addr, per_addr = 50, 60
    held = []
    try:
        for a in range(n_addr):
            for _ in range(per_addr):
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=10,
                                             source_address=(f"127.0.1.{a + 1}", 0))
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
                held.append(s)
        m = srv.metrics()
        assert m["lethe:http_connections"] >= n_addr * per_addr
        health, cmpl = [], []
        for _ in range(3):
            t0 = time.time()
            assert requests.get(srv.url + "/health", timeout=10).status_code == 200
            health.append(time.time() - t0)
            t0 = time.time()
            r = completion(srv)
            assert r.status_code == 200, r.text
            cmpl.append(time.time() - t0)
        print(f"half-open: {len(held)} connections held; /health {[round(t, 3) for t in health]} s, "
              f"completion {[round(t, 3) for t in cmpl]} s")
        assert min(health) < 1.0 and min(cmpl) < 1.0, (health, cmpl)
        # the header deadline closes all of them, each with a 408 JSON body
        time.sleep(2.5)
        e = json_error(read_response(held[0]), 408)
        assert "headers did not arrive in time" in e["message"]
        deadline = time.time() + 10
        while srv.metrics()["lethe:http_connections"] > 5 and time.time() < deadline:
            time.sleep(0.2)
        assert srv.metrics()["lethe:http_connections"] <= 5
    finally:
        for s in held:
            s.close()
    assert srv.alive()


def test_per_client_cap(srv):
    held = [raw(srv, b"GET /health HTTP/1.1\r\n", src="127.0.2.1", read=False) for _ in range(64)]
    try:
        e = json_error(raw(srv, b"", src="127.0.2.1"), 429)
        assert "too many connections from this client (at most 64)" in e["message"]
        # another client is not affected
        assert raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", src="127.0.2.2")[0] == 200
        before = srv.metrics()['lethe:http_connections_refused_total{reason="client_cap"}']
        assert before >= 1
    finally:
        for s in held:
            s.close()


def test_body_deadline(srv):
    s = raw(srv, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"prompt\"", read=False)
    t0 = time.time()
    e = json_error(read_response(s), 408)
    assert "body did not arrive in time" in e["message"] and time.time() - t0 < 5
    s.close()


def test_immediate_413_on_declared_length(srv):
    # no Expect header, no body sent: the answer comes at once, not after a timeout
    s = raw(srv, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100000000\r\n\r\n", read=False)
    t0 = time.time()
    e = json_error(read_response(s), 413)
    assert time.time() - t0 < 1.0 and "larger than 1048576 bytes" in e["message"]
    s.close()


def test_http_layer_errors_are_json(srv):
    e = json_error(raw(srv, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n"), 414)
    assert "request line longer than 8192" in e["message"]
    e = json_error(raw(srv, b"GET /health HTTP/1.1\r\nX-Big: " + b"b" * 40000 + b"\r\n\r\n"), 431)
    assert "headers larger than" in e["message"]
    many = b"".join(b"X-%d: v\r\n" % i for i in range(120))
    json_error(raw(srv, b"GET /health HTTP/1.1\r\n" + many + b"\r\n"), 431)
    json_error(raw(srv, b"NONSENSE\r\n\r\n"), 400)
    json_error(raw(srv, b"GET /health HTTP/2.0\r\n\r\n"), 505)
    json_error(raw(srv, b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"), 411)
    json_error(raw(srv, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1x\r\n\r\n"), 400)
    json_error(raw(srv, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n"), 400)
    json_error(raw(srv, b"GET /health HTTP/1.1\r\nBad Header: v\r\n\r\n"), 400)
    # a path of raw bytes is quoted back sanitized, as valid JSON
    e = json_error(raw(srv, b"GET /nope%ff HTTP/1.1\r\n\r\n"), 404)
    assert "/nope%ff" in e["message"]
    assert srv.alive()


def test_keep_alive_and_pipelining(srv):
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    s = raw(srv, req + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + req, read=False)
    statuses = [read_response(s)[0] for _ in range(3)]
    assert statuses == [200, 200, 200]
    s.close()


# ---- strict input ----

def post_raw(srv, path, data):
    return requests.post(srv.url + path, data=data, timeout=30, headers={"Content-Type": "application/json"})


def err(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_trailing_data_nul_and_utf8(srv):
    assert "after the JSON value" in err(post_raw(srv, "/v1/completions", b'{"prompt": "hi"} x'), 400)["message"]
    e = err(post_raw(srv, "/v1/chat/completions",
                     b'{"messages": [{"role": "user\\u0000", "content": "hi"}]}'), 400)
    assert e["param"] == "role" and "NUL" in e["message"]
    e = err(post_raw(srv, "/v1/completions", b'{"prompt": "a\\u0000b", "max_tokens": 1}'), 400)
    assert e["param"] == "prompt"
    e = err(post_raw(srv, "/v1/completions", b'{"prompt": "ok", "model": "m\\u0000x"}'), 400)
    assert e["param"] == "model"
    e = err(post_raw(srv, "/v1/completions", b'{"prompt": "caf\xc3 ok"}'), 400)
    assert "not valid UTF-8 (byte offset 15)" in e["message"]
    err(post_raw(srv, "/tokenize", b'{"prompt": "\xff"}'), 400)
    # client text in messages is clipped and valid JSON
    e = err(post_raw(srv, "/v1/chat/completions",
                     json.dumps({"messages": [{"role": "r" * 5000, "content": "x"}]}).encode()), 400)
    assert len(e["message"]) < 300 and "..." in e["message"]


def test_documented_limits(srv):
    msgs = [{"role": "user", "content": "x"}] * 4097
    e = err(requests.post(srv.url + "/v1/chat/completions", json={"messages": msgs}, timeout=30), 400)
    assert "at most 4096" in e["message"]
    e = err(completion(srv, stop="s" * 1025), 400)
    assert e["param"] == "stop" and "1024 bytes" in e["message"]
    e = err(completion(srv, stop=["a"] * 8), 400)
    assert "at most 7" in e["message"]
    e = err(completion(srv, prompt="hello " * 600), 400)
    assert "maximum context length is 512" in e["message"]
    e = err(requests.post(srv.url + "/v1/completions", data=b"{" + b" " * (1 << 20) + b"}", timeout=30), 413)


def test_models_reveals_no_path(srv):
    m = requests.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
    assert "/" not in json.dumps(m), m


# ---- tenancy ----

def chat(srv, key=None, chain_id=None, headers=None):
    h = dict(headers or {})
    if key:
        h["Authorization"] = f"Bearer {key}"
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2, "temperature": 0}
    if chain_id:
        body["chain_id"] = chain_id
    return requests.post(srv.url + "/v1/chat/completions", json=body, headers=h, timeout=60)


def test_chain_belongs_to_its_key():
    srv = Server("--prefix-cache-mode", "chain", "--max-model-len", "512", "--api-key", "alice-key",
                 "--api-key", "bob-key", "--metrics-require-key", "--threads", "2")
    try:
        r = chat(srv, "alice-key")
        assert r.status_code == 200, r.text
        cid = r.json()["chain_id"]
        # bob sees no such chain: 404, exactly like an unknown id
        e = chat(srv, "bob-key", cid).json()
        assert e["error"]["code"] == "chain_not_found", e
        unknown = chat(srv, "bob-key", "chain_" + "A" * 32).json()
        assert unknown["error"]["code"] == "chain_not_found"
        assert chat(srv, "bob-key", cid).status_code == 404
        # bob's attempt did not wipe alice's state: she resumes
        r = chat(srv, "alice-key", cid)
        assert r.status_code == 200 and r.json()["chain_status"] in ("resumed", "recreated"), r.text
        assert chat(srv, "wrong-key", cid).status_code == 401
        # --metrics-require-key
        assert requests.get(srv.url + "/metrics", timeout=10).status_code == 401
        assert requests.get(srv.url + "/metrics", timeout=10,
                            headers={"Authorization": "Bearer bob-key"}).status_code == 200
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        srv.stop()
        srv.cleanup()


def test_chain_belongs_to_its_tenant_header():
    srv = Server("--prefix-cache-mode", "chain", "--max-model-len", "512", "--tenant-header", "X-Tenant",
                 "--threads", "2")
    try:
        r = chat(srv, headers={"X-Tenant": "t1"})
        assert r.status_code == 200, r.text
        cid = r.json()["chain_id"]
        assert chat(srv, chain_id=cid, headers={"X-Tenant": "t2"}).status_code == 404
        assert chat(srv, chain_id=cid).status_code == 404  # no header: the anonymous tenant
        assert chat(srv, chain_id=cid, headers={"X-Tenant": "t1"}).status_code == 200
        e = chat(srv, headers={"X-Tenant": "t" * 65}).json()["error"]
        assert "longer than 64 bytes" in e["message"]
    finally:
        srv.stop()
        srv.cleanup()


# ---- crash safety of state ----

FAULT = 49000  # a token id (SmolLM2: 49152) no normal prompt or greedy output here holds


def test_failed_model_step():
    """LETHE_FAULT_TOKEN fails the forward of every step holding that token, as a
    backend error would. With --split-prefill-decode a poisoned prompt's prefill
    runs in a step of its own: it gets a 500 with the engine's message (or an
    SSE error event when streaming) while a streaming request that is decoding
    finishes normally; the KV ownership checker runs after every step (a broken
    invariant would stop the server) and the KV in use returns to zero."""
    srv = Server("--max-model-len", "512", "--threads", "2", "--check-invariants", "--split-prefill-decode",
                 env={"LETHE_FAULT_TOKEN": str(FAULT)})
    try:
        got = {}

        def long_stream():
            body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with requests.post(srv.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
                got["status"] = r.status_code
                got["lines"] = []
                for line in r.iter_lines():
                    if line:
                        got["lines"].append(line.decode())
                        got["started"] = True

        t = threading.Thread(target=long_stream)
        t.start()
        deadline = time.time() + 60
        while not got.get("started") and time.time() < deadline:
            time.sleep(0.02)
        assert got.get("started"), "the long request did not start streaming"
        poison = [1, 504, 3458, FAULT, 28, 253]
        r = requests.post(srv.url + "/v1/completions", json={"prompt": poison, "max_tokens": 4}, timeout=60)
        assert r.status_code == 500, r.text
        e = r.json()["error"]
        assert e["code"] == 500 and "LETHE_FAULT_TOKEN" in e["message"], e
        # streaming: 200 headers, then the error as an SSE event and [DONE]
        with requests.post(srv.url + "/v1/completions", json={"prompt": poison, "max_tokens": 4, "stream": True},
                           stream=True, timeout=60) as rs:
            assert rs.status_code == 200
            lines = [l.decode() for l in rs.iter_lines() if l]
        assert lines[-1] == "data: [DONE]", lines
        ev = json.loads(lines[-2][len("data: "):])
        assert "LETHE_FAULT_TOKEN" in ev["error"]["message"] and ev["error"]["code"] == 500, ev
        t.join(120)
        assert got["status"] == 200
        assert got["lines"][-1] == "data: [DONE]"
        chunks = [json.loads(l[len("data: "):]) for l in got["lines"][:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # the server goes on: a normal request, metrics account for both failures, no KV held
        assert completion(srv).status_code == 200
        m = srv.metrics()
        assert m["lethe:engine_failed_steps_total"] == 2
        assert m['lethe:request_success_total{finished_reason="error"}'] == 2
        assert m['lethe:request_success_total{finished_reason="length"}'] == 2
        assert m["lethe:kv_cache_usage_perc"] == 0 and m["lethe:num_requests_running"] == 0
        assert srv.alive()
    except BaseException:
        print(srv.read_log())
        raise
    finally:
        srv.stop()
        srv.cleanup()
