"""End-to-end tests of `lethe serve` (the OpenAI-compatible server).

Starts the server on 127.0.0.1 with the default model on CPU and drives it
with the official `openai` client, `requests`, raw sockets and curl:
completions, chat, streaming with include_usage, stop strings, stop token
ids, seeds, logprobs, prefix-cache hits in usage, Prometheus metrics, every
error status, a client that disconnects mid-stream (its request must be
cancelled and its KV freed), and 64 concurrent streaming clients. A second
server with --api-key, --load-delay-ms and a one-request budget covers 401,
503 while loading and 503 when overloaded. Servers are always killed in the
fixtures' finally blocks.
"""
import json
import socket
import subprocess
import threading
import time

import openai
import pytest
import requests

from lethe_server import Server

MAX_MODEL_LEN = 2048
COMMON = ["--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-bytes", "256M",
          "--max-request-bytes", "1M"]


def finish(request, s):
    s.stop()
    if request.session.testsfailed:
        print(f"server log kept: {s.log.name}")
    else:
        s.cleanup()


@pytest.fixture(scope="module")
def srv(request):
    s = Server(*COMMON)
    try:
        yield s
    finally:
        finish(request, s)


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def post(srv, path, body, **kw):
    return requests.post(srv.url + path, json=body, timeout=120, **kw)


def curl(*args, timeout=60):
    r = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", *args], capture_output=True,
                       text=True, timeout=timeout)
    body, _, code = r.stdout.rpartition("\n")
    return int(code), body


def long_prompt(lines=30):
    # about 11 tokens per line of varied text, identical on every call
    words = ["river", "stone", "lantern", "harbor", "orchard", "winter", "signal", "copper",
             "meadow", "engine", "violet", "summit", "thread", "candle", "market", "falcon"]
    parts = [f"Line {i}: the {words[i % 16]} met the {words[(i * 7) % 16]} near the "
             f"{words[(i * 3 + 5) % 16]}." for i in range(lines)]
    return " ".join(parts) + " Summary:"


# ---- happy paths ----

def test_models_and_health(srv, client):
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    models = client.models.list().data
    assert len(models) == 1
    assert models[0].id == "SmolLM2-135M-Instruct.Q4_1.gguf"
    raw = requests.get(srv.url + "/v1/models", timeout=10).json()
    assert raw["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_completion(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                  temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert isinstance(c.text, str) and len(c.text) > 0
    assert c.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # greedy is deterministic
    r2 = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                   temperature=0)
    assert r2.choices[0].text == c.text


def test_completion_token_id_prompt(srv, client, model):
    text = "Once upon a time"
    toks = post(srv, "/tokenize", {"prompt": text}).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    assert post(srv, "/detokenize", {"tokens": toks["tokens"]}).json()["prompt"].endswith(text)
    a = client.completions.create(model=model, prompt=text, max_tokens=6, temperature=0)
    b = client.completions.create(model=model, prompt=toks["tokens"], max_tokens=6, temperature=0)
    assert b.usage.prompt_tokens == len(toks["tokens"])
    assert a.choices[0].text == b.choices[0].text


def test_chat(srv, client, model):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a primary color."}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
    m = r.choices[0].message
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert m.role == "assistant" and isinstance(m.content, str) and m.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    # the prompt is the model's chat template, not the raw text
    templ = post(srv, "/tokenize", {"messages": msgs}).json()
    assert r.usage.prompt_tokens == templ["count"]
    # content parts are accepted like plain strings
    parts = [msgs[0], {"role": "user", "content": [{"type": "text", "text": "Name a primary color."}]}]
    r2 = client.chat.completions.create(model=model, messages=parts, max_tokens=16, temperature=0)
    assert r2.choices[0].message.content == m.content


