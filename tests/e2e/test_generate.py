"""`lethe generate`: one-shot (chat-wrapped and --raw), a JSONL batch, flags.

The batch runs through the batching engine; results must come back one line
per input line, in input order, with the same greedy tokens a one-request
run gives (batching must not change outputs), rejected lines reported with
an error instead of aborting the batch, and timing on stderr.
"""
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")
SMOL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
TINY = os.path.join(ROOT, "tests", "data", "tiny-llama")


def run(args, stdin=None, timeout=300):
    return subprocess.run([LETHE, "generate", *args], input=stdin, capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def test_help_lists_flags():
    r = run(["--help"])
    assert r.returncode == 0
    for flag in ["--prompt", "--chat", "--raw", "--system", "--seed", "--input", "--output",
                 "--max-num-seqs", "--temperature", "--sparse-method"]:
        assert flag in r.stdout


def test_needs_a_prompt():
    r = run(["--model", TINY, "--input", "x.jsonl", "--chat"])
    assert r.returncode == 2 and "cannot be combined" in r.stderr


def test_one_shot_chat_prompt():
    r = run(["--model", SMOL, "-p", "What is the capital of France?", "--temperature", "0",
             "-n", "12", "--max-model-len", "512"])
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr and "prompt:" in r.stderr and "generation:" in r.stderr


def test_raw_prompt_and_stop_string():
    r = run(["--model", SMOL, "-p", "The capital of France is", "--raw", "--temperature", "0",
             "-n", "16", "--stop", ".", "--max-model-len", "512"])
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "." not in r.stdout  # the stop string is not part of the output
    assert "finish: stop" in r.stderr


def batch_lines(tmp_path, lines):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    dst = tmp_path / "out.jsonl"
    return src, dst


def test_batch_token_ids_in_order(tmp_path):
    """tiny-llama (no tokenizer): prompt_token_ids lines, order kept, same tokens as alone."""
    prompts = [[(7 * i + k) % 256 for k in range(5 + 9 * i)] for i in range(8)]
    lines = [json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": 4 + i, "temperature": 0})
             for i, p in enumerate(prompts)]
    lines.insert(3, "{not json")
    lines.insert(5, json.dumps({"prompt": "text needs a tokenizer"}))
    src, dst = batch_lines(tmp_path, lines)
    r = run(["--model", TINY, "--input", str(src), "--output", str(dst),
             "--max-num-batched-tokens", "32"])
    assert r.returncode == 0, r.stderr
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["index"] for o in out] == list(range(10))
    assert out[3]["finish_reason"] == "error" and "line 4" in out[3]["error"]
    assert out[5]["finish_reason"] == "error" and "tokenizer" in out[5]["error"]
    good = [o for o in out if o["finish_reason"] != "error"]
    assert [o["id"] for o in good] == list(range(8))
    for i, o in enumerate(good):
        assert o["usage"]["prompt_tokens"] == len(prompts[i])
        assert len(o["token_ids"]) == o["usage"]["completion_tokens"]
        assert o["finish_reason"] in ("length", "stop")
    assert "10 requests (2 rejected)" in r.stderr
    # each request alone gives the same tokens
    for i in (0, 4, 7):
        src1, dst1 = batch_lines(tmp_path, [lines[[0, 1, 2, 4, 6, 7, 8, 9][i]]])
        r1 = run(["--model", TINY, "--input", str(src1), "--output", str(dst1)])
        assert r1.returncode == 0, r1.stderr
        assert json.loads(dst1.read_text())["token_ids"] == good[i]["token_ids"]


def test_batch_text_and_messages(tmp_path):
    lines = [
        json.dumps({"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}),
        json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 10, "temperature": 0}),
        json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 10, "temperature": 0, "stop": ["Paris"]}),
    ]
    src, dst = batch_lines(tmp_path, lines)
    r = run(["--model", SMOL, "--input", str(src), "--output", str(dst), "--max-model-len", "512"])
    assert r.returncode == 0, r.stderr
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(out) == 3
    assert "Paris" in out[0]["text"]
    assert "Paris" in out[1]["text"]
    assert out[2]["finish_reason"] == "stop" and "Paris" not in out[2]["text"]
    assert out[2]["text"] == out[1]["text"][:len(out[2]["text"])]


