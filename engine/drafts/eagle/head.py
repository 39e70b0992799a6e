"""The EAGLE (EAGLE-1/2) head: one feature-level Llama decoder layer, `architectures: ["LlamaForCausalLMEagle"]`.

The feature is the target's final normed hidden state f:

    x   = fc(cat(embed(tok), f))       [b, t, 2 * hidden] -> [b, t, hidden]   (no input norm)
    h   = x + o_proj(attn(q/k/v_proj(x)));  h = h + mlp(post_attention_layernorm(h))
    logits = target lm_head(h)         [b, t, vocab]   (no final norm: h imitates f)

    tensors: fc.{weight,bias}, layers.0.self_attn.{q,k,v,o}_proj.weight,
             layers.0.post_attention_layernorm.weight, layers.0.mlp.{gate,up,down}_proj.weight
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from engine.drafts.common.head import DraftOut, HeadBase, llama_config
from engine.model import MLP, Attention, ModelArgs, RMSNorm
from engine.ops import MLPOut, Op
from kernels.gemv import cat_rmsnorm_gemv, gemv


class EagleIn(Op):
    """fc over [embed(token), feature] (no input norm), q/k/v, RoPE and the cache write:
    (tokens or embeds, hidden) -> (x [b, t, H]: the layer's input and residual, q [b, heads, t, d])."""

    def forward_native(self, tokens, embeds, hidden: Tensor, cache, a) -> tuple[Tensor, Tensor]:
        head = self.layer
        embeds = embeds if embeds is not None else head.embed_tokens(tokens)
        x = head.fc(torch.cat([embeds, hidden], dim=-1))  # [b, t, hidden]
        return x, head.attention.project(x, cache, a)

    def forward_fused(self, tokens, embeds, hidden: Tensor, cache, a) -> tuple[Tensor, Tensor]:
        head, layer = self.layer, self.layer.layers[0]
        table, rows = (embeds, None) if embeds is not None else head.embed_gather(tokens)  # gathered in-kernel
        fc = head.fc
        x = cat_rmsnorm_gemv(table, hidden, None, None, 0.0, fc.weight, fc.bias, index1=rows, norm=False)  # [b, t, H]
        att = layer.self_attn
        qkv = gemv(x, layer.qkv_weight, layer.qkv_bias)  # [b, t, (heads + 2 kv) * d]
        return x, a.rope_write(qkv, cache, 0, att.n_heads, att.n_kv, att.q_norm, att.k_norm)


class EagleOut(Op):
    """+ residual and the target's lm_head, no final norm (h imitates the target's normed feature)."""

    def forward_native(self, h: Tensor, delta: Optional[Tensor], sampled: bool) -> DraftOut:
        h = h if delta is None else h + delta
        logits = self.layer.lm_head(h)  # [b, t, vocab]
        return DraftOut(h, logits, logits.argmax(-1))

    def forward_fused(self, h: Tensor, delta: Optional[Tensor], sampled: bool) -> DraftOut:
        h = h if delta is None else h + delta  # [b, t, hidden]
        y = gemv(h, self.layer.lm_head.weight, argmax=not sampled)  # [b, t, vocab] logits or [b, t] ids
        return DraftOut(h, y, None) if sampled else DraftOut(h, None, y)


class EagleHead(HeadBase):
    architecture = "LlamaForCausalLMEagle"

    def __init__(self, cfg: dict[str, Any], max_seq_len: int):
        super().__init__(cfg, max_seq_len)
        a = self.args
        self.fc = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=True)
        layer = nn.Module()
        layer.self_attn = Attention(a, 0)
        layer.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        layer.mlp = MLP(a)
        self.layers = nn.ModuleList([layer])
        self.qkv_in, self.mlp_out, self.out = EagleIn(self), MLPOut(layer, always_rows=True), EagleOut(self)
        self.init_buffers()

    @property
    def attention(self) -> Attention:
        return self.layers[0].self_attn

    @property
    def feature_width(self) -> int:
        return self.args.hidden_size  # the target's final hidden state

    @property
    def layer(self) -> nn.Module:
        return self.layers[0]

    def logits(self, h: Tensor) -> Tensor:
        """out_hidden [..., hidden] -> logits [..., vocab]: the target's lm_head on h (no final norm)."""
        return self.out(h, None, True).logits


def eagle_config(target: ModelArgs) -> dict:
    """config.json of a one-layer EAGLE head of the target's shape (random init, training)."""
    return llama_config(target, EagleHead.architecture)