def test_chat_stream_include_usage(client, model):
    msgs = [{"role": "user", "content": "Count from one to five."}]
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, roles, finishes, usage, n_chunks = "", [], [], None, 0
    for ch in stream:
        n_chunks += 1
        if ch.usage is not None:
            usage = ch.usage
            assert ch.choices == []
            continue
        d = ch.choices[0].delta
        if d.role:
            roles.append(d.role)
        text += d.content or ""
        if ch.choices[0].finish_reason:
            finishes.append(ch.choices[0].finish_reason)
    assert roles == ["assistant"]
    assert finishes == [full.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert n_chunks >= 3


def test_completion_stream_curl(srv, model):
    body = json.dumps({"model": model, "prompt": "Hello, my name is", "max_tokens": 5,
                       "temperature": 0, "stream": True})
    code, out = curl("-N", "-H", "Content-Type: application/json", "-d", body,
                     srv.url + "/v1/completions")
    assert code == 200
    events = [l[len("data: "):] for l in out.split("\n") if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    nonstream = post(srv, "/v1/completions", {"prompt": "Hello, my name is", "max_tokens": 5,
                                              "temperature": 0}).json()
    assert text == nonstream["choices"][0]["text"]


def test_stop_strings(client, model):
    prompt = "List of fruits: apple, banana, cherry,"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    t = full.choices[0].text
    # a stop string that occurs in the middle of the greedy output
    stop = next(t[i:i + 3] for i in range(2, len(t) - 3) if t[i:i + 3].strip())
    r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                  stop=[stop, "\u2603never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == t[:t.index(stop)]
    assert r.usage.completion_tokens < full.usage.completion_tokens
    # chat with a single stop string
    msgs = [{"role": "user", "content": "Say hello world twice."}]
    cf = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
    ct = cf.choices[0].message.content
    if len(ct) > 4:
        s2 = ct[2:4]
        cr = client.chat.completions.create(model=model, messages=msgs, max_tokens=16,
                                            temperature=0, stop=s2)
        assert cr.choices[0].message.content == ct[:ct.index(s2)]
        assert cr.choices[0].finish_reason == "stop"


def test_ignore_eos_and_stop_token_ids(srv, client, model):
    r = client.completions.create(model=model, prompt="Hi", max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"
    # stop on the token the model produces first (greedy)
    first = client.completions.create(model=model, prompt="The sky is", max_tokens=4,
                                      temperature=0, logprobs=0)
    tok0 = first.choices[0].logprobs.tokens[0]
    ids = post(srv, "/tokenize", {"prompt": tok0, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1
    r = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0,
                                  extra_body={"stop_token_ids": ids})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 1


def test_forced_token_ids(srv, client, model):
    ids = post(srv, "/tokenize", {"prompt": " purple elephants dance", "add_special_tokens": False}).json()["tokens"]
    r = client.completions.create(model=model, prompt="Hello", temperature=0,
                                  extra_body={"forced_token_ids": ids})
    assert r.choices[0].text == " purple elephants dance"
    assert r.usage.completion_tokens == len(ids) and r.choices[0].finish_reason == "length"
    err_of(post(srv, "/v1/completions", {"prompt": "x", "forced_token_ids": [1, -4]}), 400,
           "forced_token_ids")


def test_seed_reproducible(client, model):
    def gen(seed):
        return client.completions.create(model=model, prompt="A short story about a dragon:",
                                         max_tokens=16, temperature=0.8, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a, b = gen(1234), gen(1234)
    assert a == b
    others = {gen(s) for s in (1, 2, 3)}
    assert others != {a}, "different seeds all gave the seed-1234 text: sampling ignores the seed"


def test_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        # greedy: the sampled token is the most likely one
        assert item.logprob >= max(t.logprob for t in item.top_logprobs) - 1e-4
    assert "".join(i.token for i in content).startswith(r.choices[0].message.content[:1])
    c = client.completions.create(model=model, prompt="One, two,", max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert lp.text_offset[0] == 0
    assert all(len(t) >= 2 for t in lp.top_logprobs)


def test_cached_tokens_on_repeated_prompt(srv, client, model):
    p = long_prompt()
    a = client.completions.create(model=model, prompt=p, max_tokens=2, temperature=0)
    m0 = srv.metrics()
    b = client.completions.create(model=model, prompt=p, max_tokens=2, temperature=0)
    m1 = srv.metrics()
    hits = m1["lethe:prefix_cache_hits"] - m0["lethe:prefix_cache_hits"]
    assert hits == b.usage.prompt_tokens_details.cached_tokens
    assert m1["lethe:prefix_cache_queries"] - m0["lethe:prefix_cache_queries"] >= b.usage.prompt_tokens - 1
    assert a.usage.prompt_tokens > 250
    assert b.usage.prompt_tokens_details.cached_tokens > a.usage.prompt_tokens // 2
    assert b.choices[0].text == a.choices[0].text


def test_metrics_move(srv, client, model):
    before = srv.metrics()
    r = client.completions.create(model=model, prompt="Metrics are", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    # the engine publishes its counters at the end of a step, a moment after the last event
    after = wait_metrics(srv, lambda m: m["lethe:generation_tokens_total"] -
                         before["lethe:generation_tokens_total"] >= 6, timeout=10)
    for name in ("lethe:num_requests_running", "lethe:num_requests_waiting",
                 "lethe:kv_cache_usage_perc", "lethe:prefix_cache_queries",
                 "lethe:prefix_cache_hits"):
        assert name in after
    assert after["lethe:prompt_tokens_total"] - before["lethe:prompt_tokens_total"] >= r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
    assert after["lethe:generation_tokens_total"] - before["lethe:generation_tokens_total"] >= 6
    assert after['lethe:request_success_total{finished_reason="length"}'] == \
        before['lethe:request_success_total{finished_reason="length"}'] + 1
    assert after["lethe:prefix_cache_queries"] > before["lethe:prefix_cache_queries"]
    assert after["lethe:prefill_tokens_computed_total"] > before["lethe:prefill_tokens_computed_total"]
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"lethe:{h}_count"] == before[f"lethe:{h}_count"] + 1
        assert after[f"lethe:{h}_sum"] > before[f"lethe:{h}_sum"]
        assert after[f'lethe:{h}_bucket{{le="+Inf"}}'] == after[f"lethe:{h}_count"]
    assert after["lethe:inter_token_latency_seconds_count"] >= before["lethe:inter_token_latency_seconds_count"] + 5


# ---- errors ----

def err_of(resp, status, param=None, contains=None):
    assert resp.status_code == status, resp.text
    e = resp.json()["error"]
    assert set(e) >= {"message", "type", "param", "code"}
    assert e["code"] == status and e["message"]
    if param is not None:
        assert e["param"] == param, e
    if contains:
        assert contains in e["message"], e
    return e


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h"]}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "model": 7}, "model"),
])
def test_completion_400(srv, body, param):
    err_of(post(srv, "/v1/completions", body), 400, param)


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0]"),
    # SmolLM2's template has no tool format: a well-formed tool is refused for the model
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json"}}, "response_format"),
])
def test_chat_400(srv, body, param):
    err_of(post(srv, "/v1/chat/completions", body), 400, param)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "chain_id": "chain_abc"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chain_id": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                                           {"role": "user", "content": "b"}],
                              "chain_id": "chain_abc", "chain_append_start": 2}),
])
def test_chain_fields_without_chain_mode(srv, path, body):
    # this server runs the radix cache: a chain refusal, whose "code" is the
    # chain code string like every other chain error's (not the HTTP status)
    r = post(srv, path, body)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["code"] == "chain_mode_disabled" and e["param"] == "chain_id", e
    assert "--prefix-cache-mode chain" in e["message"], e


