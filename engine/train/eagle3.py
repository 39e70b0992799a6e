"""EAGLE-3 training with training-time test (TTT): the head unrolled over its own outputs.

At inference (engine/drafts/feature.py) a chain anchored at position j runs step 0 on the target's
features, then each later step on the draft's own previous output:

    step 0  at j      input (fc(f_j),        x_{j+1})   keys: step-0 keys 0..j
    step s  at j + s  input (h_{s-1}(j+s-1), d_s)       keys: step-0 keys 0..j, step-1..s keys at j+1..j+s

and every step predicts the token after its input token. Training unrolls exactly this for every anchor
of a sequence at once, with teacher forcing on tokens (d_s = x_{j+s+1}: a chain is only continued at
inference while its drafts are right) and the draft's own hidden states. With `p = j + s` the position
of step s, every step at p reads the token x_{p+1} and predicts x_{p+2}, so tokens and labels are the
same for all steps; what changes is the hidden input (step s at p reads step s-1's output at p-1) and
the keys a query sees:

    step-0 keys at positions <= p - s    (causal with an offset of s: the anchor's prefix)
    step-s' keys at position p - s + s'  for s' = 1..s (one "diagonal" key per earlier step)

    batch.tokens   [B, T]          x_{p+1}, the token the draft reads at position p
    batch.feats    [B, T, F]       target aux hidden states at p (F = n_aux * target hidden)
    batch.labels   [B, T, Vd]      target distribution at p+1 over the draft vocabulary (fp32)
    batch.top      [B, T]          draft id of the target's greedy token at p+1 (-1: outside the draft vocab)
    batch.mask     [B, T] bool     positions trained on (the answer part of a sample)
    step logits    [B, T, Vd]      one tensor per TTT step

Loss: cross-entropy against the target distribution (forward KL up to a constant), step s weighted
by `decay ** s`, as EAGLE-3 does. `chain_acceptance` turns the per-step greedy matches into what the
eval stage reports (accept_rate_pos_i, accept_length at k drafts), measured on held-out samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model import apply_rope


@dataclass
class Batch:
    tokens: Tensor  # [B, T] int64
    positions: Tensor  # [B, T] int64
    feats: Tensor  # [B, T, F]
    labels: Tensor  # [B, T, Vd] float32
    top: Tensor  # [B, T] int64
    mask: Tensor  # [B, T] bool

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())


def _shift(x: Tensor, n: int, dim: int) -> Tensor:
    """Shift right by n along dim, zero-filled: out[..., p, ...] = x[..., p - n, ...]."""
    if n == 0:
        return x
    t = x.shape[dim]
    pad = x.new_zeros(*x.shape[:dim], min(n, t), *x.shape[dim + 1:])
    return torch.cat([pad, x.narrow(dim, 0, t - min(n, t))], dim)


def ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], group: int) -> Tensor:
    """Attention of TTT step s = len(keys) - 1.

    q [B, H, T, D] (RoPE applied); keys/values: per step 0..s, [B, KV, T, D]. -> [B, H, T, D]
    """
    s, (_, _, t, d) = len(keys) - 1, q.shape
    scale = 1.0 / math.sqrt(d)
    k0, v0 = keys[0].repeat_interleave(group, 1), values[0].repeat_interleave(group, 1)  # [B, H, T, D]
    scores = (q @ k0.transpose(-1, -2)).float() * scale  # [B, H, T, T]
    pos = torch.arange(t, device=q.device)
    prefix = pos[None, :] <= pos[:, None] - s  # [T, T]: step-0 keys of the anchor's prefix
    scores = scores.masked_fill(~prefix, float("-inf"))
    diag_k = [_shift(keys[i], s - i, 2).repeat_interleave(group, 1) for i in range(1, s + 1)]
    diag_v = [_shift(values[i], s - i, 2).repeat_interleave(group, 1) for i in range(1, s + 1)]
    if diag_k:
        diag = torch.stack([(q * k).sum(-1) for k in diag_k], -1).float() * scale  # [B, H, T, s]
        scores = torch.cat([scores, diag], -1)  # [B, H, T, T + s]
    # Rows p < s have an empty prefix; with s >= 1 they still see diagonal keys, so no row is all -inf.
    probs = scores.softmax(-1).to(q.dtype)
    out = probs[..., :t] @ v0  # [B, H, T, D]
    for i, v in enumerate(diag_v):
        out = out + probs[..., t + i, None] * v
    return out


def ttt_forward(head, batch: Batch, steps: int) -> list[Tensor]:
    """Unroll an Eagle3Head for `steps` TTT steps -> per-step logits [B, T, Vd] (differentiable)."""
    m, att = head.midlayer, head.midlayer.self_attn
    b, t = batch.tokens.shape
    heads, kv, d = att.n_heads, att.n_kv, att.head_dim
    emb = m.input_layernorm(head.embed(batch.tokens).detach())  # [B, T, H]; the target's embedding, frozen
    cos = head.rope_cos[batch.positions][:, None].to(emb.dtype)  # [B, 1, T, D]
    sin = head.rope_sin[batch.positions][:, None].to(emb.dtype)
    g = head.fc(batch.feats.to(emb.dtype))  # [B, T, H]
    keys, values, logits = [], [], []
    for s in range(steps):
        x = torch.cat([emb, m.hidden_norm(g)], -1)  # [B, T, 2H]
        q = apply_rope(att.q_proj(x).view(b, t, heads, d).transpose(1, 2), cos, sin)  # [B, H, T, D]
        keys.append(apply_rope(att.k_proj(x).view(b, t, kv, d).transpose(1, 2), cos, sin))  # [B, KV, T, D]
        values.append(att.v_proj(x).view(b, t, kv, d).transpose(1, 2))
        o = ttt_attention(q, keys, values, heads // kv).transpose(1, 2).reshape(b, t, heads * d)
        h = g + att.o_proj(o)
        h = h + m.mlp(m.post_attention_layernorm(h))  # [B, T, H]
        logits.append(head.lm_head(head.norm(h)))
        g = _shift(h, 1, 1)  # step s+1 at p reads step s's output at p-1
    return logits


def step_valid(mask: Tensor, s: int) -> Tensor:
    """Positions where step s has a full chain behind it (anchor p - s >= 0) and is trained on."""
    return mask & (torch.arange(mask.shape[1], device=mask.device) >= s)[None]


def ttt_loss(logits: list[Tensor], batch: Batch, decay: float = 0.8) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted cross-entropy against the target distribution; also per-step loss and greedy accuracy
    (0-d tensors: reading them is a device sync, left to the caller)."""
    total, norm, stats = logits[0].new_zeros((), dtype=torch.float32), 0.0, {}
    for s, lg in enumerate(logits):
        valid = step_valid(batch.mask, s)
        n = valid.sum().clamp(min=1)
        ce = -(batch.labels * F.log_softmax(lg.float(), -1)).sum(-1)  # [B, T]
        loss_s = (ce * valid).sum() / n
        total = total + decay ** s * loss_s
        norm += decay ** s
        with torch.no_grad():
            stats[f"loss_{s}"] = loss_s.detach()
            stats[f"acc_{s}"] = ((lg.argmax(-1) == batch.top) & valid).sum() / n
    return total / norm, stats


@torch.no_grad()
def chain_acceptance(logits: list[Tensor], batch: Batch, k: int) -> tuple[Tensor, Tensor]:
    """Greedy chain drafting of k tokens from every anchor whose k positions are all trained on.

    -> (accepted [k]: chains whose drafts 1..i+1 were all right, i.e. the count behind
        accept_rate_pos_i; anchors: the number of chains). accept_length = 1 + sum(accepted) / anchors.
    """
    b, t = batch.mask.shape
    k = min(k, len(logits))
    ok = torch.ones(b, t, dtype=torch.bool, device=batch.mask.device)  # chain still accepted at anchor j
    usable = torch.ones_like(ok)
    accepted = []
    for s in range(k):
        right = (logits[s].argmax(-1) == batch.top) & batch.mask  # [B, T] at position p = j + s
        right_at_anchor = torch.roll(right, -s, 1)  # [B, T] indexed by anchor j
        in_range = torch.arange(t, device=ok.device)[None] < t - s
        usable &= torch.roll(batch.mask, -s, 1) & in_range
        ok = ok & right_at_anchor
        accepted.append(ok)
    anchors = usable.sum()
    return torch.stack([(a & usable).sum() for a in accepted]), anchors
