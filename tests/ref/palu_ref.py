"""Palu (methods.md §14) in numpy, float64, as the paper states it: the
reference `lethe fit palu` (tools/fit_palu.c) and the palu method
(src/sparse/palu.c) are compared with (test_palu_ref.py).

What it implements:
- calibration: the inputs X [N, D] of every layer's k_proj / v_proj (the
  normed hidden states) over the calibration windows, from the numpy model
  (model_np.py) running densely;
- whitened SVD per layer and group of gs KV heads (G-LRD): the group's
  projection W [gs hd, D] (with a bias b, the affine map [W b] on [x; 1]) is
  factored as W S = U Sigma V^T with S the Cholesky factor of X^T X
  (S S^T = X^T X), rank r kept: L = U_r Sigma_r^(1/2) [gs hd, r] (the
  reconstruction), R = Sigma_r^(1/2) V_r^T S^-1 [r, D] (the latent h = R x);
  so W x ~ L R x with the truncation error measured on the calibration
  inputs (whitening: the SVD ranks directions by their energy on X, not on
  the weights alone);
- the rank from the target ratio as SparseEngine: r = floor(gs hd ratio / 16)
  16, at least min(16, gs hd), at most min(gs hd, 256) and head_dim;
- attention with the latents: keys reconstructed L h_k and RoPE'd at their
  positions, values reconstructed L h_v (palu absorbs L_v into the output
  projection, which is the same product in another order).
Written from the paper's equations, not from lethe's C code (which takes the
equivalent route through the key covariance's eigenvectors).
"""
import numpy as np

from model_np import Cache, Model, rmsnorm


def rank_of(gd, hd, ratio):
    r = int(gd * ratio / 16) * 16
    r = max(r, min(16, gd))
    return min(r, gd, 256, hd)


def calib_inputs(m, windows):
    """per layer the inputs of k_proj / v_proj [N, D] over the windows (token
    id lists, each from position 0), from a dense forward"""
    taps = [[] for _ in range(m.L)]
    proj = m.proj

    def tap(x, l, name):
        if name == "self_attn.k_proj":
            taps[l].append(x.copy())
        return proj(x, l, name)

    m.proj = tap
    try:
        for ids in windows:
            m.forward(Cache(m), ids, np.arange(len(ids)))
    finally:
        m.proj = proj
    return [np.concatenate(t, axis=0) for t in taps]


def whitened_svd(W, b, X, r):
    """W [gd, D], b [gd] or None, X [N, D]: (L [gd, r], R [r, D + (b is not None)],
    energy kept on X) with W x + b ~ L R [x; 1]"""
    if b is not None:
        W = np.concatenate([W, b[:, None]], axis=1)
        X = np.concatenate([X, np.ones((X.shape[0], 1))], axis=1)
    S = np.linalg.cholesky(X.T @ X)  # lower, S S^T = X^T X
    U, sig, Vt = np.linalg.svd(W @ S, full_matrices=False)
    L = U[:, :r] * np.sqrt(sig[:r])
    R = (np.sqrt(sig[:r])[:, None] * Vt[:r]) @ np.linalg.inv(S)
    return L, R, float((sig[:r] ** 2).sum() / (sig ** 2).sum())


class Palu:
    """the reference factors of one model: per layer and group (k: L, R, energy; v: likewise)"""

    def __init__(self, m, windows, ratio, gs=1):
        self.m, self.gs = m, gs
        self.gd = gs * m.d
        self.r = rank_of(self.gd, m.d, ratio)
        self.ng = m.Hk // gs
        self.X = calib_inputs(m, windows)
        self.k, self.v = [], []
        for l in range(m.L):
            for which, out in (("k_proj", self.k), ("v_proj", self.v)):
                W = m.p(l, f"self_attn.{which}.weight")
                b = m.w.get(f"model.layers.{l}.self_attn.{which}.bias")
                out.append([whitened_svd(W[g * self.gd:(g + 1) * self.gd],
                                         None if b is None else b[g * self.gd:(g + 1) * self.gd],
                                         self.X[l], self.r) for g in range(self.ng)])

    def affine(self, l, which, g):
        """the group's map as [W b] (b = 0 without a bias) [gd, D + 1]"""
        name = "k_proj" if which == "k" else "v_proj"
        W = self.m.p(l, f"self_attn.{name}.weight")[g * self.gd:(g + 1) * self.gd]
        b = self.m.w.get(f"model.layers.{l}.self_attn.{name}.bias")
        b = np.zeros(self.gd) if b is None else b[g * self.gd:(g + 1) * self.gd]
        return np.concatenate([W, b[:, None]], axis=1)

    def projector(self, l, which, g):
        """L R as a map of [x; 1] [gd, D + 1] (sign-free: what the factors compute)"""
        L, R, _ = (self.k if which == "k" else self.v)[l][g]
        if R.shape[1] == self.m.D:
            R = np.concatenate([R, np.zeros((R.shape[0], 1))], axis=1)
        return L @ R

    def reconstruct(self, l, which, x):
        """x [n, D] (the layer's normed inputs) -> the rank-r keys (before RoPE)
        or values [n, Hk, d]: per group the latent h = R [x; 1], then L h"""
        n = x.shape[0]
        x1 = np.concatenate([x, np.ones((n, 1))], axis=1)
        out = np.empty((n, self.m.Hk, self.m.d))
        for g in range(self.ng):
            L, R, _ = (self.k if which == "k" else self.v)[l][g]
            h = x1[:, :R.shape[1]] @ R.T  # [n, r]
            out[:, g * self.gs:(g + 1) * self.gs, :] = (h @ L.T).reshape(n, self.gs, self.m.d)
        return out


def forward_palu(m, ref, tokens):
    """logits [T, V] of a dense causal forward whose keys and values are the
    reference's rank-r reconstructions (keys before RoPE, then rotated)"""
    from model_np import rope, softmax

    T, H, Hk, d = len(tokens), m.H, m.Hk, m.d
    g = H // Hk
    pos = np.arange(T)
    x = m.w["model.embed_tokens.weight"][np.asarray(tokens)]
    for l in range(m.L):
        h = rmsnorm(x, m.p(l, "input_layernorm.weight"), m.eps)
        q = m.proj(h, l, "self_attn.q_proj").reshape(T, H, d)
        k, v = ref.reconstruct(l, "k", h), ref.reconstruct(l, "v", h)
        q, k = rope(q, pos, m.inv, m.adjacent), rope(k, pos, m.inv, m.adjacent)
        o = np.zeros((T, H, d))
        causal = np.arange(T)[None, :] > np.arange(T)[:, None]
        for qh in range(H):
            z = (q[:, qh, :] @ k[:, qh // g, :].T) / np.sqrt(d)
            o[:, qh, :] = softmax(np.where(causal, -np.inf, z)) @ v[:, qh // g, :]
        x = x + o.reshape(T, H * d) @ m.p(l, "self_attn.o_proj.weight").T
        h = rmsnorm(x, m.p(l, "post_attention_layernorm.weight"), m.eps)
        gt = h @ m.p(l, "mlp.gate_proj.weight").T
        up = h @ m.p(l, "mlp.up_proj.weight").T
        x = x + (gt / (1 + np.exp(-gt)) * up) @ m.p(l, "mlp.down_proj.weight").T
    return rmsnorm(x, m.w["model.norm.weight"], m.eps) @ m.lm_head.T
