"""methods_ref.py - paper-faithful references of KVzip, R-KV, SkipKV and Quest
(methods.md §7, §8, §9, §10) on top of model_np.py, in float64.

Each method is a Policy driven by run(): the prompt is prefilled densely, then
every decode token is appended and read through the cache; a policy may cut
the cache at the end of the prompt (end_of_prompt) or after a decode step
(after_decode), and may restrict what a decode query reads (decode_reads, for
selection methods). run() records, per decode step and layer, the positions
the query read (per KV head), the same view lethe's LETHE_DUMP_SELECTIONS
gives.

Granularity: every method has the paper's granularity (per KV head: KVzip
pair, R-KV, Quest) and the anchor's token-shared one (one set per layer or per
request: KVzip shared, R-KV shared, Quest shared), chosen by `level`, so that
a comparison can say which one lethe implements and how far the other is.
Ties rank the smaller index first everywhere (stable sorts).
"""
import math

import numpy as np

from model_np import Cache, softmax


def topk_stable(x, k):
    """indices of the k largest x (NaN never chosen), smaller index first on ties, ascending"""
    x = np.where(np.isnan(x), -np.inf, x)
    order = np.argsort(-x, kind="stable")[:k]
    return np.sort(order)


def maxpool1d(x, k):
    """max over the window [j - k//2, j + k//2] clipped to the array (stride 1)"""
    if k <= 1:
        return x.copy()
    r = k // 2
    return np.array([x[max(0, j - r): j + r + 1].max() for j in range(len(x))])


# ---------------------------------------------------------------- driver


class Trace:
    def __init__(self):
        self.reads = []  # per decode step: [layer] -> [Hk] arrays of positions read


def run(m, prompt, forced, policy):
    """prompt tokens, then forced[0 .. -2] decoded one at a time (forced[-1]
    is sampled last and never read back, as lethe's teacher forcing ends)."""
    c = Cache(m)
    tr = Trace()
    policy.q, policy.hidden = {}, {}
    out = m.forward(c, prompt, list(range(len(prompt))))
    policy.record(m, out, list(range(len(prompt))))
    policy.end_of_prompt(m, c, prompt)
    toks = list(prompt)
    for i, t in enumerate(forced[:-1]):
        p = len(prompt) + i
        toks.append(t)
        out = m.forward(c, [t], [p], select=policy.selector(m, c))
        tr.reads.append([[c.pos[l][out.reads[l][h]] for h in range(m.Hk)] for l in range(m.L)])
        policy.record(m, out, [p])
        policy.after_decode(m, c, toks)
    return tr


class Policy:
    def record(self, m, out, pos):
        """keeps each layer's queries and the last layer's hidden states by position"""
        for l in range(m.L):
            for i, p in enumerate(pos):
                self.q[(l, p)] = out.q[l][i]
        for i, p in enumerate(pos):
            self.hidden[p] = out.hidden[i]

    def end_of_prompt(self, m, c, prompt):
        pass

    def selector(self, m, c):
        """a select(l, q) for Model.forward (selection methods), or None"""
        return None

    def after_decode(self, m, c, toks):
        pass


def resident(c, l):
    """entry indices resident in layer l (kept by some head), ascending"""
    return np.nonzero(c.keep[l].any(axis=0))[0]


# ---------------------------------------------------------------- KVzip (§7)


