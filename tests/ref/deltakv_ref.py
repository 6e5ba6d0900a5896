"""DeltaKV (methods.md §13) in numpy, float64: the reference the C method
(src/sparse/deltakv.c) is compared with (test_deltakv_ref.py).

What it implements, step by step as the paper and SparseEngine describe it
with lethe's stated choices:
- x_t = [k_t ; v_t] with k before RoPE; sink tokens [0, s) stay raw;
- new tokens join an uncompressed buffer; after every step (SE), when the
  buffer holds more than r tokens its oldest floor((len - r) / r) r tokens are
  compressed as one block: every stride-th block token (from the block's
  first) is a center and stays raw; every other token t gets the K nearest
  centers among the sinks and centers before t (ranking 2 x.c - |c|^2, ties
  to the earlier one; fewer than K candidates repeat the best ones), base_t =
  their mean, and z_t = Down (x_t - base_t);
- reads reconstruct x^_t = Up z_t + base_t and rotate the key part at t;
- decode: the full layer before a DeltaKV layer scores the compressed
  candidates [s, b0) with the current query (per head softmax over the
  candidates, max over heads) and keeps the top K (ties to the lower index);
  DeltaKV layers read sink + top-K + buffer; prefill reads everything;
- attention: softmax(q.k / sqrt(d)) per query head (GQA), causal.
"""
import json
import struct

import numpy as np


def rope(x, pos, theta=10000.0):
    """HF rotate-half RoPE of x [n, heads, d] at positions pos [n]"""
    d = x.shape[-1]
    half = d // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / d)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def attend(q, keys, vals, qpos, kpos, n_kv):
    """q [n, H, d] (rotated), keys / vals [m, n_kv, d], causal by positions"""
    n, H, d = q.shape
    g = H // n_kv
    out = np.zeros((n, H, d))
    for i in range(n):
        ok = kpos <= qpos[i]
        for h in range(H):
            kh = h // g
            z = keys[ok, kh, :] @ q[i, h] / np.sqrt(d)
            p = np.exp(z - z.max())
            p /= p.sum()
            out[i, h] = p @ vals[ok, kh, :]
    return out


class Layer:
    def __init__(self):
        self.x = []          # raw x per position (None once latent)
        self.state = []      # 0 buffer, 1 raw center / sink, 2 latent
        self.fathers = []    # positions
        self.z = []


