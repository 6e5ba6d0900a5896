"""Writes the seed corpora of the fuzz harnesses (tests/fuzz/corpus/NAME/):
small valid inputs of each format, so fuzzing starts from the code paths of
real files. Run from the repository root: python3 tests/fuzz/make_seeds.py"""
import json
import os
import shutil
import struct

OUT = os.path.join("tests", "fuzz", "corpus")


def put(name, fname, data):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, fname), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# ---- GGUF v3 ----
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gkv(key, typ, payload):
    return gstr(key) + struct.pack("<I", typ) + payload


def garr(elem_type, items, enc):
    return struct.pack("<IQ", elem_type, len(items)) + b"".join(enc(x) for x in items)


def gguf(kvs, tensors):
    """tensors: (name, ne list, ggml type, raw bytes)"""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs)
    infos, data, off = b"", b"", 0
    for name, ne, typ, raw in tensors:
        infos += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", x) for x in ne)
        infos += struct.pack("<IQ", typ, off)
        pad = (-len(raw)) % 32
        data += raw + b"\0" * pad
        off += len(raw) + pad
    body = head + infos
    body += b"\0" * ((-len(body)) % 32)
    return body + data


U32, I32, F32, BOOL, STR, ARR = 4, 5, 6, 7, 8, 9
toks = ["a", "b", "ab", "\u0120", "\u0120a", "<|im_start|>", "<|im_end|>"] + [chr(0x100 + i) for i in range(8)]
kvs = [
    gkv("general.architecture", STR, gstr("llama")),
    gkv("general.alignment", U32, struct.pack("<I", 32)),
    gkv("llama.context_length", U32, struct.pack("<I", 64)),
    gkv("llama.embedding_length", U32, struct.pack("<I", 8)),
    gkv("llama.block_count", U32, struct.pack("<I", 1)),
    gkv("llama.feed_forward_length", U32, struct.pack("<I", 16)),
    gkv("llama.attention.head_count", U32, struct.pack("<I", 2)),
    gkv("llama.attention.head_count_kv", U32, struct.pack("<I", 1)),
    gkv("llama.rope.freq_base", F32, struct.pack("<f", 10000.0)),
    gkv("llama.attention.layer_norm_rms_epsilon", F32, struct.pack("<f", 1e-5)),
    gkv("tokenizer.ggml.model", STR, gstr("gpt2")),
    gkv("tokenizer.ggml.pre", STR, gstr("smollm")),
    gkv("tokenizer.ggml.tokens", ARR, garr(STR, toks, gstr)),
    gkv("tokenizer.ggml.token_type", ARR, garr(I32, [1] * 5 + [3, 3] + [1] * 8, lambda x: struct.pack("<i", x))),
    gkv("tokenizer.ggml.merges", ARR, garr(STR, ["a b", "\u0120 a"], gstr)),
    gkv("tokenizer.ggml.bos_token_id", U32, struct.pack("<I", 5)),
    gkv("tokenizer.ggml.eos_token_id", U32, struct.pack("<I", 6)),
    gkv("tokenizer.ggml.add_bos_token", BOOL, b"\0"),
    gkv("tokenizer.chat_template", STR, gstr("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")),
]
f32 = struct.pack("<8f", *[0.5 * i for i in range(8)])
q4_0 = struct.pack("<e", 0.25) + bytes(range(16))  # one block of 32
put("fuzz_gguf", "tiny-llama.gguf", gguf(kvs, [("token_embd.weight", [8], 0, f32), ("blk.0.ffn_up.weight", [32], 2, q4_0)]))
put("fuzz_gguf", "metadata-only.gguf", gguf(kvs[:3], []))

# ---- safetensors ----
def st(tensors, meta=None):
    hdr, data = {}, b""
    if meta:
        hdr["__metadata__"] = meta
    for name, dtype, shape, raw in tensors:
        hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(hdr).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


put("fuzz_safetensors", "mixed.safetensors", st([
    ("a.weight", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)),
    ("b.bias", "BF16", [3], b"\x80\x3f\x00\x40\x40\x40"),
    ("c", "F16", [2], b"\x00\x3c\x00\x40"),
    ("d", "I64", [1], struct.pack("<q", 7)),
    ("empty", "F32", [0], b""),
], {"format": "pt"}))
if os.path.exists("tests/data/st/tiny.safetensors"):
    shutil.copy("tests/data/st/tiny.safetensors", os.path.join(OUT, "fuzz_safetensors", "tiny.safetensors"))

