"""Prefix-cache pruning and radix control over HTTP (lethe serve on
SmolLM2-135M, CPU, dense + radix, behind --api-key):

- prune: 202 {prune_id, status: queued}, GET until completed; freed ==
  width - keep; match before/after (matched unchanged, resident smaller,
  before_resident - after_resident == freed); the next turn reuses the
  pruned prefix (cached_tokens == matched); chat and text selectors address
  the same path as token_ids;
- every validation error is a 400 naming the range; blocked while a request
  streams on the path; unknown job 404; no key 401;
- inspect, set_eviction_priority, delete_subtree.
"""
import os
import re
import threading
import time

import pytest
import requests

from lethe_server import Server

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # a shared 2-core machine

KEY = "sk-prune-test"
H = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that reads tool output carefully."},
    {"role": "user", "content": "List the files in the project."},
    {"role": "assistant", "content": "I will call the ls tool."},
    {"role": "tool", "content": " ".join(f"file_{i}.py size={i * 37 % 1000} modified=2024-0{i % 9 + 1}-1{i % 10}"
                                         for i in range(40))},
    {"role": "user", "content": "Which file is the largest?"},
]


@pytest.fixture(scope="module")
def srv():
    s = Server("--max-model-len", "2048", "--threads", "2", "--api-key", KEY)
    yield s
    s.stop()
    s.cleanup()


def post(srv, route, body, headers=H):
    return requests.post(srv.url + "/v1/prefix_cache/" + route, json=body, headers=headers, timeout=300)


