"""Chains branching from a shared prefix and the host-memory tier over HTTP
(lethe serve on SmolLM2-135M, CPU):

- two SnapKV chains whose chat requests name the system prompt as shared
  (chain_share_messages = 1): the second attaches it (cached_tokens = the
  shared tokens, chain_shared_tokens in the response, only the rest is
  prefilled) and the server counts one shared prefix; chain_share_prefix in
  tokens works on /v1/completions; bad values are 400s naming the field;
- --host-cache-bytes: a dense radix server whose KV cache holds one prompt
  demotes the first prompt's blocks when a second one arrives and restores
  them on the first prompt's next request: its output equals the first
  answer, lethe:host_cache_* series say what moved (blocks, bytes and the
  copies' time, next to the start-up reference copy), and the tier stays
  within its budget; a bad value or the tier without prefix caching stops
  the server with a message naming the flag.
"""
import os
import subprocess

import pytest
import requests

from lethe_server import BIN, MODEL, ROOT, Server

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # a shared 2-core machine

SYSTEM = ("You are a careful assistant for a software team. You answer briefly, you cite file names "
          "exactly, you never invent tools, and you ask before running anything that changes files. "
          "Every answer starts with a one-line summary and ends with the next step.")


def chat(srv, messages, max_tokens=6, **extra):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    return requests.post(srv.url + "/v1/chat/completions", json=body, timeout=300)


@pytest.fixture(scope="module")
def snap():
    s = Server("--sparse-method", "snapkv", "--sparse-config",
               "sink_keep_tokens=4,recent_keep_tokens=16,decode_keep_tokens=32",
               "--max-model-len", "2048", "--threads", "2")
    yield s
    s.stop()
    s.cleanup()


def test_branching_chains_share_the_system_prompt(snap):
    m0 = snap.metrics()
    r1 = chat(snap, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the tests."}],
              chain_share_messages=1)
    assert r1.status_code == 200, r1.text
    j1 = r1.json()
    shared = j1["chain_shared_tokens"]
    assert shared >= 32 and shared % 16 == 0
    assert j1["chain_status"] == "created"
    m1 = snap.metrics()
    r2 = chat(snap, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which file is largest?"}],
              chain_share_messages=1)
    assert r2.status_code == 200, r2.text
    j2 = r2.json()
    assert j2["chain_shared_tokens"] == shared
    assert j2["chain_id"] != j1["chain_id"]
    assert j2["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    m2 = snap.metrics()
    computed = m2["lethe:prefill_tokens_computed_total"] - m1["lethe:prefill_tokens_computed_total"]
    assert computed == j2["usage"]["prompt_tokens"] - shared
    assert m2["lethe:chain_cache_shared_prefixes"] == m0.get("lethe:chain_cache_shared_prefixes", 0) + 1
    assert m2["lethe:chain_cache_branched"] >= 2
    assert m2["lethe:chain_cache_shared_hit_tokens_total"] >= shared
    # the second chain continues on its own row, the shared part attached
    r3 = chat(snap, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which file is largest?"},
                     {"role": "assistant", "content": j2["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And the smallest?"}], chain_id=j2["chain_id"],
              chain_append_start=3)
    assert r3.status_code == 200, r3.text
    assert r3.json()["chain_status"] == "resumed"
    # tokens form, on completions: two prompts that start with the same 32 tokens
    def tok(text):
        return requests.post(snap.url + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]

    one, two = tok(SYSTEM + " Question one."), tok(SYSTEM + " Question two, a longer one.")
    assert one[:32] == two[:32]
    for i, toks in enumerate((one, two)):
        r = requests.post(snap.url + "/v1/completions",
                          json={"prompt": toks, "max_tokens": 3, "temperature": 0, "chain_share_prefix": 32},
                          timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["chain_shared_tokens"] == 32
        if i == 1:  # the first completion published the 32 tokens, the second attaches them
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_branching_errors(snap):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    for extra, field in (({"chain_share_prefix": -1}, "chain_share_prefix"),
                         ({"chain_share_prefix": 1.5}, "chain_share_prefix"),
                         ({"chain_share_messages": 0}, "chain_share_messages"),
                         ({"chain_share_messages": 3}, "chain_share_messages"),
                         ({"chain_share_messages": 1, "chain_share_prefix": 16}, "chain_share_messages")):
        r = chat(snap, msgs, **extra)
        assert r.status_code == 400, (extra, r.text)
        assert field in r.text, r.text
    r = requests.post(snap.url + "/v1/completions",
                      json={"prompt": "hello", "max_tokens": 2, "chain_share_messages": 1}, timeout=60)
    assert r.status_code == 400 and "chain_share_messages" in r.text


def test_host_tier_restores_evicted_prefix():
    # 26M of KV (~590 tokens of SmolLM2): one ~360-token prompt and its answer, not two
    s = Server("--max-model-len", "512", "--threads", "2", "--kv-cache-bytes", "26M",
               "--host-cache-bytes", "32M")
    try:
        def sized(stem):  # ~360 tokens: one fits the 590-token cache with its answer, two do not
            n = 120
            for _ in range(4):
                text = " ".join(f"{stem}{i}" for i in range(n))
                k = requests.post(s.url + "/tokenize", json={"prompt": text}, timeout=60).json()["count"]
                if 330 <= k <= 420:
                    return text
                n = max(10, int(n * 360 / k))
            return text

        a, b = sized("alpha"), sized("beta")

        def complete(text):
            r = requests.post(s.url + "/v1/completions",
                              json={"prompt": text, "max_tokens": 4, "temperature": 0}, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()

        first = complete(a)
        complete(b)
        m = s.metrics()
        assert m["lethe:host_cache_capacity_bytes"] == 32 << 20
        assert m["lethe:host_cache_demoted_blocks_total"] > 0
        assert 0 < m["lethe:host_cache_used_bytes"] <= 32 << 20
        assert m["lethe:host_cache_demoted_bytes_total"] > 0
        assert m["lethe:host_cache_demote_seconds_total"] > 0
        assert m["lethe:host_cache_copy_bytes_per_second"] > 0  # the start-up reference copy
        again = complete(a)
        m2 = s.metrics()
        assert m2["lethe:host_cache_promoted_blocks_total"] > 0
        assert m2["lethe:host_cache_promoted_tokens_total"] > 0
        # every restored block's payload was copied back: bytes and time are counted
        assert m2["lethe:host_cache_restored_bytes_total"] > 0
        assert m2["lethe:host_cache_restore_seconds_total"] > 0
        assert m2["lethe:host_cache_restored_bytes_total"] <= m2["lethe:host_cache_demoted_bytes_total"]
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        s.stop()
        s.cleanup()


def test_host_tier_flag_errors():
    for args, needle in ((["--host-cache-bytes", "12Q"], "--host-cache-bytes: invalid value"),
                         (["--host-cache-bytes", "-5"], "--host-cache-bytes: invalid value"),
                         (["--host-cache-bytes", "1G", "--no-enable-prefix-caching"],
                          "--host-cache-bytes needs prefix caching"),
                         (["--host-cache-bytes", "100"], "smaller than one 16-token block")):
        p = subprocess.run([BIN, "serve", "--model", MODEL, "--port", "0", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode != 0, args
        assert needle in p.stdout + p.stderr, (args, p.stdout + p.stderr)
    h = subprocess.run([BIN, "serve", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "--host-cache-bytes" in h.stdout + h.stderr
