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
    batch.label_logits [B, T, Vd]  the target's logits z_{p+1} over the draft vocabulary (its dtype); the
                                   head learns softmax(z / label_temperature) (batch.labels: that, fp32)
    batch.top      [B, T]          draft id of x_{p+2}, the sample's next token: on the target's own greedy
                                   answers, its greedy token (-1: outside the draft vocab)
    batch.mask     [B, T] bool     positions trained on (the answer part of a sample)
    step logits    [B, T, Vd]      one tensor per TTT step

Attention: `ttt_attention` materializes the [T, T + s] scores (any device, the reference);
`ttt_attention_flex` is the same attention as one FlexAttention kernel (CUDA training).

Loss: cross-entropy against the target distribution (forward KL up to a constant), step s weighted
by `decay ** s`, as EAGLE-3 does; `kernels/soft_ce.py` computes it per position from the label logits
(kernel "triton": fused, without the fp32 [B, T, Vd] tensors of the plain-torch path).

`chain_lengths` turns the per-step greedy matches into the drafts a chain anchored at each j gets
accepted; `chain_acceptance` averages them over anchors (the per-position estimate: accept_rate_pos_i,
accept_length at k drafts) and `simulated_loop` replays the greedy loop on them (rounds start where the
previous one stopped: what the eval stage reports), on held-out samples.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from kernels.rms_norm import rms_norm
from kernels.rope import rope, rope_reference
from kernels.soft_ce import soft_cross_entropy


@dataclass
class Batch:
    tokens: Tensor  # [B, T] int64
    positions: Tensor  # [B, T] int64
    feats: Tensor  # [B, T, F]
    label_logits: Tensor  # [B, T, Vd] the target's logits over the draft vocabulary
    top: Tensor  # [B, T] int64
    mask: Tensor  # [B, T] bool
    label_temperature: float = 1.0  # labels = softmax(label_logits / T)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def labels(self) -> Tensor:  # [B, T, Vd] float32: the distribution the head learns
        return (self.label_logits.float() / self.label_temperature).softmax(-1)


def _shift(x: Tensor, n: int, dim: int) -> Tensor:
    """Shift right by n along dim, zero-filled: out[..., p, ...] = x[..., p - n, ...]."""
    if n == 0:
        return x
    t = x.shape[dim]
    pad = x.new_zeros(*x.shape[:dim], min(n, t), *x.shape[dim + 1 :])
    return torch.cat([pad, x.narrow(dim, 0, t - min(n, t))], dim)