def test_n_greater_than_one_message(client, model):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=model, prompt="x", n=2)
    assert "n = 1" in str(ei.value)


def test_bad_json_and_body_types(srv):
    for data in (b"{not json", b"[1, 2]", b"\"text\"", b"", b"\xff\xfe\x00garbage"):
        r = requests.post(srv.url + "/v1/completions", data=data, timeout=30,
                          headers={"Content-Type": "application/json"})
        err_of(r, 400)
    code, out = curl("-d", "{\"prompt\": ", srv.url + "/v1/chat/completions")
    assert code == 400 and json.loads(out)["error"]["code"] == 400


def test_invalid_utf8_prompt_does_not_crash(srv):
    r = requests.post(srv.url + "/v1/completions", timeout=60,
                      data=b'{"prompt": "caf\xc3 \xff\xfe ok", "max_tokens": 2}',
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]["message"], r.text
    assert srv.alive()


def test_unknown_model_and_route(srv, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    err_of(post(srv, "/v1/chat/completions", {"model": "gpt-17", "messages": [
        {"role": "user", "content": "hi"}]}), 404, "model")
    err_of(requests.get(srv.url + "/v1/nothing", timeout=10), 404)
    err_of(requests.get(srv.url + "/index.html", timeout=10), 404)
    err_of(requests.post(srv.url + "/", timeout=10), 405)  # GET / is the dashboard (test_dashboard.py)
    err_of(requests.get(srv.url + "/v1/completions", timeout=10), 405)


def test_prompt_longer_than_max_model_len(srv, client, model):
    long = "hello " * (MAX_MODEL_LEN + 100)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=model, prompt=long, max_tokens=4)
    assert "maximum context length" in str(ei.value)
    e = err_of(post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}],
                                                  "stream": True}), 400, "messages")
    assert str(MAX_MODEL_LEN) in e["message"]
    # prompt fits but prompt + max_tokens does not
    toks = post(srv, "/tokenize", {"prompt": "hello " * 1000}).json()["count"]
    err_of(post(srv, "/v1/completions", {"prompt": "hello " * 1000,
                                         "max_tokens": MAX_MODEL_LEN - toks + 1}), 400, "max_tokens")


