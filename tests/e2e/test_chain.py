"""Chain Cache through HTTP (lethe serve on SmolLM2-135M, CPU).

- dense in chain mode: a 10-turn conversation continued through its chain
  (chain_append_start) gives the same greedy output and the same prompt tokens
  as sending the full history as a new request each turn; each chain turn
  prefills exactly the suffix (lethe:prefill_tokens_computed_total delta ==
  prompt_tokens - cached_tokens) and reuses everything before the boundary;
- errors: 404 unknown id, 409 busy, 409 append prefix mismatch, recreate on a
  full prompt that does not continue the chain, 400s;
- capacity: strict LRU reclaim of IDLE chains, 410 for reclaimed ids, 503
  chain_capacity_unavailable while an ACTIVE turn holds the KV;
- SnapKV (auto -> chain mode): created / resumed statuses, reuse of the
  compacted KV, forced_token_ids; /metrics chain series;
- `lethe bench replay` end to end on a tiny generated trace.
"""
import json
import os
import threading
import time

import pytest
import requests

from lethe_server import BIN, MODEL, ROOT, Server

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # a shared 2-core machine


def chat(srv, messages, max_tokens=8, **extra):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    return requests.post(srv.url + "/v1/chat/completions", json=body, timeout=300)


def prefill_counter(srv):
    return srv.metrics()["lethe:prefill_tokens_computed_total"]


USER_TURNS = [
    "Hi! Can you help me with a Python script?",
    "It should read a CSV file.",
    "Then compute the average of the second column.",
    "What if some rows are empty?",
    "Please also print the maximum.",
    "How do I run it from the command line?",
    "Can it accept the file name as an argument?",
    "What about a header row?",
    "Thanks. Could you summarize the steps?",
    "One last thing: how do I test it?",
]


@pytest.fixture(scope="module")
def dense():
    srv = Server("--prefix-cache-mode", "chain", "--max-model-len", "2048", "--threads", "2")
    yield srv
    srv.stop()
    srv.cleanup()


