"""RetroInfer (methods.md §12) in numpy, written from the algorithm, not from
lethe's C: the reference tests/e2e/test_retroinfer_ref.py compares
src/sparse/retroinfer.c against.

One layer, one request. Keys k [N, KH, D], values v [N, KH, D], the decode
query q [H, D] of token N - 1 (whose k / v are the last rows).

Index, per KV head, over row entries [sink, N - 1 - recent) (the prompt is
tokens 0 .. N - 2): floor(n / segment) equal segments (at least one); per
segment ceil(n_seg / cluster_size) clusters by spherical k-means on the keys
centred on the segment's mean: unit centroids initialised at the keys of
evenly strided entries (floor(c n / n_c)), `iters` rounds of (assign to the
largest dot, first index on ties; centroid = normalised sum of its centred
members, an empty cluster keeping its centroid), then a final assignment.
Clusters that end empty are dropped; the others keep mean key (uncentred),
value sum, count and member list (ascending).

Decode: clusters rank by scale * mean over the g query heads of the group of
q_h . mean_key (best first, ties to the lower cluster index). The first
ceil(retrieve n) are exact, the next floor(estimate n) estimated (count
copies of the mean key carrying the mean value), the rest ignored; sink
[0, sink) and the tail [end, N) exact. One softmax over all three zones.
"""
import math

import numpy as np


def kmeans_segment(keys, n_c, iters):
    """keys [n, D] float64 -> assignment [n] (spherical k-means, centred)."""
    n = keys.shape[0]
    mu = keys.mean(axis=0)
    x = keys - mu
    def unit(a):
        nrm = np.linalg.norm(a)
        return a / nrm if nrm > 0 else a
    cent = np.stack([unit(x[(c * n) // n_c]) for c in range(n_c)])
    for it in range(iters + 1):
        assign = np.argmax(x @ cent.T, axis=1)  # first index of the max on ties
        if it == iters:
            return assign
        for c in range(n_c):
            m = assign == c
            if m.any():
                cent[c] = unit(x[m].sum(axis=0))


def build_index(k, v, sink, recent, csize, segment, iters):
    """per KV head: list of clusters (members ndarray, mean key, value sum), and end."""
    n_prompt = k.shape[0] - 1
    lim = n_prompt - recent
    n = lim - sink
    n_seg = max(1, n // segment)
    heads = []
    for h in range(k.shape[1]):
        clusters = []
        for g in range(n_seg):
            a = sink + (n * g) // n_seg
            b = sink + (n * (g + 1)) // n_seg
            n_c = -(-(b - a) // csize)
            assign = kmeans_segment(k[a:b, h].astype(np.float64), n_c, iters)
            for c in range(n_c):
                mem = np.nonzero(assign == c)[0] + a
                if len(mem):
                    clusters.append((mem, k[mem, h].astype(np.float64).mean(axis=0),
                                     v[mem, h].astype(np.float64).sum(axis=0)))
        heads.append(clusters)
    return heads, lim


def decode(k, v, q, heads, end, sink, retrieve, estimate):
    """attention output [H, D] of the last token (row N - 1)."""
    N, KH, D = k.shape
    H = q.shape[0]
    g = H // KH
    scale = 1.0 / math.sqrt(D)
    out = np.zeros((H, D))
    for h in range(KH):
        cl = heads[h]
        n = len(cl)
        qg = q[h * g:(h + 1) * g].astype(np.float64)
        score = np.array([scale * (qg @ c[1]).mean() for c in cl])
        order = sorted(range(n), key=lambda c: (-score[c], c))
        n_ret = min(n, math.ceil(retrieve * n - 1e-9))
        n_est = min(n - n_ret, math.floor(estimate * n + 1e-9))
        exact = list(range(min(sink, N))) + list(range(end, N))
        for c in order[:n_ret]:
            exact += list(cl[c][0])
        est = order[n_ret:n_ret + n_est]
        ke = k[exact, h].astype(np.float64)
        ve = v[exact, h].astype(np.float64)
        for j in range(g):
            qq = qg[j]
            s = scale * (ke @ qq)
            se = np.array([scale * (cl[c][1] @ qq) for c in est]) if est else np.zeros(0)
            m = max(s.max(), se.max() if len(se) else -np.inf)
            w = np.exp(s - m)
            num = w @ ve
            den = w.sum()
            for c, sc in zip(est, se):
                we = math.exp(sc - m)
                num = num + we * cl[c][2]
                den += we * len(cl[c][0])
            out[h * g + j] = num / den
    return out
