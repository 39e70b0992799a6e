"""Counter-based random numbers and per-row sampling on the device: what a row draws is a function of the
row alone (its seed, the token's absolute position, a stream, the vocabulary index), never of its batch.

    bits = philox(seed, v, P, stream, 0)[0]    Philox4x32-10 keyed by the row's 64-bit seed (triton's tl.philox,
                                               tl.rand); `philox_reference`: the same bits in int64 torch
    u    = ((bits >> 9) + 1/2) / 2^23          uniform in (0, 1), exact in fp32
    E    = -log u                              Exp(1): a draw from weights w is argmax_v w_v / E_v (exponential race)

Streams: DRAFT (the draft's proposal for position P), ACCEPT (v = 0: the uniform that keeps the draft token at
P), BONUS (the target's draw at P: after a rejection, after a full accept, plain decoding, the prefill's first
token). Reusing (seed, P) across rounds is unbiased: a round from length L (x_L at position L) emits
x_{L+1..L+a+1}, and both where it stops and what it emits up to L+a+1 depend on noise at positions <= L+a+1
only (the draft chain is causal, acceptance a prefix, the bonus drawn at L+a+1); the next round reads
positions >= L+a+2, independent of everything emitted so far (optional stopping over positions), so their
noise is fresh although the previous round computed (and discarded) it.

Per row: temperature 0 is greedy (argmax z, the first index on ties, as torch.argmax); else
w_v = exp((z_v - max z) / T), the nucleus {w_v >= tau} (tau: kernels/top_p.py's search on w against
top_p * sum w; none for top_p >= 1), p = w / W over it (W: its mass).

    sample(logits [b, t, V], temperature [b], top_p [b], seed [b], pos0 [b], stream, *, offset=0, index=None,
           q_out=None, offsets=None) -> ids [b, t]: token j of row r drawn at position pos0[r] + offset + j;
        index [b]: only t-index index[r] of row r (-> [b, 1], at pos0[r] + offset + index[r]); q_out [b, t or 1, V]
        fp32: p of the sampled rows (a draft's q); offsets [V]: ids + offsets[ids] (EAGLE3's d2t)
    accept(logits [b, k+1, V], draft [b, k], q [b, k, Vd] or None, vocab_map [V] or None, temperature,
           top_p, seed, lengths [b], speculate [b], out [b, >= k+2]) -> (accepted [b] = out[:, 0], bonus [b])
        d_i (at L+i, L = lengths) kept while u_i q(d_i) < p(d_i) (u: ACCEPT at L+i); at the first rejection
        a the bonus is drawn from max(0, p_a - q_a) (p_a if that is all zero), after a full accept from p_k
        (BONUS at L+a+1); q None: one-hot (host drafts); vocab_map: a target id's index in q's vocabulary
        (-1: outside it); greedy rows: kernels/accept.py's rule; speculate False: a = 0 and the bonus drawn
        from p_0, exactly what a round without drafts emits. out as kernels/accept.py writes it.

Kernels, each with its plain-torch `*_reference`: a program per (row, CHUNK of the vocabulary): stats (max,
argmax, sum of w) -> threshold (a program per row, no pass at top_p = 1) -> race (each chunk's winner, q
written) -> pick (the row's winner; accept: the out row). Four launches a call; accept's race programs each
decide their row's acceptance (k gathers and uniforms) instead of a launch of its own.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kernels.accept import write_out_reference
from kernels.runtime import triton

if triton is not None:
    import triton.language as tl

    from kernels.top_p import _search

DRAFT, ACCEPT, BONUS = 0, 1, 2  # streams
CHUNK = 1024  # vocabulary entries per program
_CANDIDATES = 8  # thresholds per pass of the top-p search
_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B, _KEY_A, _KEY_B = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


# ------------------------------------------------------------------------------------- references
def _mulhilo(a, m: int):
    """(hi, lo) 32-bit words of a * m: a int64 in [0, 2^32) (or an int), m a 32-bit constant; int64 math
    without overflow (16-bit halves)."""
    t = (a & 0xFFFF) * m
    u = (a >> 16) * m + (t >> 16)
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox_reference(seed: Tensor, c0, c1, c2, c3) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 of counter (c0, c1, c2, c3) under key seed (int64: its low and high words), as
    tl.philox computes it; the four words as int64 in [0, 2^32). Arguments broadcast."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mulhilo(c2, _ROUND_B)
        hi_a, lo_a = _mulhilo(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def uniform_reference(seed: Tensor, position: Tensor, stream: int, index) -> Tensor:
    """u in (0, 1) fp32 of each (seed, position) row [N] at vocabulary indices `index` ([V] or [N, V]):
    -> [N, V]."""
    bits = philox_reference(seed[:, None], index, position[:, None] & _M32, stream, 0)[0]
    return ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23


def _weights(z: Tensor, temperature: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """z [N, V] fp32 logits -> (argmax [N], w [N, V] zero outside the nucleus, W [N] its mass)."""
    greedy = temperature <= 0
    inv_t = 1.0 / torch.where(greedy, 1.0, temperature)  # [N]
    ids = z.argmax(-1)
    w = torch.exp((z - z.gather(-1, ids[:, None])) * inv_t[:, None])
    # the nucleus: the likeliest tokens until their mass reaches top_p of the whole, ties with the last
    # one included (kernels/top_p.py's threshold: bf16 logits tie often)
    ranked = w.sort(-1, descending=True)[0]
    reached = (ranked.cumsum(-1) - ranked < (top_p * w.sum(-1))[:, None]).sum(
        -1
    )  # [N] tokens up to the one reaching it
    tau = ranked.gather(-1, (reached - 1).clamp_min(0)[:, None])  # [N, 1]
    w = torch.where((w >= tau) | (top_p >= 1)[:, None], w, 0.0)
    return ids, w, w.sum(-1)


def _draw(w: Tensor, seed: Tensor, position: Tensor, stream: int) -> Tensor:
    """One draw per row of weights w [N, V]: argmax w / E, E = -log u of (seed, position, stream)."""
    u = uniform_reference(seed, position, stream, torch.arange(w.shape[-1], device=w.device))
    return (w / -torch.log(u)).argmax(-1)


def sample_reference(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    seed: Tensor,
    pos0: Tensor,
    stream: int,
    *,
    offset: int = 0,
    index: Optional[Tensor] = None,
    q_out: Optional[Tensor] = None,
    offsets: Optional[Tensor] = None,
) -> Tensor:
    b, t, v = logits.shape
    if index is not None:  # row r's t-index index[r] alone
        logits, pos = logits[torch.arange(b, device=logits.device), index][:, None], (pos0 + offset + index)[:, None]
    else:
        pos = pos0[:, None] + offset + torch.arange(t, device=logits.device)  # [b, t]
    t = logits.shape[1]
    rep = lambda x: x[:, None].expand(b, t).reshape(-1)  # noqa: E731  per row -> per (row, t)
    greedy = rep(temperature) <= 0
    ids, w, mass = _weights(logits.reshape(b * t, v).float(), rep(temperature), rep(top_p))
    ids = torch.where(greedy, ids, _draw(w, rep(seed), pos.reshape(-1), stream))
    if q_out is not None:  # sampled rows only
        q_out.copy_(torch.where(greedy.view(b, t, 1), q_out, (w / mass[:, None]).view(b, t, v)))
    if offsets is not None:
        ids = ids + offsets[ids]
    return ids.view(b, t)


def accept_reference(
    logits: Tensor,
    draft: Tensor,
    q: Optional[Tensor],
    vocab_map: Optional[Tensor],
    temperature: Tensor,
    top_p: Tensor,
    seed: Tensor,
    lengths: Tensor,
    speculate: Tensor,
    out: Tensor,
) -> tuple[Tensor, Tensor]:
    b, k1, v = logits.shape
    k, dev = k1 - 1, logits.device
    rep = lambda x: x[:, None].expand(b, k1).reshape(-1)  # noqa: E731
    ids, w, mass = _weights(logits.reshape(b * k1, v).float(), rep(temperature), rep(top_p))
    ids, p = ids.view(b, k1), (w / mass[:, None]).view(b, k1, v)  # [b, k+1], [b, k+1, V]
    rows, greedy = torch.arange(b, device=dev), temperature <= 0
    # the drafted tokens' p and q, each kept while u q < p (a prefix): sampled rows; greedy rows: equal argmax
    p_d = p[:, :k].gather(-1, draft[..., None])[..., 0]  # [b, k]
    if q is None:  # a host draft: one-hot
        q_d = torch.ones_like(p_d)
    else:
        j = draft if vocab_map is None else vocab_map[draft]  # [b, k] index in q's vocabulary
        q_d = torch.where(j >= 0, q.gather(-1, j.clamp_min(0)[..., None])[..., 0], 0.0)
    pos = (lengths[:, None] + 1 + torch.arange(k, device=dev)).reshape(-1)  # [b * k]: d_1..d_k at L+1..L+k
    u = uniform_reference(seed.repeat_interleave(k), pos, ACCEPT, torch.zeros(1, dtype=torch.long, device=dev))
    u = u.view(b, k)
    sampled_a = (u * q_d < p_d).int().cumprod(1).sum(1)
    greedy_a = (draft == ids[:, :k]).int().cumprod(1).sum(1)
    a = torch.where(greedy, greedy_a, sampled_a) * speculate  # [b]
    # the bonus at a: the residual max(0, p_a - q_a) after a rejection, else p_a itself
    p_a = p[rows, a]  # [b, V]
    r = p_a
    if k:
        at = a.clamp(max=k - 1)
        if q is None:  # one-hot (scatter: no host sync, a CUDA graph may capture it)
            q_a = torch.zeros_like(p_a).scatter_(-1, draft[rows, at][:, None], 1.0)
        else:
            q_a = q[rows, at].float()  # [b, Vd]
            if vocab_map is not None:
                q_a = torch.where(vocab_map >= 0, q_a.gather(-1, vocab_map.clamp_min(0).expand(b, v)), 0.0)
        residual = (speculate & (a < k))[:, None]
        r = torch.where(residual, (p_a - q_a).clamp_min(0), p_a)
        r = torch.where((r > 0).any(-1, keepdim=True), r, p_a)  # p == q to the last bit: draw from p
    bonus = torch.where(greedy, ids[rows, a], _draw(r, seed, lengths + 1 + a, BONUS))
    write_out_reference(draft, a, bonus, out)
    return out[:, 0], bonus


# ------------------------------------------------------------------------------------- kernels
if triton is not None:

    @triton.jit
    def _uniform(seed, position, stream, cols):
        """u in (0, 1) of (seed, vocabulary index cols, position, stream): philox's first word, top 23 bits."""
        c0 = cols.to(tl.uint32)
        zero = c0 * 0
        bits, _, _, _ = tl.philox(seed, c0, zero + position.to(tl.uint32), zero + stream, zero)
        return ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07

    @triton.jit
    def _first_max(vals, idxs, axis: tl.constexpr):
        """(max of vals, the lowest of idxs where vals reach it) along axis: torch.argmax's tie rule."""
        top = tl.max(vals, axis)
        top_b = tl.expand_dims(top, axis) if axis == 1 else top
        return top, tl.min(tl.where(vals == top_b, idxs, 2147483647), axis)

    @triton.jit
    def _inv_t(temp):
        return 1.0 / tl.where(temp > 0, temp, 1.0)  # greedy rows: 1 (their w is never read)

    @triton.jit
    def _row_of(row, T, INDEX, s_i, INDEXED: tl.constexpr):
        """(b, t) of a program's row: rows are b * T + t, or (INDEXED) b with t = index[b]."""
        if INDEXED:
            b, t = row, tl.load(INDEX + row * s_i).to(tl.int32)
        else:
            b, t = row // T, row % T
        return b, t

    @triton.jit
    def _row_stats(MAXP, IDXP, SUMP, prow, C, inv_t, CP: tl.constexpr):
        """(max z, its first index, sum of w) of row prow from its chunks' partials [*, C]."""
        c = tl.arange(0, CP)
        m = tl.load(MAXP + prow * C + c, mask=c < C, other=float("-inf"))
        zmax, idx = _first_max(m, tl.load(IDXP + prow * C + c, mask=c < C, other=0), 0)
        total = tl.sum(tl.load(SUMP + prow * C + c, mask=c < C, other=0.0) * tl.exp((m - zmax) * inv_t), 0)
        return zmax, idx, total

    @triton.jit
    def _stats_kernel(
        LOGITS, s_b, s_t, T, INDEX, s_i, TEMP, MAXP, IDXP, SUMP, V, C, INDEXED: tl.constexpr, BLOCK: tl.constexpr
    ):
        row, c = tl.program_id(0), tl.program_id(1)
        b, t = _row_of(row, T, INDEX, s_i, INDEXED)
        inv_t = _inv_t(tl.load(TEMP + b))
        cols = c * BLOCK + tl.arange(0, BLOCK)
        z = tl.load(LOGITS + b.to(tl.int64) * s_b + t * s_t + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m, i = tl.max(z, 0, return_indices=True)
        tl.store(MAXP + row * C + c, m)
        tl.store(IDXP + row * C + c, c * BLOCK + i)
        tl.store(SUMP + row * C + c, tl.sum(tl.exp((z - m) * inv_t), 0))

    @triton.jit
    def _threshold_kernel(
        LOGITS, s_b, s_t, T, INDEX, s_i, TEMP, TOP_P, MAXP, IDXP, SUMP, TAU, MASS, V, C,
        INDEXED: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, CP: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        b, t = _row_of(row, T, INDEX, s_i, INDEXED)
        temp, top_p = tl.load(TEMP + b), tl.load(TOP_P + b)
        inv_t = _inv_t(temp)
        zmax, _, total = _row_stats(MAXP, IDXP, SUMP, row, C, inv_t, CP)
        hi = tl.where((temp > 0) & (top_p < 1.0), 0x3F800001, 1).to(tl.int64)  # w <= 1.0 (0x3F800000); 1: no search
        lo, mass = _search(LOGITS + b.to(tl.int64) * s_b + t * s_t, V, hi, top_p * total, total, zmax, inv_t,
                           True, K, BLOCK)  # fmt: skip
        tl.store(TAU + row, lo.to(tl.int32).to(tl.float32, bitcast=True))
        tl.store(MASS + row, mass)

    @triton.jit
    def _race_kernel(
        LOGITS, s_b, s_t, T, INDEX, s_i, TEMP, SEED, POS0, OFFSET, MAXP, IDXP, SUMP, TAU, MASS, BESTP, BIDXP,
        Q, s_qb, s_qt, V, C,
        STREAM: tl.constexpr, INDEXED: tl.constexpr, WRITE_Q: tl.constexpr, BLOCK: tl.constexpr, CP: tl.constexpr,
    ):  # fmt: skip
        row, c = tl.program_id(0), tl.program_id(1)
        b, t = _row_of(row, T, INDEX, s_i, INDEXED)
        temp = tl.load(TEMP + b)
        if temp > 0:  # greedy rows: the pick reads the stats' argmax
            inv_t = _inv_t(temp)
            zmax, _, _ = _row_stats(MAXP, IDXP, SUMP, row, C, inv_t, CP)
            tau, mass = tl.load(TAU + row), tl.load(MASS + row)
            cols = c * BLOCK + tl.arange(0, BLOCK)
            z = tl.load(LOGITS + b.to(tl.int64) * s_b + t * s_t + cols, mask=cols < V, other=float("-inf"))
            w = tl.exp((z.to(tl.float32) - zmax) * inv_t)
            keep = (w >= tau) & (cols < V)
            u = _uniform(tl.load(SEED + b), tl.load(POS0 + b) + OFFSET + t, STREAM, cols)
            best, i = tl.max(tl.where(keep, w / -tl.log(u), -1.0), 0, return_indices=True)
            tl.store(BESTP + row * C + c, best)
            tl.store(BIDXP + row * C + c, c * BLOCK + i)
            if WRITE_Q:
                tq = 0 if INDEXED else t
                tl.store(Q + b.to(tl.int64) * s_qb + tq * s_qt + cols, tl.where(keep, w / mass, 0.0), mask=cols < V)

    @triton.jit
    def _pick_kernel(TEMP, T, MAXP, IDXP, BESTP, BIDXP, OFFSETS, OUT, C, HAS_OFFSETS: tl.constexpr, CP: tl.constexpr):
        row = tl.program_id(0)
        c = row * C + tl.arange(0, CP)
        m = tl.arange(0, CP) < C
        _, drawn = _first_max(tl.load(BESTP + c, mask=m, other=-2.0), tl.load(BIDXP + c, mask=m, other=0), 0)
        _, greedy = _first_max(tl.load(MAXP + c, mask=m, other=float("-inf")), tl.load(IDXP + c, mask=m, other=0), 0)
        tok = tl.where(tl.load(TEMP + row // T) > 0, drawn, greedy).to(tl.int64)
        if HAS_OFFSETS:
            tok += tl.load(OFFSETS + tok)
        tl.store(OUT + row, tok)

    @triton.jit
    def _accept_race_kernel(
        LOGITS, s_b, s_t, DRAFT, s_d, Q, s_qb, s_qk, VMAP, TEMP, SEED, LENGTHS, SPEC,
        MAXP, IDXP, SUMP, TAU, MASS, A, BESTP, BIDXP, V, C,
        K: tl.constexpr, KP: tl.constexpr, ONE_HOT: tl.constexpr, HAS_MAP: tl.constexpr,
        BLOCK: tl.constexpr, CP: tl.constexpr,
    ):  # fmt: skip
        b, c = tl.program_id(0), tl.program_id(1)
        temp, seed, length = tl.load(TEMP + b), tl.load(SEED + b), tl.load(LENGTHS + b)
        spec = tl.load(SPEC + b) != 0
        inv_t = _inv_t(temp)
        base = LOGITS + b.to(tl.int64) * s_b
        # every verified position's stats: [KP] (positions 0..K) from [KP, C] partials
        i, cc = tl.arange(0, KP), tl.arange(0, CP)
        pm = (i <= K)[:, None] & (cc < C)[None, :]
        part = (b * (K + 1) + i)[:, None] * C + cc[None, :]
        zmax, argmax = _first_max(
            tl.load(MAXP + part, mask=pm, other=float("-inf")), tl.load(IDXP + part, mask=pm, other=0), 1
        )  # [KP], [KP]
        d = tl.load(DRAFT + b * s_d + i, mask=i < K, other=0)  # [KP]
        if temp > 0:  # keep d_i while u_i q(d_i) < p(d_i)
            prow = b * (K + 1) + i
            tau = tl.load(TAU + prow, mask=i <= K, other=0.0)
            mass = tl.load(MASS + prow, mask=i <= K, other=1.0)
            wd = tl.exp((tl.load(base + i * s_t + d, mask=i < K, other=float("-inf")).to(tl.float32) - zmax) * inv_t)
            pd = tl.where(wd >= tau, wd / mass, 0.0)
            if ONE_HOT:
                qd = tl.full((KP,), 1.0, tl.float32)
            else:
                j = tl.load(VMAP + d, mask=i < K, other=-1) if HAS_MAP else d
                qd = tl.load(Q + b.to(tl.int64) * s_qb + i * s_qk + j, mask=(i < K) & (j >= 0), other=0.0)
            u = _uniform(seed, length + 1 + i, 1, i * 0)  # ACCEPT at L+1+i, index 0
            a = tl.min(tl.where((u * qd >= pd) & (i < K), i, K), 0)
        else:  # the greedy rule: drafts while they equal the argmax
            a = tl.min(tl.where((d != argmax) & (i < K), i, K), 0)
        a = tl.where(spec, a, 0)
        if c == 0:
            tl.store(A + b, a)
        if temp > 0:  # this chunk's winners at a: of the residual max(0, p_a - q_a), and of p_a
            at = i == a
            zmax_a = tl.sum(tl.where(at, zmax, 0.0), 0)
            tau_a = tl.load(TAU + b * (K + 1) + a)
            mass_a = tl.load(MASS + b * (K + 1) + a)
            cols = c * BLOCK + tl.arange(0, BLOCK)
            z = tl.load(base + a * s_t + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            w = tl.exp((z - zmax_a) * inv_t)
            p = tl.where((w >= tau_a) & (cols < V), w / mass_a, 0.0)
            e = -tl.log(_uniform(seed, length + 1 + a, 2, cols))  # BONUS at L+1+a
            residual = (
                cols * 0 + (spec & (a < K)).to(tl.int32)
            ) != 0  # [BLOCK]: (the interpreter mis-types scalar & block)
            if ONE_HOT:
                qv = tl.where((cols == tl.sum(tl.where(at, d, 0), 0)) & residual, 1.0, 0.0)
            else:
                j = tl.load(VMAP + cols, mask=cols < V, other=-1) if HAS_MAP else cols
                qv = tl.load(Q + b.to(tl.int64) * s_qb + a * s_qk + j, mask=(cols < V) & (j >= 0) & residual, other=0.0)
            best_r, ir = tl.max(tl.where(cols < V, tl.maximum(p - qv, 0.0) / e, -1.0), 0, return_indices=True)
            best_p, ip = tl.max(tl.where(cols < V, p / e, -1.0), 0, return_indices=True)
            tl.store(BESTP + (b * C + c) * 2, best_r)
            tl.store(BIDXP + (b * C + c) * 2, c * BLOCK + ir)
            tl.store(BESTP + (b * C + c) * 2 + 1, best_p)
            tl.store(BIDXP + (b * C + c) * 2 + 1, c * BLOCK + ip)

    @triton.jit
    def _accept_pick_kernel(
        DRAFT, s_d, TEMP, A, MAXP, IDXP, BESTP, BIDXP, OUT, s_o, BONUS_OUT, C,
        K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        a = tl.load(A + b)
        cc = tl.arange(0, CP)
        m = cc < C
        at = (b * (K + 1) + a) * C + cc  # the stats of position a
        _, greedy = _first_max(tl.load(MAXP + at, mask=m, other=float("-inf")), tl.load(IDXP + at, mask=m, other=0), 0)
        r = (b * C + cc) * 2  # the race's partials: residual, then p
        top_r, tok_r = _first_max(tl.load(BESTP + r, mask=m, other=-2.0), tl.load(BIDXP + r, mask=m, other=0), 0)
        _, tok_p = _first_max(tl.load(BESTP + r + 1, mask=m, other=-2.0), tl.load(BIDXP + r + 1, mask=m, other=0), 0)
        sampled = tl.where(top_r > 0, tok_r, tok_p)  # a residual with no mass left: p == q to the last bit
        tok = tl.where(tl.load(TEMP + b) > 0, sampled, greedy).to(tl.int64)
        i = tl.arange(0, KP)
        d = tl.load(DRAFT + b * s_d + i, mask=i < K, other=0)
        tl.store(OUT + b * s_o + 1 + i, tl.where((i == a) | (i == K), tok, d), mask=i <= K)
        tl.store(OUT + b * s_o, a.to(tl.int64))
        tl.store(BONUS_OUT + b, tok)


def _partials(n: int, v: int, device) -> tuple[int, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(chunks, max [n, C], argmax [n, C], sum [n, C], tau [n], mass [n]): the stats and threshold outputs."""
    c = triton.cdiv(v, CHUNK)
    f32 = dict(dtype=torch.float32, device=device)
    return (
        c,
        torch.empty(n, c, **f32),
        torch.empty(n, c, dtype=torch.int32, device=device),
        torch.empty(n, c, **f32),
        torch.empty(n, **f32),
        torch.empty(n, **f32),
    )


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    seed: Tensor,
    pos0: Tensor,
    stream: int,
    *,
    offset: int = 0,
    index: Optional[Tensor] = None,
    q_out: Optional[Tensor] = None,
    offsets: Optional[Tensor] = None,
) -> Tensor:
    """See the module docstring (the kernels; `sample_reference` without triton)."""
    if triton is None:
        return sample_reference(
            logits, temperature, top_p, seed, pos0, stream, offset=offset, index=index, q_out=q_out, offsets=offsets
        )
    b, t, v = logits.shape
    assert logits.stride(-1) == 1, "logits must be contiguous along the vocabulary"
    indexed = index is not None
    n, rows_per = (b, 1) if indexed else (b * t, t)
    c, maxp, idxp, sump, tau, mass = _partials(n, v, logits.device)
    cp = triton.next_power_of_2(c)
    where = (logits, logits.stride(0), logits.stride(1), rows_per, index if indexed else pos0,
             index.stride(0) if indexed else 0, temperature)  # fmt: skip
    _stats_kernel[(n, c)](*where, maxp, idxp, sump, v, c, INDEXED=indexed, BLOCK=CHUNK, num_warps=4)
    _threshold_kernel[(n,)](*where, top_p, maxp, idxp, sump, tau, mass, v, c,
                            INDEXED=indexed, K=_CANDIDATES, BLOCK=CHUNK, CP=cp, num_warps=8)  # fmt: skip
    bestp, bidxp = torch.empty_like(maxp), torch.empty_like(idxp)
    q = q_out if q_out is not None else maxp
    q_strides = (q.stride(0), q.stride(1) if q.dim() > 2 else 0)
    _race_kernel[(n, c)](*where, seed, pos0, offset, maxp, idxp, sump, tau, mass, bestp, bidxp, q, *q_strides, v, c,
                         STREAM=stream, INDEXED=indexed, WRITE_Q=q_out is not None, BLOCK=CHUNK, CP=cp,
                         num_warps=4)  # fmt: skip
    ids = torch.empty(n, dtype=torch.long, device=logits.device)
    offs = offsets if offsets is not None else ids
    _pick_kernel[(n,)](temperature, rows_per, maxp, idxp, bestp, bidxp, offs, ids, c,
                       HAS_OFFSETS=offsets is not None, CP=cp, num_warps=1)  # fmt: skip
    return ids.view(b, 1 if indexed else t)


def accept(
    logits: Tensor,
    draft: Tensor,
    q: Optional[Tensor],
    vocab_map: Optional[Tensor],
    temperature: Tensor,
    top_p: Tensor,
    seed: Tensor,
    lengths: Tensor,
    speculate: Tensor,
    out: Tensor,
) -> tuple[Tensor, Tensor]:
    """See the module docstring (the kernels; `accept_reference` without triton)."""
    if triton is None:
        return accept_reference(logits, draft, q, vocab_map, temperature, top_p, seed, lengths, speculate, out)
    b, k1, v = logits.shape
    k = k1 - 1
    assert draft.shape == (b, k) and out.shape[0] == b and out.shape[1] >= k + 2 and logits.stride(-1) == 1
    n, dev = b * k1, logits.device
    c, maxp, idxp, sump, tau, mass = _partials(n, v, dev)
    cp, kp = triton.next_power_of_2(c), triton.next_power_of_2(k + 1)
    where = (logits, logits.stride(0), logits.stride(1), k1, lengths, 0, temperature)
    _stats_kernel[(n, c)](*where, maxp, idxp, sump, v, c, INDEXED=False, BLOCK=CHUNK, num_warps=4)
    _threshold_kernel[(n,)](*where, top_p, maxp, idxp, sump, tau, mass, v, c,
                            INDEXED=False, K=_CANDIDATES, BLOCK=CHUNK, CP=cp, num_warps=8)  # fmt: skip
    a = torch.empty(b, dtype=torch.int32, device=dev)
    bestp = torch.empty(b, c, 2, dtype=torch.float32, device=dev)
    bidxp = torch.empty(b, c, 2, dtype=torch.int32, device=dev)
    qq = q if q is not None else maxp
    spec = speculate.view(torch.uint8)
    _accept_race_kernel[(b, c)](
        logits, logits.stride(0), logits.stride(1), draft, draft.stride(0),
        qq, qq.stride(0), qq.stride(1), vocab_map if vocab_map is not None else a,
        temperature, seed, lengths, spec, maxp, idxp, sump, tau, mass, a, bestp, bidxp, v, c,
        K=k, KP=kp, ONE_HOT=q is None, HAS_MAP=vocab_map is not None, BLOCK=CHUNK, CP=cp, num_warps=4,
    )  # fmt: skip
    bonus = torch.empty(b, dtype=torch.long, device=dev)
    _accept_pick_kernel[(b,)](draft, draft.stride(0), temperature, a, maxp, idxp, bestp, bidxp, out, out.stride(0),
                              bonus, c, K=k, KP=kp, CP=cp, num_warps=1)  # fmt: skip
    return out[:, 0], bonus