def test_dense_chain_equals_full_history(dense):
    msgs = []
    chain_id = None
    for t, user in enumerate(USER_TURNS):
        msgs.append({"role": "user", "content": user})
        p0 = prefill_counter(dense)
        extra = {"chain_id": chain_id}
        if chain_id:
            extra["chain_append_start"] = len(msgs) - 1
        r = chat(dense, msgs, **extra)
        assert r.status_code == 200, r.text
        j = r.json()
        p1 = prefill_counter(dense)
        assert j["chain_status"] == ("created" if t == 0 else "resumed")
        if chain_id:
            assert j["chain_id"] == chain_id
        chain_id = j["chain_id"]
        u = j["usage"]
        cached = u["prompt_tokens_details"]["cached_tokens"]
        if t > 0:
            # everything before the boundary is reused: the last turn's prompt + reply - 1
            assert cached == prev_total - 1
        assert p1 - p0 == u["prompt_tokens"] - cached  # prefill work == the suffix
        # reference: the whole history as a new request (full prefill, no reuse)
        ref = chat(dense, msgs)
        assert ref.status_code == 200, ref.text
        rj = ref.json()
        assert rj["chain_status"] == "created"
        assert rj["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert rj["usage"]["prompt_tokens"] == u["prompt_tokens"]
        reply = j["choices"][0]["message"]["content"]
        assert reply == rj["choices"][0]["message"]["content"], f"turn {t}"
        prev_total = u["prompt_tokens"] + u["completion_tokens"]
        msgs.append({"role": "assistant", "content": reply})
    m = dense.metrics()
    assert m["lethe:chain_cache_resumed_total"] >= 9
    assert m["lethe:chain_cache_reused_tokens_total"] > 0


def test_errors(dense):
    r = chat(dense, [{"role": "user", "content": "hello"}], chain_id="chain_doesnotexist")
    assert r.status_code == 404 and r.json()["error"]["code"] == "chain_not_found"
    r = chat(dense, [{"role": "user", "content": "hello"}])
    cid = r.json()["chain_id"]
    reply = r.json()["choices"][0]["message"]["content"]
    conv = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": reply},
            {"role": "user", "content": "and then?"}]
    # append start that does not continue the chain (it covers 2 messages) -> 409
    bad = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, *conv]
    r = chat(dense, bad, chain_id=cid, chain_append_start=4)
    assert r.status_code == 409 and r.json()["error"]["code"] == "chain_prefix_mismatch", r.text
    # append start without chain_id, on a non-assistant message, past the end -> 400
    assert chat(dense, conv, chain_append_start=2).status_code == 400
    assert chat(dense, conv, chain_id=cid, chain_append_start=1).status_code == 400
    assert chat(dense, conv, chain_id=cid, chain_append_start=3).status_code == 400
    # busy: a long streaming turn holds the chain
    body = {"messages": conv, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True,
            "chain_id": cid, "chain_append_start": 2}
    resp = requests.post(dense.url + "/v1/chat/completions", json=body, stream=True, timeout=300)
    it = resp.iter_lines()
    first = next(l for l in it if l.startswith(b"data: "))
    assert json.loads(first[6:])["chain_id"] == cid
    r = chat(dense, conv, chain_id=cid, chain_append_start=2)
    assert r.status_code == 409 and r.json()["error"]["code"] == "chain_busy", r.text
    for _ in it:
        pass
    # the full prompt that does not continue the chain: recreated
    r = chat(dense, [{"role": "user", "content": "something else entirely"}], chain_id=cid)
    assert r.status_code == 200 and r.json()["chain_status"] == "recreated"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def n_tokens(srv, text):
    r = requests.post(srv.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    return r.json()["count"]


def test_lru_tombstone_capacity():
    # SmolLM2 f32 KV: 46,080 bytes per token -> 22 MiB holds 500 slots
    S = 500
    srv = Server("--prefix-cache-mode", "chain", "--max-model-len", "400", "--kv-cache-bytes", "22M",
                 "--threads", "2")
    try:
        words = " ".join(["the"] * 90)
        ids, convs = [], []
        for i in range(3):  # three IDLE chains
            conv = [{"role": "user", "content": f"{i} {words}"}]
            r = chat(srv, conv, max_tokens=4)
            assert r.status_code == 200, r.text
            ids.append(r.json()["chain_id"])
            convs.append(conv + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}])
        overhead = r.json()["usage"]["prompt_tokens"] - n_tokens(srv, f"2 {words}")
        # touch chain 0 (append a message): chain 1 becomes the least recently used
        conv0 = convs[0] + [{"role": "user", "content": "more"}]
        r = chat(srv, conv0, max_tokens=4, chain_id=ids[0], chain_append_start=2)
        assert r.status_code == 200 and r.json()["chain_status"] == "resumed", r.text
        used = srv.metrics()["lethe:chain_cache_resident_slots"]
        # a new turn (prompt + max_tokens) that fits once one ~125-slot chain is gone, not before
        need = int(S - used) + 40
        content = " ".join(["the"] * (need - 20 - overhead))
        r = chat(srv, [{"role": "user", "content": content}], max_tokens=20)
        assert r.status_code == 200, r.text
        m = srv.metrics()
        assert m["lethe:chain_cache_reclaimed_total"] == 1, (used, need)
        # the LRU chain (1) is gone: 410; chains 0 and 2 are still known (their
        # append start does not continue them: 409, not 410/404)
        r = chat(srv, [{"role": "user", "content": "x"}], chain_id=ids[1])
        assert r.status_code == 410 and r.json()["error"]["code"] == "chain_gone", r.text
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}] * 3 + \
                [{"role": "user", "content": "u"}]
        for keep in (ids[0], ids[2]):
            r = chat(srv, probe, chain_id=keep, chain_append_start=6)
            assert r.status_code == 409 and r.json()["error"]["code"] == "chain_prefix_mismatch", r.text
        # an ACTIVE turn reserving ~375 slots leaves no room for another ~225 -> 503
        body = {"messages": [{"role": "user", "content": " ".join(["the"] * (275 - overhead))}],
                "max_tokens": 100, "ignore_eos": True, "temperature": 0, "stream": True}
        resp = requests.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=300)
        it = resp.iter_lines()
        next(l for l in it if l.startswith(b"data: "))
        r = chat(srv, [{"role": "user", "content": " ".join(["the"] * 150)}], max_tokens=50)
        assert r.status_code == 503 and r.json()["error"]["code"] == "chain_capacity_unavailable", r.text
        for _ in it:
            pass
        assert srv.metrics()["lethe:chain_cache_capacity_rejected_total"] == 1
    finally:
        srv.stop()
        srv.cleanup()


