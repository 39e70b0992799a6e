"""Training-time test (TTT) for the EAGLE-family heads (EAGLE3, EAGLE): the head unrolled over its own outputs.

At inference (engine/drafts/common/feature.py) a chain anchored at position j runs step 0 on the target's
features, then each later step on the draft's own previous output:

    step 0  at j      input (fc(f_j),        x_{j+1})   keys: step-0 keys 0..j
    step s  at j + s  input (h_{s-1}(j+s-1), d_s)       keys: step-0 keys 0..j, step-1..s keys at j+1..j+s

and every step predicts the token after its input token. Training unrolls exactly this for every anchor
of a sequence at once, with teacher forcing on tokens (d_s = x_{j+s+1}: a chain is only continued at
inference while its drafts are right) and the draft's own hidden states. With `p = j + s` the position
of step s (engine/drafts/train_contract.py's alignment), what changes from step to step is the hidden input
(step s at p reads step s-1's output at p-1) and the keys a query sees:

    step-0 keys at positions <= p - s    (causal with an offset of s: the anchor's prefix)
    step-s' keys at position p - s + s'  for s' = 1..s (one "diagonal" key per earlier step)

Attention: `ttt_attention` materializes the [T, T + s] scores (any device, the reference);
`ttt_attention_flex` is the same attention as one FlexAttention kernel (CUDA training). `ttt_attend` is
one unrolled step's attention block; each head's forward (engine/drafts/{eagle3,eagle}/train.py) wraps it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from engine.drafts.train_contract import shift
from kernels.rms_norm import rms_norm
from kernels.rope import rope, rope_reference


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
    diag_k = [shift(keys[i], s - i, 2).repeat_interleave(group, 1) for i in range(1, s + 1)]
    diag_v = [shift(values[i], s - i, 2).repeat_interleave(group, 1) for i in range(1, s + 1)]
    if diag_k:
        diag = torch.stack([(q * k).sum(-1) for k in diag_k], -1).float() * scale  # [B, H, T, s]
        scores = torch.cat([scores, diag], -1)  # [B, H, T, T + s]
    # Rows p < s have an empty prefix; with s >= 1 they still see diagonal keys, so no row is all -inf.
    probs = scores.softmax(-1).to(q.dtype)
    out = probs[..., :t] @ v0  # [B, H, T, D]
    if diag_v:  # slices, not probs[..., t + i]: an index computed from T would pin T under torch.compile
        out = out + torch.einsum("bhts,bhtsd->bhtd", probs[..., t:], torch.stack(diag_v, 3))
    return out


FLEX_BLOCK = 128  # FlexAttention's block: a sequence of one block compiles a kernel of its own
_MASK_TENSORS = (  # a BlockMask's block counts and indices, [1, 1, blocks(, blocks)]; q_*: the backward's
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


@functools.lru_cache(maxsize=None)
def flex_kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    # CUDA: the fused Triton kernel (forward and backward). Elsewhere the reference implementation,
    # forward only (FlexAttention has no CPU backward): what the CPU tests compare against.
    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


def flex(q: Tensor, k: Tensor, v: Tensor, mask, group: int) -> Tensor:
    """FlexAttention of q [B, H, Tq, D] over k, v [B, KV, Tk, D] under a block mask. On CUDA the sequence
    dims (and the mask's block counts) are dynamic from the first call: left to `dynamic=True`, torch 2.11
    compiles them static first and recompiles at the next shape, 10-20 s a compile."""
    if q.device.type == "cuda":
        for x in (q, k, v):
            torch._dynamo.maybe_mark_dynamic(x, 2)
        for x in (getattr(mask, name, None) for name in _MASK_TENSORS):
            for d in range(2, x.dim() if x is not None else 0):
                torch._dynamo.maybe_mark_dynamic(x, d)
    return flex_kernel(q.device.type)(q, k, v, block_mask=mask, enable_gqa=group > 1)


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
    `ttt_attention` also sees zero-filled ones; every other row is the same attention. A sequence of one
    block is padded to two (no row below T sees a padded key): one compiled kernel for every width."""
    s, t = len(keys) - 1, q.shape[2]
    tp = max(t, FLEX_BLOCK + 1)

    def pad(x: Tensor) -> Tensor:
        return torch.nn.functional.pad(x, (0, 0, 0, tp - t)) if tp > t else x

    mask = _ttt_block_mask(tp, s, q.device)
    k, v = torch.cat([pad(x) for x in keys], 2), torch.cat([pad(x) for x in values], 2)
    return flex(pad(q), k, v, mask, group)[:, :, :t]


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


def head_norm(norm, x: Tensor, heads: int, ops: ForwardOps) -> Tensor:
    """Qwen3's q/k norm in training: x [B, T, heads * D] with each head normed by `norm` (None: x as it is)."""
    if norm is None:
        return x
    b, t, _ = x.shape
    return ops.norm(norm, x.view(b, t, heads, -1)).view(b, t, -1)


def ttt_attend(
    att, x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor], values: list[Tensor], attention, ops: ForwardOps
) -> Tensor:
    """One unrolled step's attention: x [B, T, in] -> q/k/v with RoPE; this step's keys and values join
    the earlier steps' (`keys`, `values`, appended in place); -> o_proj of the output [B, T, H]."""
    b, t, _ = x.shape
    heads, kv, d = att.n_heads, att.n_kv, att.head_dim
    q = ops.rope(head_norm(att.q_norm, att.q_proj(x), heads, ops), cos, sin, heads)  # [B, heads, T, D]
    keys.append(ops.rope(head_norm(att.k_norm, att.k_proj(x), kv, ops), cos, sin, kv))  # [B, KV, T, D]
    values.append(att.v_proj(x).view(b, t, kv, d).transpose(1, 2))
    o = attention(q, keys, values, heads // kv).transpose(1, 2).reshape(b, t, heads * d)
    return att.o_proj(o)