def test_body_too_large(srv):
    big = {"prompt": "x" * (2 << 20)}
    err_of(post(srv, "/v1/completions", big), 413)  # no Expect header: 413 at the headers, rest drained
    # curl waits for "100 Continue" and gets the 413 before sending the body
    p = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", "-H", "Expect: 100-continue",
                        "-H", "Content-Type: application/json", "--data-binary", "@-",
                        srv.url + "/v1/completions"], input=json.dumps(big), capture_output=True,
                       text=True, timeout=60)
    body, _, code = p.stdout.rpartition("\n")
    assert int(code) == 413 and json.loads(body)["error"]["code"] == 413
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200


# ---- disconnects and concurrency ----

def wait_metrics(srv, pred, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = srv.metrics()
        if pred(m):
            return m
        time.sleep(0.05)
    return srv.metrics()


def test_64_concurrent_streams(srv, client, model):
    n = 64
    results = [None] * n
    errors = []

    def one(i):
        try:
            text, finish, usage = "", None, None
            stream = client.completions.create(model=model, prompt=f"Client {i} says", max_tokens=8,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            for ch in stream:
                if ch.usage is not None:
                    usage = ch.usage
                elif ch.choices:
                    text += ch.choices[0].text
                    finish = ch.choices[0].finish_reason or finish
            results[i] = (text, finish, usage)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], srv.metrics()["lethe:num_requests_running"])
            except requests.RequestException:
                pass
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    t0 = time.time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    wall = time.time() - t0
    stop.set()
    w.join()
    assert not errors, errors[:3]
    assert all(r is not None for r in results)
    for text, finish, usage in results:
        assert finish == "length" and usage.completion_tokens == 8 and text
    assert peak[0] > 1, "requests were never batched"
    print(f"64 concurrent streams x 8 tokens: {wall:.2f}s wall, peak running {peak[0]:.0f}")
    m = wait_metrics(srv, lambda m: m["lethe:num_requests_running"] == 0)
    assert m["lethe:num_requests_running"] == 0