def tokens_of(srv, messages):
    r = requests.post(srv.url + "/tokenize", json={"messages": messages, "add_generation_prompt": True},
                      headers=H, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def wait_job(srv, pid):
    for _ in range(600):
        r = requests.get(srv.url + "/v1/prefix_cache/prune/" + pid, headers=H, timeout=60)
        assert r.status_code == 200, r.text
        if r.json()["status"] != "queued":
            return r.json()
        time.sleep(0.05)
    raise TimeoutError(pid)


def test_prune_match_reuse(srv):
    r = requests.post(srv.url + "/v1/chat/completions", headers=H, timeout=300,
                      json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    toks = tokens_of(srv, MESSAGES)
    n = len(toks)
    m0 = post(srv, "match", {"token_ids": toks}).json()
    assert m0["enabled"] and m0["block_size"] == 16 and m0["prompt_tokens"] == n
    assert m0["usable_tokens"] == (n - 1) // 16 * 16
    assert m0["matched_tokens"] == m0["usable_tokens"] == m0["resident_kv_tokens"]
    # the chat selector renders the same path
    mc = post(srv, "match", {"chat": {"messages": MESSAGES}}).json()
    assert mc["last_block_id"] == m0["last_block_id"] and mc["matched_tokens"] == m0["matched_tokens"]

    lo, hi = 32, (n // 2) // 16 * 16
    keep = (hi - lo) // 4
    r = post(srv, "prune", {"token_ids": toks, "ranges": [[lo, hi]], "keep_tokens": keep,
                            "policy": "snapkv_global", "observation_tokens": 16})
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "queued" and r.json()["prune_id"].startswith("prune_")
    job = wait_job(srv, r.json()["prune_id"])
    assert job["status"] == "completed", job
    assert job["freed_device_slots"] == hi - lo - keep
    assert job["quality_degraded"] is True
    assert job["ranges"] == [{"prune_id": r.json()["prune_id"], "policy": "snapkv_global", "range": [lo, hi],
                              "original_tokens": hi - lo, "retained_tokens": keep}]
    m1 = post(srv, "match", {"token_ids": toks}).json()
    assert m1["matched_tokens"] == m0["matched_tokens"] and m1["last_block_id"] == m0["last_block_id"]
    assert m0["resident_kv_tokens"] - m1["resident_kv_tokens"] == job["freed_device_slots"]
    # the next turn attaches the pruned prefix
    r = requests.post(srv.url + "/v1/chat/completions", headers=H, timeout=300,
                      json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
    u = r.json()["usage"]
    assert u["prompt_tokens_details"]["cached_tokens"] == m1["matched_tokens"]
    assert m1["matched_tokens"] - m1["resident_kv_tokens"] >= job["freed_device_slots"]
    # inspect shows the pruned blocks
    ins = post(srv, "inspect", {"token_ids": toks}).json()
    assert ins["n_blocks"] == m0["matched_blocks"]
    pruned = [b for b in ins["blocks"] if b["quality_degraded"]]
    assert [b["start"] for b in pruned] == list(range(lo, hi, 16))
    assert sum(b["resident_kv_tokens"] for b in pruned) == keep
    # pruning it again fails: no recompression
    r = post(srv, "prune", {"token_ids": toks, "ranges": [[lo, lo + 16]], "keep_tokens": 0,
                            "observation_tokens": 16})
    assert r.status_code == 202
    job = wait_job(srv, r.json()["prune_id"])
    assert job["status"] == "failed" and "not recompressed" in job["message"]


@pytest.mark.parametrize("body,needle", [
    ({"ranges": [[32, 32]], "keep_tokens": 0}, "range [32, 32) is empty"),
    ({"ranges": [[8, 32]], "keep_tokens": 0}, "range [8, 32) is not aligned"),
    ({"ranges": [[0, 4096]], "keep_tokens": 0}, "range [0, 4096) is outside"),
    ({"ranges": [[0, 32], [16, 48]], "keep_tokens": 0}, "ranges [0, 32) and [16, 48) overlap"),
    ({"ranges": [[0, 32]], "keep_tokens": 32}, "keep_tokens 32 must be in [0, 32)"),
    ({"range_start": 0, "range_end": 32}, "'keep_tokens' is required"),
    ({"ranges": [[0, 32]], "keep_tokens": 4, "policy": "h2o"}, "'policy' must be"),
    ({"ranges": [[0, 32]], "keep_tokens": 4, "allow_recompress": True}, "reserved"),
    ({"ranges": [[0]], "keep_tokens": 4}, "ranges[0] must be [start, end]"),
])
def test_prune_validation(srv, body, needle):
    r = post(srv, "prune", {"token_ids": list(range(100, 200)), **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_errors_and_auth(srv):
    assert post(srv, "match", {"token_ids": [1, 2, 3]}, headers={}).status_code == 401
    assert requests.get(srv.url + "/v1/prefix_cache/prune/prune_999999", headers=H).status_code == 404
    assert post(srv, "nothing", {}).status_code == 404
    r = post(srv, "match", {"token_ids": [1], "text": "x"})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
    r = post(srv, "delete_subtree", {"token_ids": list(range(300, 340))})
    assert r.status_code == 404
    r = post(srv, "set_eviction_priority", {"token_ids": list(range(300, 340))})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]


def test_blocked_while_streaming(srv):
    msgs = [{"role": "user", "content": "Tell a long story about a lighthouse keeper and the sea. " * 6}]
    requests.post(srv.url + "/v1/chat/completions", headers=H, timeout=300,
                  json={"messages": msgs, "max_tokens": 1, "temperature": 0})
    toks = tokens_of(srv, msgs)
    stream = requests.post(srv.url + "/v1/chat/completions", headers=H, stream=True, timeout=300,
                           json={"messages": msgs, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                                 "stream": True})
    it = stream.iter_lines()
    next(it)  # the request is running: it holds the path's blocks
    r = post(srv, "prune", {"token_ids": toks, "ranges": [[16, 64]], "keep_tokens": 16, "observation_tokens": 16})
    job = wait_job(srv, r.json()["prune_id"])
    stream.close()
    assert job["status"] == "blocked", job
    assert "running request" in job["message"]


def test_priority_and_delete(srv):
    msgs = [{"role": "user", "content": "Name three rivers in Europe and one fact about each of them."}]
    requests.post(srv.url + "/v1/chat/completions", headers=H, timeout=300,
                  json={"messages": msgs, "max_tokens": 1, "temperature": 0})
    toks = tokens_of(srv, msgs)
    nb = len(toks) // 16
    r = post(srv, "set_eviction_priority", {"token_ids": toks, "priority": -1})
    assert r.status_code == 200 and r.json() == {"blocks": nb, "priority": -1, "pinned": True}
    ins = post(srv, "inspect", {"token_ids": toks}).json()
    assert all(b["eviction_priority"] == -1 for b in ins["blocks"])
    everything = post(srv, "inspect", {}).json()
    assert everything["n_blocks"] >= nb
    r = post(srv, "delete_subtree", {"token_ids": toks[:32]})
    assert r.status_code == 200 and r.json()["deleted_blocks"] >= nb - 1
    m = post(srv, "match", {"token_ids": toks}).json()
    assert m["matched_tokens"] == 16


def test_retention_hints(srv):
    body = " ".join(f"row {i}: value={i * 13 % 97} status={'ok' if i % 3 else 'late'}" for i in range(30))
    msgs = [
        {"role": "system", "content": "You answer from the tool output."},
        {"role": "user", "content": "Fetch the table.", "retention": "pin"},
        {"role": "assistant", "content": "Fetching."},
        {"role": "tool", "content": body, "retention": {"prunable": 0.25}},
        {"role": "user", "content": "Which rows are late?", "retention": "normal"},
    ]
    r = requests.post(srv.url + "/v1/chat/completions", headers=H, timeout=300,
                      json={"messages": msgs, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    toks = tokens_of(srv, [{k: v for k, v in m.items() if k != "retention"} for m in msgs])
    # the prunable tool message was pruned after the request (a queued job)
    for _ in range(1200):  # the job's scoring pass takes seconds on a loaded CPU
        m = post(srv, "match", {"token_ids": toks}).json()
        if m["resident_kv_tokens"] < m["matched_tokens"]:
            break
        time.sleep(0.1)
    assert m["resident_kv_tokens"] < m["matched_tokens"], m
    # the pinned user message: its tokens are kept by a prune that covers it
    blocks = post(srv, "inspect", {"token_ids": toks}).json()["blocks"]
    assert any(b["quality_degraded"] for b in blocks)
    r = post(srv, "prune", {"token_ids": toks, "ranges": [[0, 32]], "keep_tokens": 16, "observation_tokens": 16})
    job = wait_job(srv, r.json()["prune_id"])
    assert job["status"] == "failed", job
    n_pinned = int(re.search(r"\((\d+) retention-pinned", job["message"]).group(1))
    assert 0 < n_pinned < 16, job
    # bad hints
    bad = [dict(msgs[0]), {"role": "user", "content": "x", "retention": "forever"}]
    r = requests.post(srv.url + "/v1/chat/completions", headers=H, timeout=60,
                      json={"messages": bad, "max_tokens": 1})
    assert r.status_code == 400 and "messages[1].retention" in r.json()["error"]["message"]
    bad[1]["retention"] = {"prunable": 1.5}
    r = requests.post(srv.url + "/v1/chat/completions", headers=H, timeout=60,
                      json={"messages": bad, "max_tokens": 1})
    assert r.status_code == 400


def test_kvzip_global(srv):
    msgs = [{"role": "user", "content": "Summarize: " + " ".join(f"item{i} costs {i * 7 % 50} dollars"
                                                              for i in range(40))}]
    requests.post(srv.url + "/v1/chat/completions", headers=H, timeout=300,
                  json={"messages": msgs, "max_tokens": 1, "temperature": 0})
    toks = tokens_of(srv, msgs)
    r = post(srv, "prune", {"token_ids": toks, "ranges": [[32, 96]], "keep_tokens": 16, "policy": "kvzip_global"})
    assert r.status_code == 202 and r.json()["policy"] == "kvzip_global"
    job = wait_job(srv, r.json()["prune_id"])
    assert job["status"] == "completed", job
    assert job["freed_device_slots"] == 48 and job["ranges"][0]["retained_tokens"] == 16
