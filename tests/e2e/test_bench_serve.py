"""`lethe bench serve` against a scripted OpenAI-style streaming server.

The fake server (a thread in this process) answers with known timing: the
first content chunk after TTFT seconds, then one token every ITL seconds, a
usage chunk and [DONE]; chat streams start with a role-only delta that must
not count as the first token. It also exposes Prometheus counters at
/metrics (server-side TTFT measured from request arrival), records every
prompt it received and the peak number of requests in flight. The tests
check that the client's numbers match what the server did: token counts
exactly, TTFT / TPOT / ITL within timing tolerance, the client's mean TTFT
within 5% of the server's own, the concurrency cap, the shared prefix, and
failures reported (exit code 1) rather than dropped.
"""
import json
import os
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")
TTFT = 0.20
ITL = 0.02


class FakeState:
    def __init__(self):
        self.lock = threading.Lock()
        self.prompts = []
        self.inflight = 0
        self.max_inflight = 0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.prompt_tokens = 0
        self.gen_tokens = 0


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, *args):
        pass

    def _json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        st = self.server.state
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        elif self.path == "/metrics":
            with st.lock:
                text = (
                    "# TYPE fake:time_to_first_token_seconds histogram\n"
                    f'fake:time_to_first_token_seconds_sum{{model_name="fake-model"}} {st.ttft_sum}\n'
                    f'fake:time_to_first_token_seconds_count{{model_name="fake-model"}} {st.ttft_count}\n'
                    f'fake:prompt_tokens_total{{model_name="fake-model"}} {st.prompt_tokens}\n'
                    f'fake:generation_tokens_total{{model_name="fake-model"}} {st.gen_tokens}\n'
                )
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self):
        st = self.server.state
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        t_arrival = time.monotonic()
        chat = self.path == "/v1/chat/completions"
        text = req["messages"][-1]["content"] if chat else req["prompt"]
        if "FAIL" in text:
            self._json(400, {"error": {"message": "bad prompt", "type": "invalid_request_error"}})
            return
        assert req["stream"] is True and req["stream_options"]["include_usage"] is True
        assert req.get("ignore_eos") is True
        n_prompt = len(text.split())
        n_out = int(req["max_tokens"])
        with st.lock:
            st.prompts.append(text)
            st.inflight += 1
            st.max_inflight = max(st.max_inflight, st.inflight)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def send(obj):
                self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
                self.wfile.flush()

            if chat:
                send({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            time.sleep(TTFT)
            for i in range(n_out):
                fin = "length" if i == n_out - 1 else None
                if chat:
                    send({"object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": fin}]})
                else:
                    send({"object": "text_completion", "choices": [{"index": 0, "text": f" t{i}", "finish_reason": fin}]})
                if i == 0:
                    with st.lock:
                        st.ttft_sum += time.monotonic() - t_arrival
                        st.ttft_count += 1
                if i < n_out - 1:
                    time.sleep(ITL)
            send({"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                           "total_tokens": n_prompt + n_out}})
            send(b"[DONE]")
            with st.lock:
                st.prompt_tokens += n_prompt
                st.gen_tokens += n_out
        finally:
            with st.lock:
                st.inflight -= 1


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.state = FakeState()
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def bench(srv, tmp_path, *args):
    out = tmp_path / "result.json"
    cmd = [LETHE, "bench", "serve", "--base-url", f"http://127.0.0.1:{srv.server_address[1]}",
           "--result-json", str(out), "--no-progress", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    res = json.loads(out.read_text()) if out.exists() else None
    return p, res


def test_completions_numbers_match_server(server, tmp_path):
    p, r = bench(server, tmp_path, "--num-prompts", "8", "--max-concurrency", "4",
                 "--random-input-len", "40", "--random-output-len", "12", "--random-range-ratio", "0")
    assert p.returncode == 0, p.stderr
    assert r["schema"] == "lethe-bench-serve/1" and r["model_id"] == "fake-model"
    assert r["completed"] == 8 and r["failed"] == 0
    assert r["total_output_tokens"] == 8 * 12
    assert r["total_input_tokens"] == 8 * 40  # single-token words: the fake counts words
    assert TTFT * 1000 * 0.95 <= r["mean_ttft_ms"] <= TTFT * 1000 * 1.5
    assert ITL * 1000 * 0.9 <= r["mean_itl_ms"] <= ITL * 1000 * 2.5
    assert ITL * 1000 * 0.9 <= r["mean_tpot_ms"] <= ITL * 1000 * 2.5
    assert r["p99_ttft_ms"] >= r["median_ttft_ms"] >= 0
    expect_e2e = TTFT + 11 * ITL
    assert expect_e2e * 1000 * 0.95 <= r["mean_e2el_ms"] <= expect_e2e * 1000 * 1.6
    assert server.state.max_inflight <= 4
    # the server's own counters over the same run
    s = r["server_metrics"]
    assert s["requests"] == 8
    assert s["generation_tokens"] == r["total_output_tokens"]
    assert s["prompt_tokens"] == r["total_input_tokens"]
    assert abs(r["mean_ttft_ms"] - s["mean_ttft_ms"]) <= 0.05 * s["mean_ttft_ms"]
    assert "Mean TTFT (ms):" in p.stdout and "P99 ITL (ms):" in p.stdout
    # 2 waves of 4 requests of ~0.42 s each
    assert 0.8 <= r["duration"] <= 3.0
    assert abs(r["request_throughput"] - 8 / r["duration"]) < 1e-9


def test_chat_role_delta_is_not_the_first_token(server, tmp_path):
    p, r = bench(server, tmp_path, "--endpoint", "/v1/chat/completions", "--num-prompts", "3",
                 "--random-input-len", "10", "--random-output-len", "4")
    assert p.returncode == 0, p.stderr
    assert r["completed"] == 3 and r["total_output_tokens"] == 12
    assert r["mean_ttft_ms"] >= TTFT * 1000 * 0.95


def test_concurrency_cap_shared_prefix_and_rate(server, tmp_path):
    p, r = bench(server, tmp_path, "--num-prompts", "6", "--max-concurrency", "2", "--request-rate", "100",
                 "--random-input-len", "30", "--shared-prefix-len", "12", "--random-output-len", "3",
                 "--save-detailed")
    assert p.returncode == 0, p.stderr
    assert server.state.max_inflight == 2
    prompts = server.state.prompts
    assert len(prompts) == 6
    prefix = prompts[0].split()[:12]
    assert all(q.split()[:12] == prefix for q in prompts)
    assert len({" ".join(q.split()[12:]) for q in prompts}) == 6
    assert r["max_concurrency"] == 2 and r["request_rate"] == 100
    assert r["output_lens"] == [3] * 6 and len(r["ttfts"]) == 6 and all(len(x) == 2 for x in r["itls"])


def test_failures_are_reported(server, tmp_path):
    ds = tmp_path / "ds.jsonl"
    ds.write_text('{"prompt": "one two three", "output_len": 2}\n{"prompt": "FAIL please"}\n')
    p, r = bench(server, tmp_path, "--dataset", str(ds), "--num-prompts", "4", "--random-output-len", "3")
    assert p.returncode == 1
    assert r["completed"] == 2 and r["failed"] == 2
    assert r["total_output_tokens"] == 4
    assert any("HTTP 400" in e for e in r["errors"])
    assert "requests failed" in p.stderr


def test_bad_flags():
    p = subprocess.run([LETHE, "bench", "serve", "--request-rate", "0"], capture_output=True, text=True)
    assert p.returncode == 2 and "--request-rate" in p.stderr
    p = subprocess.run([LETHE, "bench", "serve", "--random-range-ratio", "1.5"], capture_output=True, text=True)
    assert p.returncode == 2
