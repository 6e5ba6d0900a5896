"""gguf_np.py - reads a GGUF file's metadata and tensors into numpy (F32, F16,
Q4_1, Q8_0 dequantized to float32), from the GGUF format
description (header, key/value metadata, tensor infos, aligned data), for the
references' runs on models/SmolLM2-135M-Instruct.Q4_1.gguf."""
import struct

import numpy as np

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class Reader:
    def __init__(self, path):
        self.f = open(path, "rb")
        self.buf = self.f.read()
        self.o = 0
        assert self.take(4) == b"GGUF", "not a GGUF file"
        self.version = self.u32()
        n_tensors, n_kv = self.u64(), self.u64()
        self.meta = {}
        for _ in range(n_kv):
            k = self.str()
            self.meta[k] = self.value(self.u32())
        self.tensors = {}
        for _ in range(n_tensors):
            name = self.str()
            nd = self.u32()
            dims = [self.u64() for _ in range(nd)]
            typ = self.u32()
            off = self.u64()
            self.tensors[name] = (dims, typ, off)
        align = self.meta.get("general.alignment", 32)
        self.data = (self.o + align - 1) // align * align

    def take(self, n):
        b = self.buf[self.o:self.o + n]
        self.o += n
        return b

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def u64(self):
        return struct.unpack("<Q", self.take(8))[0]

    def str(self):
        return self.take(self.u64()).decode("utf-8", "replace")

    def value(self, t):
        if t in _SCALAR:
            fmt = _SCALAR[t]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        if t == 8:
            return self.str()
        if t == 9:
            et, n = self.u32(), self.u64()
            return [self.value(et) for _ in range(n)]
        raise ValueError(f"gguf value type {t}")

    def tensor(self, name):
        """float32 array with numpy shape reversed from GGUF dims ([rows, cols])"""
        dims, typ, off = self.tensors[name]
        n = int(np.prod(dims))
        b = memoryview(self.buf)[self.data + off:]
        if typ == 0:
            x = np.frombuffer(b, dtype="<f4", count=n).copy()
        elif typ == 1:
            x = np.frombuffer(b, dtype="<f2", count=n).astype(np.float32)
        elif typ in (3, 8):  # Q4_1, Q8_0: blocks of 32
            nb = n // 32
            if typ == 3:
                blk = np.frombuffer(b, dtype=np.dtype([("d", "<f2"), ("m", "<f2"), ("q", "u1", 16)]), count=nb)
                q = np.concatenate([blk["q"] & 15, blk["q"] >> 4], axis=1).astype(np.float32)
                x = (q * blk["d"].astype(np.float32)[:, None] + blk["m"].astype(np.float32)[:, None]).reshape(-1)
            else:
                blk = np.frombuffer(b, dtype=np.dtype([("d", "<f2"), ("q", "i1", 32)]), count=nb)
                x = (blk["q"].astype(np.float32) * blk["d"].astype(np.float32)[:, None]).reshape(-1)
        else:
            raise ValueError(f"{name}: gguf tensor type {typ} not handled")
        return x.reshape(list(reversed(dims)))


def tokenizer_of(path):
    """byte-level BPE from a GGUF's vocabulary and merges (the tokenizers
    package), digits split one by one as SmolLM2's pre-tokenizer does"""
    from tokenizers import Tokenizer, models, pre_tokenizers
    r = Reader(path)
    toks, merges = r.meta["tokenizer.ggml.tokens"], r.meta["tokenizer.ggml.merges"]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=[tuple(m.split(" ", 1)) for m in merges])
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return tk


def token_texts(path):
    """the bytes of every token (byte-level BPE strings mapped back to bytes)"""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    inv = {chr(c): b for b, c in zip(bs, cs)}
    return [bytes(inv.get(ch, 63) for ch in t) for t in Reader(path).meta["tokenizer.ggml.tokens"]]