class DeltaKV:
    def __init__(self, n_layers, H, HK, d, s, r, stride, K, keep, full, down, up):
        self.H, self.HK, self.d, self.s, self.r, self.stride, self.K, self.keep = H, HK, d, s, r, stride, K, keep
        self.full, self.down, self.up = full, down, up
        self.layers = [Layer() for _ in range(n_layers)]
        self.keys = [[] for _ in range(n_layers)]  # full layers: rotated keys
        self.vals = [[] for _ in range(n_layers)]

    def x_hat(self, l, t):
        L = self.layers[l]
        if L.state[t] != 2:
            return L.x[t]
        base = np.mean([L.x[f] for f in L.fathers[t]], axis=0)
        return self.up[l] @ L.z[t] + base

    def step(self, first, qs, ks, vs, decode):
        """one step: per layer q [n, H, d], k / v [n, HK d] (k before RoPE); returns outputs per layer"""
        n, kvd = ks[0].shape[0], self.HK * self.d
        pos = np.arange(first, first + n)
        outs, picks = [], None
        for l in range(len(self.layers)):
            q = rope(qs[l].reshape(n, self.H, self.d), pos)
            if self.full[l]:
                for t in range(n):
                    self.keys[l].append(rope(ks[l][t].reshape(1, self.HK, self.d), [first + t])[0])
                    self.vals[l].append(vs[l][t].reshape(self.HK, self.d))
                K, V = np.array(self.keys[l]), np.array(self.vals[l])
                kpos = np.arange(len(K))
                outs.append(attend(q, K, V, pos, kpos, self.HK).reshape(n, -1))
                nxt = l + 1 < len(self.layers) and not self.full[l + 1]
                if decode and nxt:
                    picks = self.select(q[-1], K)
                continue
            Ly = self.layers[l]
            for t in range(n):
                Ly.x.append(np.concatenate([ks[l][t], vs[l][t]]))
                Ly.state.append(1 if first + t < self.s else 0)
                Ly.fathers.append(None)
                Ly.z.append(None)
            Ltot = len(Ly.x)
            if decode and picks is not None:
                b0 = self.buffer_start(l)
                read = list(range(min(self.s, Ltot))) + list(picks) + list(range(b0, Ltot))
            else:
                read = list(range(Ltot))
            X = np.array([self.x_hat(l, t) for t in read])
            Kr = rope(X[:, :kvd].reshape(-1, self.HK, self.d), read)
            Vr = X[:, kvd:].reshape(-1, self.HK, self.d)
            outs.append(attend(q, Kr, Vr, pos, np.array(read), self.HK).reshape(n, -1))
        for l in range(len(self.layers)):
            if not self.full[l]:
                self.compress(l)
        return outs

    def buffer_start(self, l):
        st = self.layers[l].state
        b = len(st)
        while b > 0 and st[b - 1] == 0:
            b -= 1
        return b

    def select(self, q_last, K):
        """OmniKV at the full layer: per head softmax over [s, b0), max over heads, top keep"""
        dl = next(i for i in range(len(self.layers)) if not self.full[i])
        b0 = self.buffer_start(dl)
        c0, c1 = self.s, b0
        if c1 - c0 <= self.keep:
            return None
        g = self.H // self.HK
        best = np.full(c1 - c0, -np.inf)
        for h in range(self.H):
            z = K[c0:c1, h // g, :] @ q_last[h] / np.sqrt(self.d)
            p = np.exp(z - z.max())
            p /= p.sum()
            best = np.maximum(best, p)
        order = sorted(range(c1 - c0), key=lambda i: (-best[i], i))[: self.keep]
        return sorted(c0 + i for i in order)

    def compress(self, l):
        Ly = self.layers[l]
        b0 = self.buffer_start(l)
        nb = len(Ly.x) - b0
        if nb <= self.r:
            return
        b1 = b0 + (nb - self.r) // self.r * self.r
        for e in range(b0, b1, self.stride):
            Ly.state[e] = 1
        cand = [e for e in range(b1) if Ly.state[e] == 1]
        for t in range(b0, b1):
            if Ly.state[t] != 0:
                continue
            x = Ly.x[t]
            ranked = sorted((c for c in cand if c < t), key=lambda c: (-(2 * x @ Ly.x[c] - Ly.x[c] @ Ly.x[c]), c))
            best = ranked[: self.K]
            fathers = [best[k % len(best)] for k in range(self.K)]
            base = np.mean([Ly.x[f] for f in fathers], axis=0)
            Ly.z[t] = self.down[l] @ (x - base)
            Ly.fathers[t] = fathers
        for t in range(b0, b1):
            if Ly.state[t] == 0:
                Ly.state[t] = 2
        # the raw x of latent tokens is dropped (x_hat reads z and the fathers)
        for t in range(b0, b1):
            if Ly.state[t] == 2:
                Ly.x[t] = None


def write_compressor(folder, n_layers, n_kv_heads, head_dim, down, up):
    """deltakv.json + deltakv.safetensors (the format src/sparse/deltakv.c reads)"""
    latent = down[0].shape[0]
    meta = {"format": "lethe-deltakv-1", "n_layers": n_layers, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
            "latent": latent}
    (folder / "deltakv.json").write_text(json.dumps(meta))
    header, blobs, off = {"__metadata__": {"format": "lethe-deltakv-1"}}, [], 0
    for l in range(n_layers):
        for name, w in (("down", down[l]), ("up", up[l])):
            b = np.ascontiguousarray(w, dtype="<f4").tobytes()
            header[f"layers.{l}.{name}"] = {"dtype": "F32", "shape": list(w.shape), "data_offsets": [off, off + len(b)]}
            blobs.append(b)
            off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    (folder / "deltakv.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read_dump(path):
    """test_deltakv --dump: header, then per step and layer q, k, v (before RoPE), out"""
    raw = open(path, "rb").read()
    NL, H, HK, d, s, r, stride, K, keep = struct.unpack_from("<9i", raw, 0)
    o, steps = 36, []
    while o < len(raw):
        n, first = struct.unpack_from("<2i", raw, o)
        o += 8
        layers = []
        for _ in range(NL):
            q = np.frombuffer(raw, "<f4", n * H * d, o).reshape(n, H * d); o += 4 * n * H * d
            k = np.frombuffer(raw, "<f4", n * HK * d, o).reshape(n, HK * d); o += 4 * n * HK * d
            v = np.frombuffer(raw, "<f4", n * HK * d, o).reshape(n, HK * d); o += 4 * n * HK * d
            out = np.frombuffer(raw, "<f4", n * H * d, o).reshape(n, H * d); o += 4 * n * H * d
            layers.append((q, k, v, out))
        steps.append((n, first, layers))
    return dict(NL=NL, H=H, HK=HK, d=d, s=s, r=r, stride=stride, K=K, keep=keep), steps
