"""Multi-layer EAGLE (MTP) training: every module teacher-forced over whole sequences at once.

Module i at position p reads x_{p+i+1} and module i-1's output at p (module 0: the target's final
hidden state f_p) and predicts x_{p+i+2}. With true tokens everywhere this is one causal forward per
module over the sequence, and it is exactly what inference computes while the drafts are right (see
engine/drafts/multi_layer/): no training-time-test unrolling is needed, because module i never
reads its own earlier outputs, only module i-1's at the same position.

    batch.tokens [B, T]     x_{p+1} at p        -> module i reads tokens[p + i] (shifted left by i)
    batch.feats  [B, T, H]  f_p: the target's final normed hidden states
    per-module logits [B, T, V], shifted right by i: out[i][:, q] = module i at q - i, which predicts
    x_{q+2} = label index q for the chain anchored at j = q - i (the TrainSpec convention)
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from engine.drafts.train_contract import Batch, shift, shift_left


def _causal_layer(mod, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The module's Llama layer over [B, T, H] with plain causal attention (no KV cache) -> [B, T, H]: its
    own q/k/v with RoPE and its MLP op (engine/ops.py MLPOut), the inference maths."""
    att = mod.self_attn
    b, t, _ = x.shape
    n = mod.input_layernorm(x)
    q, (k, v) = att.rotary_q(n, cos, sin), att.rotary_kv(n, cos, sin)  # [B, heads or kv, T, D]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=att.n_kv != att.n_heads)
    h, delta = mod.mlp_out(x, o.transpose(1, 2).reshape(b, t, att.n_heads * att.head_dim), None)
    return h + delta


def multi_layer_forward(head, batch: Batch, steps: int) -> list[Tensor]:
    """Per-module logits [B, T, V] in the TrainSpec alignment (differentiable in the head's weights)."""
    emb = head.embed_tokens(batch.tokens).detach()  # [B, T, H]; the target's embedding, frozen
    cos = head.rope_cos[batch.positions][:, None].to(emb.dtype)  # [B, 1, T, D]
    sin = head.rope_sin[batch.positions][:, None].to(emb.dtype)
    h, out = batch.feats.to(emb.dtype), []
    for i, mod in enumerate(head.layers):
        x = mod.fuse_input(shift_left(emb, i), h, head.zero_rows(batch.positions))  # [B, T, H]
        h = _causal_layer(mod, x, cos, sin)  # [B, T, H]: h^i_p
        out.append(shift(head.lm_head(mod.shared_head.norm(h)), i, 1))
    return out