class KVzip(Policy):
    """Context reconstruction: replay each chunk after the context (an extra,
    teacher-forced prefill appended to the cache and dropped afterwards); the
    score of context token j in (layer, KV head) is the max over the replay
    queries of the group's heads of its softmax probability over the subset
    [sink keys, chunk keys, replay keys so far]. pair: one global top-K over
    (layer, KV head, token) entries, K = ratio x entries or (budget - sink) x
    layers x KV heads; shared: one token set, score = max over layers and heads."""

    def __init__(self, budget, chunk=2048, postfix=64, sink=4, level="shared", ratio=0.0, instr=()):
        self.budget, self.chunk, self.postfix, self.sink = budget, chunk, postfix, sink
        self.level, self.ratio, self.instr = level, ratio, list(instr)

    def scores(self, m, c, prompt):
        n = len(prompt)
        s = min(self.sink, n)
        sc = np.full((m.L, m.Hk, n), -np.inf)
        g = m.H // m.Hk
        for c0 in range(s, n, self.chunk):
            c1 = min(n, c0 + self.chunk)
            rep = list(self.instr)
            if c0 > s:
                rep += list(prompt[max(s, c0 - self.postfix):c0])
            rep += list(prompt[c0:c1])
            out = m.forward(c, rep, list(range(n, n + len(rep))))
            R = len(rep)
            for l in range(m.L):
                K = c.k[l]  # [n + R, Hk, d]
                keys = np.concatenate([np.arange(s), np.arange(c0, c1), np.arange(n, n + R)])
                ns, nc = s, c1 - c0
                for kh in range(m.Hk):
                    best = np.full(nc, -np.inf)
                    for qh in range(kh * g, (kh + 1) * g):
                        q = out.q[l][:, qh, :]  # [R, d]
                        z = q @ K[keys, kh, :].T / math.sqrt(m.d)  # [R, |keys|]
                        for r in range(R):  # replay row r sees replay keys <= r
                            z[r, ns + nc + r + 1:] = -np.inf
                        p = softmax(z)[:, ns:ns + nc]
                        best = np.maximum(best, p.max(axis=0))
                    sc[l, kh, c0:c1] = best
            c.truncate(n)
        return sc

    def end_of_prompt(self, m, c, prompt):
        n = len(prompt)
        s = min(self.sink, n)
        compress = self.ratio < 1 if (self.level == "pair" and self.ratio > 0) else n > self.budget
        if n - s <= 0 or not compress:
            return
        sc = self.scores(m, c, prompt)
        self.sc = sc
        if self.level == "shared":
            gs = sc[:, :, s:].max(axis=(0, 1))
            top = topk_stable(gs, self.budget - s) + s
            keep = np.zeros(n, dtype=bool)
            keep[:s] = True
            keep[top] = True
            for l in range(m.L):
                c.keep[l][:, :] = keep[None, :]
        else:
            flat = sc[:, :, s:].reshape(-1)  # [layer][head][token]
            cand = flat.size
            K = math.ceil(self.ratio * cand) if self.ratio > 0 else (self.budget - s) * m.L * m.Hk
            K = min(K, cand)
            top = topk_stable(flat, K)
            mask = np.zeros(flat.size, dtype=bool)
            mask[top] = True
            mask = mask.reshape(m.L, m.Hk, n - s)
            for l in range(m.L):
                c.keep[l][:, :s] = True
                c.keep[l][:, s:] = mask[l]


# ---------------------------------------------------------------- R-KV (§8)


def rkv_redundancy(K, thr):
    """R-KV redundancy of keys K [n, d] of one head: cosine similarity, the
    diagonal zeroed; for each token j its most recent near-copy i = the largest
    i > j with sim > thr does not count j (sim[i, j] = 0: the newest copy is
    the one kept); R = softmax over tokens of the mean similarity."""
    nrm = np.linalg.norm(K, axis=1) + 1e-8
    S = (K @ K.T) / nrm[:, None] / nrm[None, :]
    n = len(K)
    np.fill_diagonal(S, 0.0)
    for j in range(n):
        later = np.nonzero(S[j + 1:, j] > thr)[0]
        if len(later):
            S[j + 1 + later[-1], j] = 0.0
    return softmax(S.sum(axis=1) / n)


