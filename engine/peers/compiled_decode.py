"""gpt-fast-style decoding of the target's weights: the strongest plain-PyTorch thing a user would try
instead of a speculative engine (the `torch_compile` peer of engine/peers/hf.py).

The target's weights (fused into q/k/v and gate/up matrices, as gpt-fast does) drive a Llama forward in
plain torch ops over a static KV cache, and the one-token decode step runs under `torch.compile`
(`mode="reduce-overhead"`, fullgraph: CUDA graphs on CUDA; plain Inductor on CPU). Every shape is fixed:
prompts are left-padded to one width W, and at step t every row writes its key/value at slot W + t, so
the step takes the slot as a one-element tensor and compiles once. Row r's RoPE position is
slot - pad[r], and it attends to slots pad[r]..slot.

    cache k, v   [layers, batch, kv_heads, W + max_new, head_dim]
    prefill      tokens [b, W] -> next tokens [b]        eager, once per batch
    step         tokens [b, 1], slot [1] -> next [b]     compiled; greedy (argmax)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model import LlamaModel, ModelArgs, apply_rope, rope_tables
from kernels.rms_norm import rms_norm_reference as rms_norm  # the target's RMSNorm, plain torch

# ModelArgs fields this Llama forward does not implement (Gemma 3's), at their defaults or refused
NOT_HERE = ("hidden_act", "norm_unit_offset", "sandwich_norms", "qk_norm", "embed_scale", "attn_scale", "layer_types")


class CompiledDecoder(nn.Module):
    def __init__(self, target: LlamaModel, batch: int, width: int, max_new: int, device: torch.device):
        super().__init__()
        a, dtype = target.args, target.lm_head.weight.dtype
        defaults = {f.name: f.default for f in dataclasses.fields(ModelArgs)}
        other = {k: getattr(a, k) for k in NOT_HERE if getattr(a, k) != defaults[k]}
        if other:
            raise ValueError(f"eval.peers=torch_compile runs Llama-layout targets only; this target has {other}")
        self.heads, self.kv_heads, self.head_dim, self.eps = a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps
        self.width, self.max_new = width, max_new
        slots = width + max_new

        def own(t: Tensor) -> nn.Parameter:  # a contiguous copy on the device, frozen
            return nn.Parameter(t.detach().to(device=device, dtype=dtype).contiguous(), requires_grad=False)

        bb = target.model
        self.embed, self.norm, self.lm_head = (
            own(bb.embed_tokens.weight),
            own(bb.norm.weight),
            own(target.lm_head.weight),
        )
        self.layers = nn.ModuleList()
        for layer in bb.layers:
            att, mlp = layer.self_attn, layer.mlp
            m = nn.Module()
            m.ln1, m.ln2 = own(layer.input_layernorm.weight), own(layer.post_attention_layernorm.weight)
            m.wqkv = own(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]))  # [q+2kv, H]
            m.bqkv = own(torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])) if a.qkv_bias else None
            m.wo = own(att.o_proj.weight)  # [H, q]
            m.w13 = own(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))  # [2I, H]
            m.w2 = own(mlp.down_proj.weight)  # [H, I]
            self.layers.append(m)
        cos, sin = rope_tables(a, slots)  # [slots, head_dim] float32
        self.register_buffer("cos", cos.to(device=device, dtype=dtype))
        self.register_buffer("sin", sin.to(device=device, dtype=dtype))
        shape = (a.num_layers, batch, a.num_kv_heads, slots, a.head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype))
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype))
        self.register_buffer("pad", torch.zeros(batch, dtype=torch.long, device=device))  # [b] left padding
        self.register_buffer("keys", torch.arange(slots, device=device))  # [slots]
        mode = "reduce-overhead" if device.type == "cuda" else None
        self.step = torch.compile(self._step, mode=mode, fullgraph=True, dynamic=False)

    def _forward(self, tok: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        """tok [b, t] at cache slots [t]; mask [b, 1, t, slots] -> next tokens [b] (argmax at the last)."""
        b, t = tok.shape
        pos = (slots[None, :] - self.pad[:, None]).clamp(min=0)  # [b, t] RoPE positions
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [b, 1, t, d]
        q_w, kv_w = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h = F.embedding(tok, self.embed)  # [b, t, H]
        for i, m in enumerate(self.layers):
            qkv = F.linear(rms_norm(h, m.ln1, self.eps), m.wqkv, m.bqkv)  # [b, t, q + 2kv]
            q, k, v = qkv.split([q_w, kv_w, kv_w], dim=-1)
            q = apply_rope(q.view(b, t, self.heads, self.head_dim).transpose(1, 2), cos, sin)  # [b, heads, t, d]
            k = apply_rope(k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            self.k[i].index_copy_(2, slots, k)
            self.v[i].index_copy_(2, slots, v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2))
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, enable_gqa=True)
            h = h + F.linear(o.transpose(1, 2).reshape(b, t, q_w), m.wo)
            gate, up = F.linear(rms_norm(h, m.ln2, self.eps), m.w13).chunk(2, dim=-1)  # [b, t, I] each
            h = h + F.linear(F.silu(gate) * up, m.w2)
        return F.linear(rms_norm(h[:, -1], self.norm, self.eps), self.lm_head).argmax(-1)  # [b]

    def _step(self, tok: Tensor, slot: Tensor) -> Tensor:
        """tok [b, 1] at slot [1] (= W + t for every row) -> next tokens [b]."""
        mask = (self.keys[None, :] >= self.pad[:, None]) & (self.keys[None, :] <= slot)  # [b, slots]
        return self._forward(tok, slot, mask[:, None, None, :])

    def prefill(self, tokens: Tensor, pad: Tensor) -> Tensor:
        """tokens [b, W] left-padded by pad [b] -> first generated tokens [b]. A padding query attends to
        itself (finite values in slots that no live query reads)."""
        self.pad.copy_(pad)
        slots = self.keys[: self.width]  # [W]
        live = (self.keys[None, :] >= pad[:, None, None]) & (self.keys[None, :] <= slots[:, None])  # [b, W, slots]
        mask = live | (self.keys[None, :] == slots[:, None])  # [b, W, slots]
        return self._forward(tokens, slots, mask[:, None])
