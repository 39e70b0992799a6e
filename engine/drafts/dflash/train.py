"""DFlash training: every anchor's block at once, with exactly the attention the drafter sees at inference.

At inference (engine/drafts/dflash/) a block anchored at j (the target holds positions 0..j, its
bonus token is x_{j+1}) reads

    context  c_p = hidden_norm(fc(f_p))       for p = 0..j       keys/values only
    block    [x_{j+1}, m, ..., m]             at positions j+1..j+B, non-causal inside the block

and block index i = s + 1 predicts x_{j+s+2}. A block does not read its own drafts, so there is no
chain to unroll: the forward below runs the block of every anchor j = 0..T-1 of a sequence in one
pass, [B, T, blk] block tokens against T shared context keys (masked to p <= j) plus the block's own
blk keys, and is exact for every anchor, not an approximation of inference.

    batch.tokens  [B, T]       x_{p+1}: the bonus token of the block anchored at p
    batch.feats   [B, T, F]    target aux hidden states f_p: the context
    q             [B, H, T*blk, D]   block queries, anchor-major
    ctx scores    [B, H, T, blk, T]  masked to key p <= anchor j (and, with the head's context window W,
                                     to p > j + 1 + i - W for block index i at position j + 1 + i)
    block scores  [B, H, T, blk, blk]

`block_attention` materializes those scores (CPU, and the reference); `block_attention_flex`
(train.attention=flex, the default on CUDA) is the same attention as one FlexAttention call over the
keys [context; blocks], [B, KV, T + T*blk, D], whose block mask skips the tiles no query reads.

Outputs follow the trainer's layout (engine/train/objective.py): logits[s][:, p] is the prediction for
label index p (the target's distribution of x_{p+2}) made by the block anchored at j = p - s, at
block index s + 1; so the EAGLE-3 loss (`ttt_loss`, step s weighted decay ** s as in DFlash's
position-decayed loss) and `chain_acceptance` apply unchanged. Labels are over the full target
vocabulary: the drafter predicts through the target's lm_head.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.drafts.common.ttt import TORCH_OPS, ForwardOps, flex_kernel
from engine.errors import ConfigError
from engine.train.objective import Batch, _shift


def context_visible(anchor: Tensor, index: Tensor, key: Tensor, window: int) -> Tensor:
    """Block index `index` of `anchor` (at position anchor + 1 + index) reads context position `key`:
    key <= anchor, and key > anchor + 1 + index - window with a window (0: none). Broadcasts."""
    seen = key <= anchor
    if window:
        seen = seen & (anchor + 1 + index - key < window)
    return seen


def block_attention(
    q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, blk: int, group: int, window: int = 0
) -> Tensor:
    """Attention of every anchor's block over its context prefix (within `window` positions of each query;
    0: all of it) and its own block.

    q [B, H, T*blk, D]; k_ctx/v_ctx [B, KV, T, D] (context at positions 0..T-1); k_blk/v_blk
    [B, KV, T*blk, D] (anchor-major, as q). -> [B, H, T*blk, D]
    """
    b, h, n, d = q.shape
    t = n // blk
    scale = 1.0 / math.sqrt(d)
    kc, vc = k_ctx.repeat_interleave(group, 1), v_ctx.repeat_interleave(group, 1)  # [B, H, T, D]
    kb = k_blk.repeat_interleave(group, 1).view(b, h, t, blk, d)
    vb = v_blk.repeat_interleave(group, 1).view(b, h, t, blk, d)
    q5 = q.view(b, h, t, blk, d)
    ctx = (q @ kc.transpose(-1, -2)).float().view(b, h, t, blk, t) * scale  # [B, H, T, blk, T]
    pos = torch.arange(t, device=q.device)
    seen = context_visible(pos[:, None, None], torch.arange(blk, device=q.device)[None, :, None], pos, window)
    ctx = ctx.masked_fill(~seen, float("-inf"))  # [T anchor, blk, T key] over [B, H, T, blk, T]
    own = torch.einsum("bhjid,bhjkd->bhjik", q5, kb).float() * scale  # [B, H, T, blk, blk]
    probs = torch.cat([ctx, own], -1).softmax(-1).to(q.dtype)  # every row sees its own block: never all -inf
    out = probs[..., :t].reshape(b, h, n, t) @ vc  # [B, H, T*blk, D]
    return out + torch.einsum("bhjik,bhjkd->bhjid", probs[..., t:], vb).reshape(b, h, n, d)


def block_attention_flex(
    q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, blk: int, group: int, window: int = 0
) -> Tensor:
    """`block_attention` as one FlexAttention call over [context; blocks] keys, [B, KV, T + T*blk, D]:
    no [T, blk, T] score tensor in memory, and the tiles no query reads (past the anchor, before the
    window, the other blocks) are skipped."""
    t = k_ctx.shape[2]
    mask = _block_mask(t, blk, q.device, window)
    return flex_kernel(q.device.type)(
        q, torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2), block_mask=mask, enable_gqa=group > 1
    )


@functools.lru_cache(maxsize=1024)
def _block_mask(t: int, blk: int, device: torch.device, window: int = 0):
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_idx, kv_idx):  # query of anchor j: context keys p <= j (in its window), its own block
        anchor = q_idx // blk
        ctx = context_visible(anchor, q_idx % blk, kv_idx, window)
        return torch.where(kv_idx < t, ctx, (kv_idx - t) // blk == anchor)

    return create_block_mask(visible, None, None, t * blk, t + t * blk, device=device)


def dflash_forward(
    head, batch: Batch, steps: int, attention=block_attention, ops: ForwardOps = TORCH_OPS
) -> list[Tensor]:
    """The blocks of all anchors -> per-step logits [B, T, vocab] (differentiable), steps <= block - 1.
    `attention`: block_attention (materialized scores) or block_attention_flex (train.attention=flex);
    `ops`: the RMSNorms and RoPE as modules and torch formulas, or as Triton kernels (train.kernels=triton)."""
    blk = head.block_size
    if not 1 <= steps < blk:
        raise ValueError(f"{steps} steps: a DFlash block of {blk} tokens predicts 1..{blk - 1}")
    b, t = batch.tokens.shape
    tokens = torch.full((b, t, blk), head.mask_token_id, dtype=torch.long, device=batch.tokens.device)
    tokens[:, :, 0] = batch.tokens  # [B, T, blk]: [x_{j+1}, m, ..., m] per anchor j
    x = head.embed(tokens).detach().view(b, t * blk, -1)  # [B, T*blk, hidden]; the target's, frozen
    c = head.context(batch.feats, ops.norm)  # [B, T, hidden]
    x = x.to(c.dtype)
    block_pos = (batch.positions[:, :, None] + 1 + torch.arange(blk, device=x.device)).view(b, t * blk)
    rows = lambda pos: (head.rope_cos[pos].float(), head.rope_sin[pos].float())  # noqa: E731  [B, n, D] fp32
    (ccos, csin), (bcos, bsin) = rows(batch.positions), rows(block_pos)
    for layer in head.layers:
        att = layer.self_attn
        heads, kv, d = att.n_heads, att.n_kv, att.head_dim
        k_ctx = ops.rope(att.k_proj(c), ccos, csin, kv)  # [B, KV, T, D]
        v_ctx = att.v_proj(c).view(b, t, kv, d).transpose(1, 2)
        hn = ops.norm(layer.input_layernorm, x)  # [B, T*blk, hidden]
        q = ops.rope(att.q_proj(hn), bcos, bsin, heads)  # [B, H, T*blk, D]
        k_blk = ops.rope(att.k_proj(hn), bcos, bsin, kv)
        v_blk = att.v_proj(hn).view(b, t * blk, kv, d).transpose(1, 2)
        o = attention(q, k_ctx, v_ctx, k_blk, v_blk, blk, heads // kv, head.sliding_window)
        x = x + att.o_proj(o.transpose(1, 2).reshape(b, t * blk, heads * d))
        x = x + layer.mlp(ops.norm(layer.post_attention_layernorm, x))
    h = x.view(b, t, blk, -1)
    w = head.lm_head.weight.detach()  # [vocab, hidden]: the target's, frozen
    # Block index s + 1 of anchor j predicts label index j + s: shift right by s into label layout, on the
    # hidden states (the zero rows stay zero through the norm and the lm_head), not on the logits.
    return [F.linear(ops.norm(head.norm, _shift(h[:, :, s + 1], s, 1)), w) for s in range(steps)]


def check_dflash_training(cfg, plan) -> None:
    """train.ttt_steps and train.eval_k count block positions: at most block_size - 1."""
    block = plan.head_config["block_size"]
    for key in ("ttt_steps", "eval_k"):
        value = getattr(cfg.train, key)
        if value > block - 1:
            raise ConfigError(
                f"train.{key}",
                value,
                f"a DFlash block of {block} tokens predicts {block - 1} positions",
                f"1..{block - 1}, or a larger draft.block_size",
            )