class RKV(Policy):
    """Decode-time compaction when the length reaches budget + interval:
    importance = mean over the last w queries (and the group's query heads) of
    the softmax over the prefix keys [0, L - w), max-pooled with kernel k;
    redundancy as rkv_redundancy over the head's keys; F = lam I - (1 - lam) R;
    keep the top (budget - w) of [0, L - w) plus the last w.
    level=head: per KV head (the paper); level=shared: one set for every layer
    and head, F summed over layers of (lam pool(mean over all heads of the
    attention) - (1 - lam) mean over KV heads of R) (the anchor)."""

    def __init__(self, budget, w=8, interval=128, kernel=7, lam=0.1, thr=0.5, level="shared"):
        self.budget, self.w, self.interval, self.kernel = budget, w, interval, kernel
        self.lam, self.thr, self.level = lam, thr, level

    def after_decode(self, m, c, toks):
        L = int(c.keep[0][0].sum())  # every head of every layer holds L entries
        if L < self.budget + self.interval:
            return
        w, g, nc = self.w, m.H // m.Hk, L - self.w
        F_shared = np.zeros(nc)
        heads = []  # per layer, per KV head: (its entries, kept entry indices)
        for l in range(m.L):
            att = np.zeros((m.H, nc))
            R = np.zeros((m.Hk, nc))
            ents = [np.nonzero(c.keep[l][kh])[0] for kh in range(m.Hk)]
            last_pos = c.pos[l][ents[0][-w:]]
            Q = np.stack([self.q[(l, int(p))] for p in last_pos])  # [w, H, d]
            for kh in range(m.Hk):
                K = c.k[l][ents[kh], kh, :]  # [L, d]
                assert len(K) == L
                for qh in range(kh * g, (kh + 1) * g):
                    att[qh] = softmax(Q[:, qh, :] @ K[:nc].T / math.sqrt(m.d)).mean(axis=0)
                R[kh] = rkv_redundancy(K, self.thr)[:nc]
            if self.level == "shared":
                I = maxpool1d(att.mean(axis=0), self.kernel)
                F_shared += self.lam * I - (1 - self.lam) * R.mean(axis=0)
            else:
                lk = []
                for kh in range(m.Hk):
                    I = maxpool1d(att[kh * g:(kh + 1) * g].mean(axis=0), self.kernel)
                    F = self.lam * I - (1 - self.lam) * R[kh]
                    lk.append(np.concatenate([topk_stable(F, self.budget - w), np.arange(nc, L)]))
                heads.append((ents, lk))
        if self.level == "shared":
            top = np.concatenate([topk_stable(F_shared, self.budget - w), np.arange(nc, L)])
            heads = [([np.nonzero(c.keep[l][kh])[0] for kh in range(m.Hk)], [top] * m.Hk)
                     for l in range(m.L)]
        for l, (ents, lk) in enumerate(heads):
            for kh in range(m.Hk):
                mk = np.zeros(c.n(l), dtype=bool)
                mk[ents[kh][lk[kh]]] = True
                c.keep[l][kh] = mk


# ---------------------------------------------------------------- SkipKV (§9)