# ---- the second server: auth, loading, overload ----

@pytest.fixture(scope="module")
def srv2(request):
    s = Server(*COMMON, "--api-key", "sekret", "--load-delay-ms", "1500", "--max-num-seqs", "1",
               "--max-queued-requests", "0", "--served-model-name", "tiny",
               "--no-enable-prefix-caching", wait_ready=False)
    try:
        yield s
    finally:
        finish(request, s)


def test_loading_auth_overload(srv2):
    # the listener is up before the model: /health and the API answer 503 while loading
    r = requests.get(srv2.url + "/health", timeout=10)
    err_of(r, 503, contains="loading")
    err_of(requests.get(srv2.url + "/v1/models", timeout=10,
                        headers={"Authorization": "Bearer sekret"}), 503)
    assert requests.get(srv2.url + "/metrics", timeout=10).status_code == 200
    srv2.wait_ready()
    # auth
    err_of(requests.get(srv2.url + "/v1/models", timeout=10), 401)
    err_of(requests.get(srv2.url + "/v1/models", timeout=10,
                        headers={"Authorization": "Bearer wrong"}), 401)
    bad = openai.OpenAI(base_url=srv2.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=srv2.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
    assert good.models.list().data[0].id == "tiny"
    assert requests.get(srv2.url + "/health", timeout=10).status_code == 200  # no key needed
    # overload: one request in flight fills the budget (max-num-seqs 1 + 0 queued)
    stream = good.completions.create(model="tiny", prompt="Go on and on", max_tokens=1000,
                                     stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text is not None
    with pytest.raises(openai.APIStatusError) as ei:
        good.completions.create(model="tiny", prompt="me too", max_tokens=2)
    assert ei.value.status_code == 503 and "overloaded" in str(ei.value)
    stream.close()
    # after the first is cancelled the budget frees up again
    deadline = time.time() + 20
    while True:
        try:
            r = good.completions.create(model="tiny", prompt="me too", max_tokens=2)
            break
        except openai.APIStatusError as e:
            assert e.status_code == 503 and time.time() < deadline
            time.sleep(0.1)
    assert r.usage.completion_tokens == 2


# ---- disconnects (on server 2: no prefix cache, so freed KV shows as usage 0) ----

AUTH = {"Authorization": "Bearer sekret"}


def test_disconnect_mid_stream_frees_request(srv2):
    srv2.wait_ready()
    base = wait_metrics(srv2, lambda m: m["lethe:num_requests_running"] == 0)
    aborts0 = base['lethe:request_success_total{finished_reason="abort"}']
    body = json.dumps({"model": "tiny", "prompt": long_prompt()[:400], "max_tokens": 1500,
                       "ignore_eos": True, "temperature": 0.7, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", srv2.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer sekret\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 4:
        chunk = sock.recv(65536)
        assert chunk, "server closed the stream early"
        got += chunk
        assert b"\r\n\r\n" not in got or got.startswith(b"HTTP/1.1 200"), got[:500]
    during = srv2.metrics()
    assert during["lethe:num_requests_running"] == 1
    assert during["lethe:kv_cache_usage_perc"] > base["lethe:kv_cache_usage_perc"]
    t0 = time.time()
    sock.close()
    after = wait_metrics(srv2, lambda m: m["lethe:num_requests_running"] == 0 and
                         m['lethe:request_success_total{finished_reason="abort"}'] == aborts0 + 1)
    freed_s = time.time() - t0
    assert after["lethe:num_requests_running"] == 0
    assert after['lethe:request_success_total{finished_reason="abort"}'] == aborts0 + 1
    assert after["lethe:kv_cache_usage_perc"] < during["lethe:kv_cache_usage_perc"]
    assert after["lethe:kv_cache_usage_perc"] <= base["lethe:kv_cache_usage_perc"] + 1e-9
    assert after["lethe:generation_tokens_total"] - during["lethe:generation_tokens_total"] < 200
    print(f"disconnect -> request freed in {freed_s:.3f}s")
    assert "(client disconnected)" in srv2.read_log()


def test_disconnect_non_streaming(srv2):
    srv2.wait_ready()
    base = wait_metrics(srv2, lambda m: m["lethe:num_requests_running"] == 0)
    aborts0 = base['lethe:request_success_total{finished_reason="abort"}']
    # the client gives up (and closes the connection) long before 1500 tokens are ready
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(srv2.url + "/v1/completions", timeout=0.5, headers=AUTH, json={
            "model": "tiny", "prompt": "Tell me everything.", "max_tokens": 1500,
            "ignore_eos": True})
    after = wait_metrics(srv2, lambda m: m['lethe:request_success_total{finished_reason="abort"}']
                         == aborts0 + 1 and m["lethe:num_requests_running"] == 0)
    assert after['lethe:request_success_total{finished_reason="abort"}'] == aborts0 + 1


# ---- a model without a tokenizer (dummy weights): token ids in, token counts out ----

def test_dummy_model_token_ids(request):
    s = Server("--device", "cpu", "--load-format", "dummy", "--max-model-len", "128",
               "--kv-cache-bytes", "16M", model="tests/data/tiny-llama/config.json")
    try:
        ok = post(s, "/v1/completions", {"prompt": [1, 5, 9, 200], "max_tokens": 6,
                                         "ignore_eos": True, "temperature": 0})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 6
        assert ok.json()["usage"]["prompt_tokens"] == 4
        # one (empty-text) chunk per token, so clients can still time tokens
        code, out = curl("-N", "-d", json.dumps({"prompt": [3, 4], "max_tokens": 5, "ignore_eos": True,
                                                  "stream": True}), s.url + "/v1/completions")
        assert code == 200 and out.count("data: {") == 5 and out.rstrip().endswith("data: [DONE]")
        err_of(post(s, "/v1/completions", {"prompt": "text needs a tokenizer"}), 400, "prompt",
               contains="tokenizer")
        err_of(post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}), 400)
        err_of(post(s, "/v1/completions", {"prompt": [1, 10 ** 8]}), 400, contains="vocabulary")
    finally:
        finish(request, s)


# ---- a hybrid linear-attention model: state snapshot statistics in /metrics ----

def test_hybrid_snapshot_metrics(request):
    s = Server("--device", "cpu", "--max-model-len", "512", "--kv-cache-bytes", "16M",
               "--state-snapshot-interval", "64", model="tests/data/tiny-qwen3_5")
    try:
        prompt = [(7 * k + 3) % 256 for k in range(150)]
        body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
        m0 = s.metrics()
        assert m0["lethe:state_snapshots"] == 0 and m0["lethe:state_snapshot_capacity_bytes"] > 0
        first = post(s, "/v1/completions", body)
        assert first.status_code == 200, first.text
        # snapshots at 64 and 128 (the prompt's last multiple of 64); stats are published
        # at the end of the step, which may come after the response
        m1 = wait_metrics(s, lambda m: m["lethe:state_snapshots_taken_total"] >= 2)
        assert m1["lethe:state_snapshots"] == 2 and m1["lethe:state_snapshots_taken_total"] == 2
        one = m1["lethe:state_snapshot_bytes"] / 2
        assert one > 0 and m1["lethe:state_snapshot_capacity_bytes"] % one == 0
        again = post(s, "/v1/completions", body)
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        # 9 blocks (144 tokens) matched, resumed from 128: 16 recomputed
        m2 = wait_metrics(s, lambda m: m["lethe:state_snapshot_hits_total"] >= 1)
        assert m2["lethe:state_snapshot_hits_total"] == 1
        assert m2["lethe:state_snapshot_recomputed_tokens_total"] == 16
        assert m2["lethe:state_snapshots"] == 2 and m2["lethe:state_snapshots_evicted_total"] == 0
    finally:
        finish(request, s)
