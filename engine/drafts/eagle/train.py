"""EAGLE (-1/-2) training: the feature-level head, unrolled with training-time test as EAGLE3's is.

The head (engine/drafts/eagle/head.py `EagleHead`) reads, at position p, the token x_{p+1} and a feature g_p:
the target's final normed hidden state f_p at the first step, its own output at p - 1 after that. No
input norm: fc maps [embed(x_{p+1}), g_p] to the layer's input x_p, whose residual stream the layer
adds attention and MLP to; the target's frozen lm_head reads the output directly (it imitates f).

    batch.tokens [B, T]     x_{p+1} at p
    batch.feats  [B, T, H]  f_p: the target's final normed hidden states
    per-step logits [B, T, V] over the target's vocabulary, in the TrainSpec alignment: step s at p
    reads step s - 1's output at p - 1 (engine/drafts/eagle3/train.py's `ttt_forward`, the same attention over
    the keys of every step so far)

Only the loss on tokens (the target's distribution, like EAGLE3's recipe) trains it; EAGLE-1's
feature regression is not used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.drafts.common.ttt import TORCH_OPS, ForwardOps, ttt_attend, ttt_attention
from engine.drafts.train_contract import Batch, shift


def eagle_forward(head, batch: Batch, steps: int, attention=ttt_attention, ops: ForwardOps = TORCH_OPS) -> list[Tensor]:
    """Unroll an EagleHead for `steps` TTT steps -> per-step logits [B, T, V] (differentiable in the head)."""
    layer = head.layers[0]
    att = layer.self_attn
    emb = head.embed_tokens(batch.tokens).detach()  # [B, T, H]; the target's embedding, frozen
    rot = torch.promote_types(emb.dtype, head.fc.weight.dtype)
    cos = head.rope_cos[batch.positions].to(rot)  # [B, T, D]
    sin = head.rope_sin[batch.positions].to(rot)
    g = batch.feats.to(emb.dtype)  # [B, T, H]
    keys, values, logits = [], [], []
    for _ in range(steps):
        x = head.fc(torch.cat([emb, g], -1))  # [B, T, H]
        h = x + ttt_attend(att, x, cos, sin, keys, values, attention, ops)
        h = h + layer.mlp(ops.norm(layer.post_attention_layernorm, h))  # [B, T, H]
        logits.append(head.lm_head(h))
        g = shift(h, 1, 1)  # step s+1 at p reads step s's output at p-1
    return logits