class SkipKV(Policy):
    """Sentence-granularity decode eviction when the length reaches budget +
    interval: the middle [sink, L - recent) is cut into sentences (after a
    delimiter token, min / max lengths; fixed spans of `segment` tokens without
    a tokenizer); a sentence whose embedding has cosine >= thr with a LATER
    sentence is evicted whole; then, while above the budget, whole sentences in
    increasing importance (mean over the span of the current query's softmax
    over the middle, mean over heads, summed over layers; the earlier first on
    ties). Embedding: embed="hidden" the mean of the last layer's hidden states
    over the span (the paper), embed="v" the mean of the last layer's V rows
    (lethe's stand-in); L2-normalized."""

    def __init__(self, budget, sink, recent, interval=128, thr=0.95, segment=32, embed="v",
                 ends=None, min_sent=4, max_sent=256):
        self.budget, self.sink, self.recent, self.interval = budget, sink, recent, interval
        self.thr, self.segment, self.embed = thr, segment, embed
        self.ends, self.min_sent, self.max_sent = ends, min_sent, max_sent

    def spans(self, toks_at, c0, c1):
        out, start = [], c0
        for e in range(c0, c1):
            ln = e + 1 - start
            if self.ends is None:
                cut = ln >= self.segment
            else:
                cut = (self.ends(toks_at(e)) and ln >= self.min_sent) or ln >= self.max_sent
            if cut or e + 1 == c1:
                out.append((start, e + 1))
                start = e + 1
        return out

    def after_decode(self, m, c, toks):
        ent = resident(c, 0)
        L = len(ent)
        if L < self.budget + self.interval:
            return
        c0, c1 = min(self.sink, L), max(min(self.sink, L), L - self.recent)
        pos = c.pos[0][ent]
        sents = self.spans(lambda e: toks[pos[e]], c0, c1)
        last = m.L - 1
        ent_last = resident(c, last)
        emb = []
        for a, b in sents:
            if self.embed == "hidden":
                e = np.mean([self.hidden[int(p)] for p in pos[a:b]], axis=0)
            else:
                e = c.v[last][ent_last[a:b]].reshape(b - a, -1).mean(axis=0)
            emb.append(e / (np.linalg.norm(e) or 1.0))
        ns = len(sents)
        drop = np.zeros(ns, dtype=bool)
        for a in range(ns):
            for b in range(a + 1, ns):
                if float(emb[a] @ emb[b]) >= self.thr:
                    drop[a] = True
                    break
        removed = sum(b - a for (a, b), d in zip(sents, drop) if d)
        if L - removed > self.budget:
            imp = np.zeros(L)
            cur = int(pos[-1])
            g = m.H // m.Hk
            for l in range(m.L):
                el = resident(c, l)
                K = c.k[l][el]
                q = self.q[(l, cur)]
                acc = np.zeros(c1 - c0)
                for qh in range(m.H):
                    acc += softmax(K[c0:c1, qh // g, :] @ q[qh] / math.sqrt(m.d))
                imp[c0:c1] += acc / m.H
            score = np.array([-np.inf if d else imp[a:b].mean() for (a, b), d in zip(sents, drop)])
            for k in np.argsort(score, kind="stable"):
                if L - removed <= self.budget:
                    break
                if drop[k]:
                    continue
                drop[k] = True
                removed += sents[k][1] - sents[k][0]
        if removed == 0:
            return
        keep = np.zeros(L, dtype=bool)
        keep[:c0] = True
        keep[c1:] = True
        for (a, b), d in zip(sents, drop):
            if not d:
                keep[a:b] = True
        for l in range(m.L):
            el = resident(c, l)
            mk = np.zeros(c.n(l), dtype=bool)
            mk[el[keep]] = True
            c.keep[l][:, :] = mk[None, :]


# ---------------------------------------------------------------- Quest (§10)


class Quest(Policy):
    """Decode reads K = max(3, budget / P) pages of P entries: the page(s)
    holding the new token always, plus the top completed pages by the upper
    bound U_p = sum_c max(q_c M_c, q_c m_c) of the page's elementwise key min m
    / max M (per KV head). level=shared: the bound maxed over all query heads,
    one page set per layer (the anchor); level=head: per KV head, maxed over
    the group's query heads (the GQA form of the paper's per-head sets; with
    MHA, g = 1, exactly the paper's). Layers below `skip` and rows within the
    budget read densely."""

    def __init__(self, budget, page=16, skip=2, level="shared"):
        self.budget, self.page, self.skip, self.level = budget, page, skip, level

    def selector(self, m, c):
        g, P = m.H // m.Hk, self.page

        def select(l, q):
            L = c.n(l) + 1  # the new token included
            if l < self.skip or L <= self.budget:
                return None
            n_done, n_pages = (L - 1) // P, -(-L // P)
            K = max(3, self.budget // P)
            if K >= n_pages or n_done == 0:
                return None
            take = min(max(0, K - (n_pages - n_done)), n_done)
            Kc = c.k[l][:n_done * P].reshape(n_done, P, m.Hk, m.d)
            mn, mx = Kc.min(axis=1), Kc.max(axis=1)  # [pages, Hk, d]
            U = np.zeros((m.H, n_done))
            for qh in range(m.H):
                kh = qh // g
                U[qh] = np.maximum(q[0, qh] * mx[:, kh, :], q[0, qh] * mn[:, kh, :]).sum(axis=1)
            keep = np.zeros((m.Hk, c.n(l)), dtype=bool)
            keep[:, n_done * P:] = True  # the page holding the new token
            if self.level == "shared":
                for p in topk_stable(U.max(axis=0), take):
                    keep[:, p * P:(p + 1) * P] = True
            else:
                for kh in range(m.Hk):
                    for p in topk_stable(U[kh * g:(kh + 1) * g].max(axis=0), take):
                        keep[kh, p * P:(p + 1) * P] = True
            return keep

        return select
