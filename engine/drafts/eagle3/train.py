"""EAGLE3's training forward: the head unrolled for `steps` TTT steps (engine/drafts/common/ttt.py), every
anchor of a sequence at once, over the target's aux features [B, T, n_aux * target hidden]."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.drafts.common.ttt import TORCH_OPS, ForwardOps, ttt_attend, ttt_attention
from engine.drafts.train_contract import Batch, shift


def ttt_forward(head, batch: Batch, steps: int, attention=ttt_attention, ops: ForwardOps = TORCH_OPS) -> list[Tensor]:
    """Unroll an Eagle3Head for `steps` TTT steps -> per-step logits [B, T, Vd] (differentiable)."""
    m, att = head.midlayer, head.midlayer.self_attn
    emb = ops.norm(m.input_layernorm, head.embed_tokens(batch.tokens).detach())  # [B, T, H]; the target's, frozen
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
        g = shift(h, 1, 1)  # step s+1 at p reads step s's output at p-1
    return logits