def test_snapkv_chain_and_replay(tmp_path):
    srv = Server("--sparse-method", "snapkv", "--sparse-config",
                 "sink_keep_tokens=4,recent_keep_tokens=32,decode_keep_tokens=64", "--max-model-len", "2048",
                 "--threads", "2")
    try:
        msgs = [{"role": "user", "content": " ".join(["one two three"] * 60)}]
        r = chat(srv, msgs)
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["chain_status"] == "created"
        cid = j["chain_id"]
        forced = requests.post(srv.url + "/tokenize", json={"prompt": " ok fine", "add_special_tokens": False},
                               timeout=30).json()["tokens"]
        for t in range(3):
            msgs += [{"role": "assistant", "content": j["choices"][0]["message"]["content"]},
                     {"role": "user", "content": " ".join(["tool output"] * 40)}]
            r = chat(srv, msgs, chain_id=cid, chain_append_start=len(msgs) - 1, forced_token_ids=forced,
                     max_tokens=len(forced))
            assert r.status_code == 200, r.text
            j = r.json()
            assert j["chain_status"] == "resumed"
            assert j["choices"][0]["message"]["content"] == " ok fine"
            u = j["usage"]
            # the history before the boundary is reused although SnapKV compacted it
            assert u["prompt_tokens_details"]["cached_tokens"] > u["prompt_tokens"] - 150
        m = srv.metrics()
        # resident KV is the compacted budget (4 + 64 + 32 per layer, 30 layers) plus decoded tokens
        assert m["lethe:chain_cache_resident_slots"] <= 30 * (100 + 8)
        assert m["lethe:chain_cache_resumed_total"] == 3
    finally:
        srv.stop()
        srv.cleanup()
    # the replay benchmark against its own servers on a tiny trace
    out = str(tmp_path / "replay-test.json")
    import subprocess
    p = subprocess.run([BIN, "bench", "replay", "--generate", "--agents", "2", "--min-turns", "3", "--max-turns", "3",
                        "--system-tokens", "20", "--task-tokens", "30", "--tool-min", "20", "--tool-max", "40",
                        "--out-min", "3", "--out-max", "5", "--wait-scale", "0", "--model", MODEL,
                        "--configs", "dense-radix,snapkv-nocache,snapkv-chain", "--port", "18777",
                        "--sparse-config", "sink_keep_tokens=4,recent_keep_tokens=16,decode_keep_tokens=32",
                        "--serve-args", "--threads 2 --max-model-len 1024", "--result-json", out],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    res = {r["config"]: r for r in json.load(open(out))["results"]}
    assert set(res) == {"dense-radix", "snapkv-nocache", "snapkv-chain"}
    for r in res.values():
        assert r["turns_ok"] == r["turns"] == 6
        assert r["output_tokens"] == res["dense-radix"]["output_tokens"]  # forced: identical work
        assert r["prompt_tokens"] == res["dense-radix"]["prompt_tokens"]
    assert res["snapkv-nocache"]["reused_tokens"] == 0
    assert res["snapkv-chain"]["chains_created"] == 2 and res["snapkv-chain"]["chains_resumed"] == 4
    assert res["snapkv-chain"]["computed_prompt_tokens"] < res["snapkv-nocache"]["computed_prompt_tokens"]
    assert res["snapkv-chain"]["server_prefill_tokens_computed"] == res["snapkv-chain"]["computed_prompt_tokens"]


LLAMA3_TOK = next((d for d in (os.path.join(ROOT, "..", "shared", "data", "tokenizers", "llama3"),
                               "/work/shared/data/tokenizers/llama3") if os.path.exists(os.path.join(d, "tokenizer.json"))),
                  None)


def test_replay_dummy_weights_llama3_template(tmp_path):
    """The GPU replay setup in small: dummy llama weights served with text through --tokenizer (Llama-3
    tokenizer and chat template, which trims message content), SnapKV chains append turns."""
    assert LLAMA3_TOK is not None, "Llama-3 tokenizer not found in ../shared/data/tokenizers/llama3 (tests read ../shared)"
    import subprocess
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
           "vocab_size": 128256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "bos_token_id": 128000, "eos_token_id": 128009, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "replay.json"
    p = subprocess.run([BIN, "bench", "replay", "--generate", "--agents", "2", "--min-turns", "3", "--max-turns", "3",
                        "--system-tokens", "40", "--task-tokens", "30", "--tool-min", "20", "--tool-max", "40",
                        "--out-min", "3", "--out-max", "5", "--wait-scale", "0", "--model", str(tmp_path / "config.json"),
                        "--configs", "dense-radix,snapkv-chain", "--port", "18779",
                        "--sparse-config", "sink_keep_tokens=4,recent_keep_tokens=16,decode_keep_tokens=32",
                        "--serve-args", f"--load-format dummy --threads 2 --tokenizer {LLAMA3_TOK} --max-model-len 2048",
                        "--result-json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    res = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    for r in res.values():
        assert r["turns_ok"] == r["turns"] == 6 and "first_error" not in r
        assert r["prompt_tokens"] == res["dense-radix"]["prompt_tokens"]
    assert res["snapkv-chain"]["chains_created"] == 2 and res["snapkv-chain"]["chains_resumed"] == 4
