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

`block_attention` materializes those scores (CPU, evaluation, and the reference). Outputs follow the
trainer's layout (engine/drafts/train_contract.py): logits[s][:, p] is the prediction for label index p (the
target's distribution of x_{p+2}) made by the block anchored at j = p - s, at block index s + 1; so the
EAGLE-3 loss (`ttt_loss`, step s weighted decay ** s as in DFlash's position-decayed loss) and
`chain_acceptance` apply unchanged. Labels are over the full target vocabulary: the drafter predicts
through the target's lm_head.

The training step (train.attention=flex, the default on CUDA) runs `dflash_forward_packed`: only the
anchors whose block trains a label (a sample's prompt and the padding train none: about a third of the
positions of the self-distilled data), packed row after row into one sequence,

    block tokens  [1, N*blk]            N trained anchors, anchor-major
    keys          [1, KV, B*T (padded to a tile) + N*blk, D]   every row's context, then the blocks

under one FlexAttention call whose block mask is planned from the rows' trained spans on the host
(`AnchorPack`), and each step's lm_head and loss at its trained positions only (objective.Rows: the
lm_head fused with the loss): the same logits there as `dflash_forward`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.drafts.common.ttt import TORCH_OPS, ForwardOps, flex, head_norm
from engine.drafts.train_contract import Batch, Rows, shift
from engine.errors import ConfigError


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