# ---- tokenizer.json ----
vocab = {"\u0120": 0, "a": 1, "b": 2, "\u0120a": 3, "\u0120ab": 4, "-": 5}
put("fuzz_tokenizer_json", "bytelevel.json", json.dumps({
    "model": {"type": "BPE", "vocab": vocab, "merges": [["\u0120", "a"], "\u0120a b"]},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "ByteLevel", "add_prefix_space": True, "use_regex": False},
        {"type": "Split", "pattern": {"String": "-"}, "behavior": "Isolated"}]},
    "added_tokens": [{"id": 6, "content": "<x>", "special": True, "rstrip": True}]}))
byte_vocab = {chr(c) if 33 <= c <= 126 else chr(0x100 + c): i for i, c in enumerate(range(256))}
put("fuzz_tokenizer_json", "regex-nfc.json", json.dumps({
    "normalizer": {"type": "NFC"},
    "model": {"type": "BPE", "vocab": byte_vocab, "merges": ["h e", "l l"], "ignore_merges": False,
              "unk_token": None},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(?i:'s|'t)|\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+|\\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
    "decoder": {"type": "ByteLevel"},
    "added_tokens": [{"id": 256, "content": "<|im_start|>", "special": True, "lstrip": False, "rstrip": False},
                     {"id": 257, "content": "<tool>", "special": False}]}))

# ---- tokenize (arbitrary bytes) ----
put("fuzz_tokenize", "ascii.txt", "The quick brown fox jumps over the lazy dog. 1234567890\n\tEnd.")
put("fuzz_tokenize", "utf8.txt", "caf\u00e9 \u65e5\u672c\u8a9e \U0001F600 \u0645\u0631\u062d\u0628\u0627 e\u0301")
put("fuzz_tokenize", "bytes.bin", bytes(range(256)))
put("fuzz_tokenize", "special.txt", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>")

# ---- OpenAI requests (first byte: 0 completion, 1 chat, 2 tokenize, 3 detokenize) ----
reqs = [
    (0, {"prompt": "Hello", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "stop": ["\n", "."], "seed": 3,
         "logprobs": 2, "stream": True, "stream_options": {"include_usage": True}}),
    (0, {"prompt": [1, 2, 3], "max_tokens": 2, "stop_token_ids": [2], "ignore_eos": True}),
    (0, {"prompt": ["one"], "forced_token_ids": [5, 6], "chain_id": None}),
    (1, {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 3}),
    (1, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                      {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}],
         "chain_id": "chain_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "chain_append_start": 2}),
    (1, {"messages": [{"role": "user", "content": "weather?"}],
         "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]}),
    (2, {"prompt": "Hello world", "add_special_tokens": False}),
    (2, {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True}),
    (3, {"tokens": [1, 2, 3, 100]}),
]
for i, (kind, body) in enumerate(reqs):
    put("fuzz_openai", f"req{i}.bin", bytes([kind]) + json.dumps(body).encode())

# ---- chat template: byte 0 format, byte 1 options, then NUL-separated role/content ----
convs = [
    (0, 3, ["system", "You are kind.", "user", "Hi"]),
    (2, 1, ["user", "Hello", "assistant", "Hi there", "user", "Bye"]),
    (3, 5, ["user", "Think", "assistant", "<think>hmm</think>ok", "user", "more"]),
    (5, 9, ["user", "weather", "assistant", '[{"id":"c1","type":"function","function":{"name":"get","arguments":{"city":"Paris"}}}]',
            "tool", "{\"temp\": 20}", 'T[{"type":"function","function":{"name":"get","parameters":{}}}]']),
    (4, 1, ["user", "hi", 'T[{"type":"function","function":{"name":"f","description":"d"}}]']),
]
for i, (fmt, bits, parts) in enumerate(convs):
    put("fuzz_chat_template", f"conv{i}.bin", bytes([fmt, bits]) + b"\0".join(p.encode() for p in parts))