def test_chat_repl_multi_turn():
    """Two turns on stdin: the second sees the first (history through the chat template)."""
    turns = "My name is Ada. Reply with one short sentence.\nWhat is my name?\n/exit\n"
    r = run(["--model", SMOL, "--chat", "--temperature", "0", "-n", "24", "--max-model-len", "1024",
             "--system", "You are a helpful assistant."], stdin=turns)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("generation:") == 2
    assert "Ada" in r.stdout.split("\n", 1)[-1] or "Ada" in r.stdout
    # the second turn's prompt starts with the first turn: served from the prefix cache
    second = [l for l in r.stderr.splitlines() if "prompt:" in l][1]
    assert "(0 cached)" not in second


def test_prompt_from_stdin():
    r = run(["--model", TINY, "--raw", "-n", "3"], stdin="")
    # tiny-llama has no tokenizer: a text prompt is refused with a clear message
    assert r.returncode != 0
    assert "tokenizer" in r.stderr


def read_ref(path):
    """tests/data/hf-ref/*.bin named arrays (format in tests/gen/gen_model_fixtures.py)."""
    import struct
    import numpy as np
    buf = open(path, "rb").read()
    assert buf[:8] == b"LTHREF01"
    (n,), off, out = struct.unpack_from("<I", buf, 8), 12, {}
    for _ in range(n):
        (nl,) = struct.unpack_from("<I", buf, off)
        name = buf[off + 4:off + 4 + nl].decode()
        off += 4 + nl
        dtype, ndim = struct.unpack_from("<II", buf, off)
        shape = struct.unpack_from(f"<{ndim}I", buf, off + 8)
        off += 8 + 4 * ndim
        count = int(np.prod(shape))
        out[name] = np.frombuffer(buf, dtype="<f4" if dtype == 0 else "<i4", count=count,
                                  offset=off).reshape(shape)
        off += 4 * count
    return out


def test_dump_logits_forced_matches_hf(tmp_path):
    """forced_token_ids + --dump-logits: the logits of a known continuation, in
    input order, equal transformers' (fp32 CPU reference fixture) at those
    positions; the three sequences run as one ragged batch (the CUDA twin of
    this check is tests/gpu/test_hf_logits.py)."""
    import numpy as np
    ref = read_ref(os.path.join(ROOT, "tests", "data", "hf-ref", "tiny-llama.bin"))
    seqs = [ref[f"seq{s}.tokens"].tolist() for s in range(3)]
    lines = [json.dumps({"prompt_token_ids": s[:len(s) // 2], "forced_token_ids": s[len(s) // 2:]})
             for s in seqs]
    src, dst = batch_lines(tmp_path, lines)
    dump = tmp_path / "logits.bin"
    r = run(["--model", TINY, "--input", str(src), "--output", str(dst), "--dump-logits", str(dump),
             "--enforce-eager"])
    assert r.returncode == 0, r.stderr
    assert "graph replays" in r.stderr
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    raw = np.fromfile(dump, dtype="<f4").reshape(-1, 256)
    off = 0
    for s, o, k in zip(seqs, out, range(3)):
        h = len(s) // 2
        assert o["token_ids"] == s[h:]
        want = ref[f"seq{k}.logits"][h - 1:len(s) - 1]
        got = raw[off:off + len(s) - h]
        off += len(s) - h
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert off == raw.shape[0]
    r = run(["--model", TINY, "-p", "x", "--dump-logits", str(dump)])
    assert r.returncode == 2 and "needs --input" in r.stderr


def test_help_has_graph_flags():
    r = run(["--help"])
    assert "--enforce-eager" in r.stdout and "--dump-logits" in r.stdout