def _layers(head, x: Tensor, c: Tensor, ctx_pos: Tensor, block_pos: Tensor, attend, ops: ForwardOps) -> Tensor:
    """The decoder layers over block tokens x [R, n, hidden], reading the context c [R, t, hidden] as keys
    and values only; RoPE at ctx_pos [R, t] and block_pos [R, n]. Each layer projects the keys and values of
    the context and the block in one pass over [c; norm(x)] ([R, t + n, hidden]: one projection each, one
    RoPE). `attend(q [R, H, n, D], k, v [R, KV, t + n, D], group)` is the attention ([R, H, n, D] out).
    -> the last layer's output [R, n, hidden]."""
    r, n, _ = x.shape
    rows = lambda pos: (head.rope_cos[pos].float(), head.rope_sin[pos].float())  # noqa: E731  [R, *, D] fp32
    (bcos, bsin), (kcos, ksin) = rows(block_pos), rows(torch.cat([ctx_pos, block_pos], 1))
    for layer in head.layers:
        att = layer.self_attn
        heads, kv, d = att.n_heads, att.n_kv, att.head_dim
        hn = ops.norm(layer.input_layernorm, x)  # [R, n, hidden]
        joint = torch.cat([c, hn.to(c.dtype)], 1)  # [R, t + n, hidden]: the projections cast as they would each
        q = ops.rope(head_norm(att.q_norm, att.q_proj(hn), heads, ops), bcos, bsin, heads)  # [R, H, n, D]
        k = ops.rope(head_norm(att.k_norm, att.k_proj(joint), kv, ops), kcos, ksin, kv)  # [R, KV, t + n, D]
        v = att.v_proj(joint).view(r, -1, kv, d).transpose(1, 2)
        o = attend(q, k, v, heads // kv)
        x = x + att.o_proj(o.transpose(1, 2).reshape(r, n, heads * d))
        x = x + layer.mlp(ops.norm(layer.post_attention_layernorm, x))
    return x


def _block_size(head, steps: int) -> int:
    """The head's block size, checking that `steps` block positions fit in it."""
    blk = head.block_size
    if not 1 <= steps < blk:
        raise ValueError(f"{steps} steps: a DFlash block of {blk} tokens predicts 1..{blk - 1}")
    return blk


def _block_tokens(head, bonus: Tensor) -> Tensor:
    """bonus [...] -> [..., blk]: each anchor's block [x_{j+1}, m, ..., m]."""
    tokens = bonus.new_full((*bonus.shape, head.block_size), head.mask_token_id)
    tokens[..., 0] = bonus
    return tokens


def dflash_forward(head, batch: Batch, steps: int, ops: ForwardOps = TORCH_OPS) -> list[Tensor]:
    """The blocks of all anchors -> per-step logits [B, T, vocab] (differentiable), steps <= block - 1, over
    the materialized scores (`block_attention`); `ops`: the RMSNorms and RoPE as modules and torch
    formulas, or as Triton kernels (train.kernels=triton)."""
    blk = _block_size(head, steps)
    b, t = batch.tokens.shape
    x = head.embed_tokens(_block_tokens(head, batch.tokens)).detach().view(b, t * blk, -1)  # the target's, frozen
    c = head.context(batch.feats, ops.norm)  # [B, T, hidden]
    block_pos = (batch.positions[:, :, None] + 1 + torch.arange(blk, device=x.device)).view(b, t * blk)
    window = head.sliding_window

    def attend(q, k, v, group):  # the context's t keys, then the blocks'
        return block_attention(q, k[:, :, :t], v[:, :, :t], k[:, :, t:], v[:, :, t:], blk, group, window)

    h = _layers(head, x.to(c.dtype), c, batch.positions, block_pos, attend, ops).view(b, t, blk, -1)
    w = head.lm_head.weight.detach()  # [vocab, hidden]: the target's, frozen
    # Block index s + 1 of anchor j predicts label index j + s: shift right by s into label layout, on the
    # hidden states (the zero rows stay zero through the norm and the lm_head), not on the logits.
    return [F.linear(ops.norm(head.norm, shift(h[:, :, s + 1], s, 1)), w) for s in range(steps)]


# --------------------------------------------------------------------------------- the packed training step
_TILE = 128  # FlexAttention's block-mask tile (queries and keys)


@dataclass
class AnchorPack:
    """The anchors of a training batch whose block trains at least one label, packed row after row.

    Anchor j of row b trains label p = j + s at step s where the row trains p (batch.spans' [first, end)),
    so the anchors are j in [first - steps + 1, end) per row; the others (the prompt's, the padding's)
    would be computed for no loss. Built on the host from batch.spans: no device sync.

        row, pos     [N] int64   each anchor's row b and position j (N >= 1: one idle anchor, row -1, when
                                 no row trains anything)
        picks        per step s: (anchor n [M_s], flat label position b * T + j + s [M_s]): the trained
                     (anchor, step) pairs, every valid position of the step once
        mask         the FlexAttention block mask over queries [N * blk] (anchor-major) and keys
                     [context B * T, padded to a tile; blocks N * blk]: a query of anchor n at block
                     index i reads its row's context p <= j (in the window) and its own block. The tiles
                     are planned here (a query tile's anchors are consecutive, so its context is one
                     range of key tiles, then the tiles of their own blocks): nothing [Q, KV]-sized is
                     evaluated. Context tiles that every query of a tile reads whole are full tiles (no
                     mask evaluated); the mask reads three int32 bounds per query (lo, hi, own).
    """

    row: Tensor
    pos: Tensor
    picks: list[tuple[Tensor, Tensor]]
    mask: object  # torch.nn.attention.flex_attention.BlockMask
    ctx_pad: int  # context keys, B * T padded to a tile: the blocks' keys start there

    @classmethod
    def plan(cls, spans: Tensor, t: int, steps: int, blk: int, window: int, device) -> "AnchorPack":
        from torch.nn.attention.flex_attention import BlockMask

        # numpy on the host: these arrays are small, and a torch op on them costs several times its numpy
        # twin in dispatch alone (the whole plan: 1.3 ms against 7.4 in torch with from_kv_blocks)
        first, end = spans.numpy().T  # [B] each
        start = np.maximum(first - steps + 1, 0)
        count = np.where(end > first, end - start, 0)  # [B] anchors of each row
        rows = np.repeat(np.arange(len(first)), count)  # [N]
        n = len(rows)
        pos = start[rows] + _rank(rows, count)  # [N] anchor j, ascending per row
        picks = []
        for s in range(steps):
            p = pos + s
            at = np.flatnonzero((p >= first[rows]) & (p < end[rows]))  # [M_s]
            picks += [at, rows[at] * t + p[at]]
        if n == 0:  # nothing trains: one idle anchor keeps the shapes valid
            rows, pos, n = np.array([-1]), np.array([0]), 1
        q_len = n * blk
        ctx_pad = -(-len(first) * t // _TILE) * _TILE  # the context keys, then the blocks from a tile start
        kv_len = ctx_pad + q_len
        # Per query (anchor-major, block index i): the flat context keys it reads, [lo, hi] (empty for an
        # idle anchor), and its block's first key. The mask reads these three int32 rows only: the per-key
        # work is four comparisons, where arithmetic on anchors and positions would cost several times more.
        index = np.arange(blk)
        lowest = np.maximum(pos[:, None] + 2 + index - window, 0) if window else np.zeros((n, blk), np.int64)
        lo = (np.maximum(rows, 0) * t)[:, None] + lowest  # [N, blk]
        hi = np.broadcast_to(np.where(rows >= 0, rows * t + pos, -1)[:, None], (n, blk))
        own = np.broadcast_to((ctx_pad + np.arange(n) * blk)[:, None], (n, blk))
        # Key tiles per query tile: the context tiles between its queries' lowest lo and highest hi, of which
        # those inside [highest lo, lowest hi] are full (every query reads every key: no mask evaluated
        # there); then the tiles of its anchors' own blocks.
        q_tiles, kv_tiles = -(-q_len // _TILE), -(-kv_len // _TILE)
        reads = lo <= hi  # [N, blk] a query of a small window can read no context at all
        big = 1 << 40

        def tiled(x, fill):  # [N, blk] -> [Qt, TILE], the last tile padded with `fill`
            return np.pad(x.ravel(), (0, q_tiles * _TILE - q_len), constant_values=fill).reshape(q_tiles, _TILE)

        ctx_lo = tiled(np.where(reads, lo, big), big).min(1)
        ctx_hi = tiled(np.where(reads, hi, -1), -1).max(1)
        some = ctx_hi >= 0
        ctx_lo, ctx_hi = np.where(some, ctx_lo // _TILE, 0), np.where(some, ctx_hi // _TILE + 1, 0)
        full_lo = -(-tiled(lo, -big).max(1) // _TILE)
        full_n = np.maximum((tiled(hi, big).min(1) + 1) // _TILE - full_lo, 0)
        full_lo = np.where(full_n > 0, full_lo, ctx_hi)  # no full tile: the partial range is the whole
        left_n, right_lo = full_lo - ctx_lo, full_lo + full_n
        right_n = ctx_hi - right_lo
        q0 = np.arange(q_tiles) * _TILE
        q1 = np.minimum(q0 + _TILE, q_len) - 1
        own_lo = (ctx_pad + q0 // blk * blk) // _TILE
        own_n = (ctx_pad + (q1 // blk + 1) * blk - 1) // _TILE - own_lo + 1
        # The tile tables, partial and full: each query tile's key tiles [Qt, KVt], and each key tile's query
        # tiles [KVt, Qt] (the backward's dK / dV loop), zeros but for their first count entries. The host
        # sends the entries and the device scatters them into one zeroed buffer: from_kv_blocks would
        # transpose the tables on the device with a few dozen small launches.
        size = q_tiles * kv_tiles
        partial = _table_entries(
            np.stack([ctx_lo, right_lo, own_lo], 1), np.stack([left_n, right_n, own_n], 1), kv_tiles
        )
        full = _table_entries(full_lo[:, None], full_n[:, None], kv_tiles)
        # everything the device needs in one pinned host buffer and one copy: the index lists (int64 on the
        # device), then the mask's int32 bounds, the tables' counts and their entries
        index_parts = [rows, pos, *picks, np.concatenate([partial.at, full.at + 2 * size])]
        mask_parts = [lo, hi, own, *partial.counts, *full.counts, np.concatenate([partial.values, full.values])]
        sizes = [x.size for x in index_parts + mask_parts]
        host = torch.empty(sum(sizes), dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
        np.concatenate([x.ravel() for x in index_parts + mask_parts], out=host.numpy(), casting="unsafe")
        dev = host.to(device, non_blocking=True)
        split = sum(sizes[: len(index_parts)])
        row_d, pos_d, *picks_d, at = dev[:split].long().split(sizes[: len(index_parts)])
        lo_d, hi_d, own_d, kv_num, q_num, full_num, full_q_num, values = dev[split:].split(sizes[len(index_parts) :])
        tables = torch.zeros(4 * size, dtype=torch.int32, device=device)
        tables[at] = values
        kv_idx, q_idx, full_idx, full_q_idx = tables.split(size)
        tile_q, tile_kv = (1, 1, q_tiles, kv_tiles), (1, 1, kv_tiles, q_tiles)

        def visible(b, h, q_idx, kv_idx):  # its row's context in [lo, hi], or its own block
            at = kv_idx - own_d[q_idx]
            return ((kv_idx >= lo_d[q_idx]) & (kv_idx <= hi_d[q_idx])) | ((at >= 0) & (at < blk))

        mask = BlockMask(
            seq_lengths=(q_len, kv_len),
            kv_num_blocks=kv_num.view(tile_q[:3]),
            kv_indices=kv_idx.view(tile_q),
            full_kv_num_blocks=full_num.view(tile_q[:3]),
            full_kv_indices=full_idx.view(tile_q),
            q_num_blocks=q_num.view(tile_kv[:3]),
            q_indices=q_idx.view(tile_kv),
            full_q_num_blocks=full_q_num.view(tile_kv[:3]),
            full_q_indices=full_q_idx.view(tile_kv),
            BLOCK_SIZE=(_TILE, _TILE),
            mask_mod=visible,
        )
        return cls(row_d, pos_d, list(zip(picks_d[0::2], picks_d[1::2])), mask, ctx_pad)


@dataclass
class _TableEntries:
    """One kind of tile table (partial or full) as its valid entries, for a [Qt, KVt] table by query tile
    followed by its [KVt, Qt] transpose in one flat buffer."""

    counts: tuple  # (by query tile [Qt], by key tile [KVt])
    at: np.ndarray  # [2E] flat positions: the query-tile table's entries, then the key-tile table's
    values: np.ndarray  # [2E] the key tile, then the query tile


def _table_entries(start, count, kv_tiles: int) -> _TableEntries:
    """Query tile r reads key tiles start[r, j] .. start[r, j] + count[r, j] - 1 (start, count [Qt, J], the
    runs ascending) -> its tables, each row's entries ascending (as BlockMask.from_kv_blocks orders them)."""
    q_tiles, n = count.shape[0], count.ravel()
    run = np.repeat(np.arange(n.size), n)  # [E] each entry's run
    q = run // count.shape[1]  # [E] query tile, ascending
    k = start.ravel()[run] + _rank(run, n)  # [E] key tile
    by_k = np.lexsort((q, k))  # the transpose: by key tile, then query tile
    qk, kk = q[by_k], k[by_k]
    by_q, by_kv = np.bincount(q, minlength=q_tiles), np.bincount(kk, minlength=kv_tiles)
    return _TableEntries(
        (by_q, by_kv),
        np.concatenate([q * kv_tiles + _rank(q, by_q), q_tiles * kv_tiles + kk * q_tiles + _rank(kk, by_kv)]),
        np.concatenate([k, qk]),
    )


def _rank(group, counts):
    """group [E] ascending, counts [G] its bincount -> each entry's rank within its group [E]."""
    return np.arange(group.size) - (np.cumsum(counts) - counts)[group]


def packed_block_attention(pack: AnchorPack):
    """FlexAttention over the pack's layout: q [1, H, N*blk, D]; k/v [1, KV, ctx_pad + N*blk, D], every row's
    context (padded to pack.ctx_pad keys), then the blocks."""

    def attend(q, k, v, group):
        return flex(q, k, v, pack.mask, group)

    return attend


def dflash_forward_packed(head, batch: Batch, steps: int, ops: ForwardOps = TORCH_OPS) -> list[Rows]:
    """The training step's forward (train.attention=flex): the blocks of the anchors that train a label only
    (`AnchorPack`), in one FlexAttention sequence, and each step's lm_head input at its valid positions
    only (objective.Rows: the loss forms the logits, fused with the cross-entropy). The same logits as
    `dflash_forward` there, for about the answer's share of its work: no block, attention query or lm_head
    row of a prompt or padding position."""
    blk = _block_size(head, steps)
    if batch.spans is None:
        raise ValueError("dflash_forward_packed: the batch has no spans (engine.train.data.target_batch sets them)")
    b, t = batch.tokens.shape
    pack = AnchorPack.plan(batch.spans, t, steps, blk, head.sliding_window, batch.tokens.device)
    row = pack.row.clamp(min=0)  # an idle anchor reads row 0's tokens; nothing reads its outputs
    x = head.embed_tokens(_block_tokens(head, batch.tokens[row, pack.pos])).detach()  # the target's, frozen
    x = x.flatten(0, 1)[None]  # [1, N*blk, hidden]
    pad = (0, pack.ctx_pad - b * t)  # the blocks' keys start at a tile
    c = F.pad(head.context(batch.feats, ops.norm).view(1, b * t, -1), (0, 0, *pad))  # [1, ctx_pad, hidden]
    ctx_pos = F.pad(batch.positions.reshape(1, -1), pad)  # [1, ctx_pad]
    block_pos = batch.positions[row, pack.pos][:, None] + 1 + torch.arange(blk, device=x.device)  # [N, blk]
    attend = packed_block_attention(pack)
    h = _layers(head, x.to(c.dtype), c, ctx_pos, block_pos.view(1, -1), attend, ops)
    h = h.view(-1, blk, h.shape[-1])  # [N, blk, hidden]
    w = head.lm_head.weight.detach()  # [vocab, hidden]: the target's, frozen
    return [Rows(ops.norm(head.norm, h[a, s + 1]), w, p) for s, (a, p) in enumerate(pack.picks)]


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
