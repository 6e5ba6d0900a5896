"""model_np.py - a float64 numpy forward of the Llama / Qwen2 fixture
checkpoints (tests/data/tiny-*), with a KV cache whose rows a method may cut
per layer and per KV head, for the paper references in tests/ref.

Written from the architecture definitions (RMSNorm, RoPE with the rotate-half
pairing and llama3 frequency scaling, grouped-query attention, SwiGLU MLP),
not from lethe's C code. Keys are cached after RoPE at their original
positions (methods.md §2.4: nothing is re-rotated after eviction).

    m = Model("tests/data/tiny-llama")
    c = Cache(m)
    out = m.forward(c, tokens, positions)   # appends to the cache; every query
                                            # reads the kept entries + causal new
    out.q[l]  [T, H, d] post-RoPE queries   out.hidden  [T, D] last layer output
    c.k[l]    [n, Hk, d] post-RoPE keys     c.keep[l]   [Hk, n] bool (kept per head)
"""
import json
import os
import struct

import numpy as np

_DT = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64}


def load_safetensors(path):
    """{name: float64 array} of a .safetensors file (header JSON + raw data)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = data[a:b]
        if t["dtype"] == "BF16":
            u = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=_DT[t["dtype"]])
        out[name] = arr.astype(np.float64).reshape(t["shape"])
    return out


def rope_inv_freq(cfg, d):
    rp = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rp.get("rope_theta", 10000.0))
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    sc = cfg.get("rope_scaling") or (rp if rp.get("rope_type") == "llama3" else None)
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv
        lo_wl, hi_wl = old / lo, old / hi
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > lo_wl, inv / factor, inv)
        mid = (wavelen <= lo_wl) & (wavelen >= hi_wl)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv


def rope(x, pos, inv, adjacent=False):
    """x [T, n, d] rotated at positions pos [T]: rotate-half pairing (HF
    checkpoints: dims i and i + d/2), or adjacent pairs (2i, 2i + 1: GGUF,
    whose converter permutes the q / k rows for it)."""
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]  # [T, d/2]
    if adjacent:
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + rot * sin


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


_GGUF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def load_gguf_llama(path):
    """(config, weights) of a llama-architecture GGUF with HF weight names"""
    from gguf_np import Reader
    r = Reader(path)
    a = r.meta["general.architecture"]
    assert a == "llama", a
    cfg = {"num_hidden_layers": r.meta["llama.block_count"], "hidden_size": r.meta["llama.embedding_length"],
           "num_attention_heads": r.meta["llama.attention.head_count"],
           "num_key_value_heads": r.meta["llama.attention.head_count_kv"],
           "rms_norm_eps": r.meta["llama.attention.layer_norm_rms_epsilon"],
           "rope_theta": r.meta["llama.rope.freq_base"], "vocab_size": r.meta.get("llama.vocab_size"),
           "head_dim": r.meta["llama.rope.dimension_count"], "rope_adjacent": True}
    w = {"model.embed_tokens.weight": r.tensor("token_embd.weight"), "model.norm.weight": r.tensor("output_norm.weight")}
    if "output.weight" in r.tensors:
        w["lm_head.weight"] = r.tensor("output.weight")
    for name in r.tensors:
        if name.startswith("blk."):
            _, l, part, kind = name.split(".")
            w[f"model.layers.{l}.{_GGUF_NAMES[part]}.{kind}"] = r.tensor(name)
    cfg["vocab_size"] = cfg["vocab_size"] or w["model.embed_tokens.weight"].shape[0]
    return cfg, w


class Model:
    def __init__(self, folder, dtype=np.float64):
        """folder: an HF checkpoint folder (config.json + model.safetensors) or a .gguf file"""
        if folder.endswith(".gguf"):
            self.cfg, w = load_gguf_llama(folder)
        else:
            with open(os.path.join(folder, "config.json")) as f:
                self.cfg = json.load(f)
            w = load_safetensors(os.path.join(folder, "model.safetensors"))
        cfg = self.cfg
        self.w = {k: v.astype(dtype) for k, v in w.items()}
        self.adjacent = cfg.get("rope_adjacent", False)
        self.L = cfg["num_hidden_layers"]
        self.H = cfg["num_attention_heads"]
        self.Hk = cfg["num_key_value_heads"]
        self.D = cfg["hidden_size"]
        self.d = cfg.get("head_dim") or self.D // self.H
        self.eps = cfg["rms_norm_eps"]
        self.inv = rope_inv_freq(cfg, self.d)
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def p(self, l, name):
        return self.w[f"model.layers.{l}.{name}"]

    def proj(self, x, l, name):
        y = x @ self.p(l, name + ".weight").T
        b = self.w.get(f"model.layers.{l}.{name}.bias")
        return y if b is None else y + b

    def forward(self, cache, tokens, pos, select=None):
        """Appends tokens (positions pos) to the cache; each new query reads the
        cache's kept entries of its KV head plus the new tokens causally.
        select(l, q [T, H, d]) may return a [Hk, n] mask narrowing what this
        call reads of the n entries cached before it in layer l (a selection
        method; nothing is freed). Returns Out with q[l] [T, H, d], hidden
        [T, D] (the last layer's output), logits [T, V] and reads[l] [Hk, n + T]
        (the entries the last new token read)."""
        T, H, Hk, d = len(tokens), self.H, self.Hk, self.d
        g = H // Hk
        x = self.w["model.embed_tokens.weight"][np.asarray(tokens)]
        qs, reads = [], []
        for l in range(self.L):
            h = rmsnorm(x, self.p(l, "input_layernorm.weight"), self.eps)
            q = self.proj(h, l, "self_attn.q_proj").reshape(T, H, d)
            k = self.proj(h, l, "self_attn.k_proj").reshape(T, Hk, d)
            v = self.proj(h, l, "self_attn.v_proj").reshape(T, Hk, d)
            if f"model.layers.{l}.self_attn.q_norm.weight" in self.w:  # qwen3
                q = rmsnorm(q, self.p(l, "self_attn.q_norm.weight"), self.eps)
                k = rmsnorm(k, self.p(l, "self_attn.k_norm.weight"), self.eps)
            q, k = rope(q, pos, self.inv, self.adjacent), rope(k, pos, self.inv, self.adjacent)
            qs.append(q)
            n0 = cache.n(l)
            narrow = select(l, q) if select else None
            cache.append(l, k, v, pos)
            K, V, keep = cache.k[l], cache.v[l], cache.keep[l].copy()  # [n, Hk, d], [Hk, n]
            if narrow is not None:
                keep[:, :n0] &= narrow
            reads.append(keep)
            o = np.zeros((T, H, d), dtype=x.dtype)
            for t0 in range(0, T, 512):  # query rows in blocks: no T x n matrix per head
                t1 = min(T, t0 + 512)
                vis = np.broadcast_to(keep[:, None, :], (Hk, t1 - t0, keep.shape[1])).copy()
                causal = np.arange(keep.shape[1])[None, :] > (n0 + np.arange(t0, t1))[:, None]
                vis[:, causal] = False  # new token t sees the new tokens <= t
                for qh in range(H):
                    kh = qh // g
                    z = (q[t0:t1, qh, :] @ K[:, kh, :].T) / np.sqrt(d)  # [rows, n]
                    z = np.where(vis[kh], z, -np.inf)
                    o[t0:t1, qh, :] = softmax(z) @ V[:, kh, :]
            x = x + o.reshape(T, H * d) @ self.p(l, "self_attn.o_proj.weight").T
            h = rmsnorm(x, self.p(l, "post_attention_layernorm.weight"), self.eps)
            gt = h @ self.p(l, "mlp.gate_proj.weight").T
            up = h @ self.p(l, "mlp.up_proj.weight").T
            x = x + (gt / (1 + np.exp(-gt)) * up) @ self.p(l, "mlp.down_proj.weight").T
        out = Out()
        out.q, out.hidden, out.reads = qs, x, reads
        out.logits = rmsnorm(x, self.w["model.norm.weight"], self.eps) @ self.lm_head.T
        return out


class Out:
    pass


class _Views:
    """c.k[l] etc.: the first n[l] rows (columns for keep) of a layer's buffer"""

    def __init__(self, cache, name):
        self.c, self.name = cache, name

    def __getitem__(self, l):
        buf, n = getattr(self.c, "_" + self.name)[l], self.c._n[l]
        return buf[:, :n] if self.name == "keep" else buf[:n]

    def __setitem__(self, l, value):
        self[l][...] = value


class Cache:
    """Per layer: every entry ever appended (k, v, pos) and a per-KV-head keep
    mask; a method cuts entries per head by clearing keep bits, truncate()
    forgets the last entries (an auxiliary prefill's replay). Buffers grow
    by doubling, so a decode step does not copy the cache."""

    def __init__(self, m):
        self.m = m
        self._n = [0] * m.L
        self._k = [np.zeros((0, m.Hk, m.d)) for _ in range(m.L)]
        self._v = [np.zeros((0, m.Hk, m.d)) for _ in range(m.L)]
        self._pos = [np.zeros(0, dtype=np.int64) for _ in range(m.L)]
        self._keep = [np.zeros((m.Hk, 0), dtype=bool) for _ in range(m.L)]
        self.k, self.v, self.pos, self.keep = (_Views(self, x) for x in ("k", "v", "pos", "keep"))

    def n(self, l):
        return self._n[l]

    def append(self, l, k, v, pos):
        n, t = self._n[l], len(pos)
        if n + t > len(self._pos[l]):
            cap = max(n + t, 2 * len(self._pos[l]))
            def grow(b, axis, dtype):
                shape = list(b.shape)
                shape[axis] = cap
                out = np.zeros(shape, dtype=dtype)
                if axis == 0:
                    out[:n] = b[:n]
                else:
                    out[:, :n] = b[:, :n]
                return out
            self._k[l] = grow(self._k[l], 0, k.dtype)
            self._v[l] = grow(self._v[l], 0, v.dtype)
            self._pos[l] = grow(self._pos[l], 0, np.int64)
            self._keep[l] = grow(self._keep[l], 1, bool)
        self._k[l][n:n + t] = k
        self._v[l][n:n + t] = v
        self._pos[l][n:n + t] = pos
        self._keep[l][:, n:n + t] = True
        self._n[l] = n + t

    def truncate(self, n):
        for l in range(self.m.L):
            self._n[l] = min(self._n[l], n)

    def kept_positions(self, l, head=None):
        """ascending positions kept in layer l (by any head, or by `head`)"""
        m = self.keep[l].any(axis=0) if head is None else self.keep[l][head]
        return self.pos[l][m]