def _shift_left(x: Tensor, n: int) -> Tensor:
    """out[:, p] = x[:, p + n] along dim 1, zero-filled at the end (position-indexed step n -> by anchor)."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], x.new_zeros(x.shape[0], min(n, x.shape[1]), *x.shape[2:])], 1)


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
    if diag_v:  # slices, not probs[..., t + i]: an index computed from T would pin T under torch.compile
        out = out + torch.einsum("bhts,bhtsd->bhtd", probs[..., t:], torch.stack(diag_v, 3))
    return out


@functools.lru_cache(maxsize=None)
def _flex_kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    # CUDA: the fused Triton kernel (forward and backward). Elsewhere the reference implementation,
    # forward only (FlexAttention has no CPU backward): what the CPU tests compare against.
    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


@functools.lru_cache(maxsize=1024)
def _ttt_block_mask(t: int, s: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_idx, kv_idx):  # step-0 keys at <= p - s, step i's key at p - s + i
        step, pos = kv_idx // t, kv_idx % t
        return torch.where(step == 0, pos <= q_idx - s, pos == q_idx - s + step)

    return create_block_mask(visible, None, None, t, (s + 1) * t, device=device)


def ttt_attention_flex(q: Tensor, keys: list[Tensor], values: list[Tensor], group: int) -> Tensor:
    """`ttt_attention` as one FlexAttention call: no [T, T] score matrix in memory, a fused backward.

    The keys of steps 0..s are concatenated along the sequence, [B, KV, (s+1) T, D], under a block mask
    (one per (T, s), cached). Rows p < s, which no loss reads, see only their own diagonal keys where
    `ttt_attention` also sees zero-filled ones; every other row is the same attention."""
    s, t = len(keys) - 1, q.shape[2]
    mask = _ttt_block_mask(t, s, q.device)
    return _flex_kernel(q.device.type)(
        q, torch.cat(keys, 2), torch.cat(values, 2), block_mask=mask, enable_gqa=group > 1
    )


def _autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


@dataclass(frozen=True)
class ForwardOps:
    """How `ttt_forward` runs the head's RMSNorms and RoPE.

    norm  (RMSNorm module, x [..., H]) -> [..., H]
    rope  (x [B, T, n * D], cos [B, T, D] fp32, sin, n) -> [B, n, T, D]

    TORCH_OPS: the modules and engine.model.apply_rope's formula (fp32 results from the fp32 master
    weights and rotation). TRITON_OPS (train.kernels=triton): kernels/rms_norm.py and kernels/rope.py, one
    kernel forward and one backward each; under autocast they write the autocast dtype, the values the
    next projection or the attention casts to anyway."""

    norm: Callable
    rope: Callable


TORCH_OPS = ForwardOps(norm=lambda mod, x: mod(x), rope=rope_reference)
TRITON_OPS = ForwardOps(
    norm=lambda mod, x: rms_norm(x, mod.weight, mod.variance_epsilon, _autocast_dtype(x), "triton"),
    rope=lambda x, cos, sin, n: rope(x, cos, sin, n, _autocast_dtype(x), "triton"),
)


def ttt_attend(
    att, x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor], values: list[Tensor], attention, ops: ForwardOps
) -> Tensor:
    """One unrolled step's attention: x [B, T, in] -> q/k/v with RoPE; this step's keys and values join
    the earlier steps' (`keys`, `values`, appended in place); -> o_proj of the output [B, T, H]."""
    b, t, _ = x.shape
    heads, kv, d = att.n_heads, att.n_kv, att.head_dim
    q = ops.rope(att.q_proj(x), cos, sin, heads)  # [B, heads, T, D]
    keys.append(ops.rope(att.k_proj(x), cos, sin, kv))  # [B, KV, T, D]
    values.append(att.v_proj(x).view(b, t, kv, d).transpose(1, 2))
    o = attention(q, keys, values, heads // kv).transpose(1, 2).reshape(b, t, heads * d)
    return att.o_proj(o)


def ttt_forward(head, batch: Batch, steps: int, attention=ttt_attention, ops: ForwardOps = TORCH_OPS) -> list[Tensor]:
    """Unroll an Eagle3Head for `steps` TTT steps -> per-step logits [B, T, Vd] (differentiable)."""
    m, att = head.midlayer, head.midlayer.self_attn
    emb = ops.norm(m.input_layernorm, head.embed(batch.tokens).detach())  # [B, T, H]; the target's embedding, frozen
    rot = torch.promote_types(emb.dtype, m.input_layernorm.weight.dtype)  # the norm module's output dtype
    cos = head.rope_cos[batch.positions].to(rot)  # [B, T, D]
    sin = head.rope_sin[batch.positions].to(rot)
    g = head.fc(batch.feats.to(emb.dtype))  # [B, T, H]
    keys, values, logits = [], [], []
    for _ in range(steps):
        x = torch.cat([emb, ops.norm(m.hidden_norm, g)], -1)  # [B, T, 2H]
        h = g + ttt_attend(att, x, cos, sin, keys, values, attention, ops)
        h = h + m.mlp(ops.norm(m.post_attention_layernorm, h))  # [B, T, H]
        logits.append(head.lm_head(ops.norm(head.norm, h)))
        g = _shift(h, 1, 1)  # step s+1 at p reads step s's output at p-1
    return logits


def step_valid(mask: Tensor, s: int) -> Tensor:
    """Positions where step s has a full chain behind it (anchor p - s >= 0) and is trained on."""
    return mask & (torch.arange(mask.shape[1], device=mask.device) >= s)[None]


def ttt_loss(
    logits: list[Tensor], batch: Batch, decay: float = 0.8, kernel: str = "torch"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Cross-entropy against the target distribution, step s weighted decay ** s; also per-step loss and
    greedy accuracy (0-d tensors: reading them is a device sync, left to the caller). Only the valid
    positions are computed; `kernel` is soft_cross_entropy's (torch or triton)."""
    total, norm, stats = logits[0].new_zeros((), dtype=torch.float32), 0.0, {}
    target = batch.label_logits.flatten(0, 1)  # [B*T, Vd]
    probs = batch.labels.flatten(0, 1) if kernel == "torch" else None  # the torch path's labels, once a batch
    for s, lg in enumerate(logits):
        valid = step_valid(batch.mask, s)  # [B, T] by position p = j + s
        n = valid.sum().clamp(min=1)
        ce, top = soft_cross_entropy(lg.flatten(0, 1), target, batch.label_temperature, valid.flatten(), kernel, probs)
        loss_s = (ce.view_as(valid) * valid).sum() / n
        total = total + decay**s * loss_s
        norm += decay**s
        with torch.no_grad():
            right = (top.view_as(valid) == batch.top) & valid  # [B, T] by position
            stats[f"loss_{s}"] = loss_s.detach()
            stats[f"acc_{s}"] = right.sum() / n
    return total / norm, stats


@torch.no_grad()
def chain_lengths(logits: list[Tensor], batch: Batch, k: int) -> Tensor:
    """Drafts a greedy chain of k anchored at j gets accepted (teacher-forced tokens) -> [B, T] int64.

    Step s of the chain at anchor j is logits[s] at p = j + s; it counts while every step before it
    was right and its label is a trained answer token."""
    b, t = batch.mask.shape
    ok = torch.ones(b, t, dtype=torch.bool, device=batch.mask.device)
    length = torch.zeros(b, t, dtype=torch.long, device=batch.mask.device)
    for s in range(min(k, len(logits))):
        right = (logits[s].argmax(-1) == batch.top) & batch.mask  # [B, T] at position p = j + s
        ok = ok & _shift_left(right, s)  # [B, T] indexed by anchor j
        length += ok
    return length


@torch.no_grad()
def chain_acceptance(length: Tensor, mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Greedy chain drafting of k tokens from every anchor whose k positions are all trained on.

    length [B, T] (chain_lengths over k steps), mask [B, T]
    -> (accepted [k]: chains whose drafts 1..i+1 were all right, i.e. the count behind
        accept_rate_pos_i; anchors: the number of chains). accept_length = 1 + sum(accepted) / anchors.
    """
    t = mask.shape[1]
    usable = mask.clone()
    for s in range(1, k):
        usable[:, : t - s] &= mask[:, s:]
    usable[:, t - k + 1 :] = False  # [B, T] anchors with all k positions in the row and trained on
    return torch.stack([((length > i) & usable).sum() for i in range(k)]), usable.sum()


def _trained_span(mask: Tensor) -> tuple[Tensor, Tensor]:
    """mask [B, T] -> (first trained position [B] (T when none), one past the last [B] (0 when none))."""
    pos = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask, pos, mask.shape[1]).amin(1), torch.where(mask, pos, -1).amax(1) + 1


def loop_anchors(length: Tensor, mask: Tensor, horizon: Optional[int] = None) -> Tensor:
    """Where the greedy draft-and-verify loop, replayed on teacher-forced chain lengths, starts its rounds.

    At inference a round anchored at j commits its accepted drafts plus the target's bonus token and the
    next round is anchored at j + accepted + 1; the first round follows the prompt (anchor p0 + 1, with
    p0 the first trained position: the first answer token comes from the prefill). Since the samples are
    the target's greedy answers, this is the loop's own sequence of rounds, without running it.
    `horizon` is the loop's max_new_tokens (the prefill's token included): no round starts past it.

    The rounds of a row are a path in the graph j -> j + length[j] + 1 (rounds at or past the row's end
    go to a sink, node T). The path from the first anchor is marked by pointer doubling, on the device and
    without a host sync: after level i the marks hold the path's first 2^i nodes, and level i + 1 adds
    their images under the 2^i-th power of the jump (the jump then squared by one gather); ceil(log2(T+1))
    levels cover any path. About 30 small kernels for a batch, instead of a Python walk per row.

    length [B, T] (chain_lengths), mask [B, T] -> anchors [B, T] bool, on length's device
    """
    b, t = mask.shape
    pos = torch.arange(t, device=length.device)
    first, stop = _trained_span(mask)  # [B]: rounds anchor in first + 1 .. stop - 1
    end = stop if horizon is None else torch.minimum(stop, first + horizon)  # [B]
    jump = torch.cat([pos + length + 1, length.new_full((b, 1), t)], 1)  # [B, T+1], node T: the sink
    jump = torch.where(jump < end[:, None], jump, t)
    start = torch.where((mask.sum(1) >= 2) & (first + 1 < end), first + 1, t)  # [B]
    marks = torch.zeros(b, t + 1, dtype=torch.uint8, device=length.device)
    marks[torch.arange(b, device=length.device), start] = 1
    for _ in range(max(1, math.ceil(math.log2(t + 1)))):
        marks = marks.scatter_reduce(1, jump, marks, "amax")  # keeps its own marks, adds their images
        jump = jump.gather(1, jump)
    return marks[:, :t].bool()


def simulated_loop(length: Tensor, mask: Tensor, horizon: Optional[int] = None) -> tuple[int, int, Tensor]:
    """The greedy loop replayed on teacher-forced chain lengths (`loop_anchors`): the round that crosses
    `horizon` counts its whole acceptance, as the eval stage counts a verify. Late tokens of long greedy
    answers (repetition) are the easiest to draft, so the figure depends on the horizon; the eval stage
    generates 256.

    length [B, T] (chain_lengths), mask [B, T] -> (tokens: accepted + 1 summed over rounds, rounds,
    anchors [B, T] bool, on length's device)
    """
    anchors = loop_anchors(length, mask, horizon)
    pos = torch.arange(mask.shape[1], device=length.device)
    _, stop = _trained_span(mask)
    tokens = torch.minimum(length + 1, stop[:, None] - pos)[anchors].sum()
    return int(tokens), int(anchors.sum()), anchors
