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

from engine.decoder import ATTN, ATTN_OUT, QUERY
from engine.drafts.common.head import HeadBase, llama_config
from engine.model import MLP, Attention, ModelArgs, RMSNorm
from kernels.gemv import add_rmsnorm_gemv, cat_rmsnorm_gemv, gemv


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
        self.init_buffers()

    @property
    def attention(self) -> Attention:
        return self.layers[0].self_attn

    @property
    def feature_width(self) -> int:
        return self.args.hidden_size  # the target's final hidden state

    @property
    def mlp_module(self) -> MLP:
        return self.layers[0].mlp

    def pre(self, env: dict, embeds: Optional[Tensor], cache) -> None:
        if self.fused:  # the embedding gather and fc in one kernel, then q/k/v
            table, rows = self._embed_rows(env, embeds)
            x = cat_rmsnorm_gemv(
                table, env["hidden"], None, None, 0.0, self.fc.weight, self.fc.bias, index1=rows, norm=False
            )  # [b, t, hidden]
            env["g"], env[QUERY] = x, self._attend_fused(gemv(x, self.qkv_weight, self.qkv_bias), cache, env[ATTN])
            return
        embeds = embeds if embeds is not None else self.embed(env["tokens"])
        x = self.fc(torch.cat([embeds, env["hidden"]], dim=-1))  # [b, t, hidden]; no input norm in EAGLE
        env["g"], env[QUERY] = x, self.attention.project(x, cache, env[ATTN])

    def post(self, env: dict, sampled: bool = False) -> None:
        layer = self.layers[0]
        if self.fused:
            o, down = layer.self_attn.o_proj, layer.mlp.down_proj
            h, act = add_rmsnorm_gemv(
                env["g"],
                gemv(env[ATTN_OUT], o.weight, o.bias),
                layer.post_attention_layernorm.weight,
                self.args.rms_norm_eps,
                self.gate_up_weight,
                self.gate_up_bias,
                swiglu=True,
            )
            h = h + gemv(act, down.weight, down.bias)  # [b, t, hidden]
            env["out_hidden"] = h
            env["logits" if sampled else "ids"] = gemv(h, self.lm_head.weight, argmax=not sampled)  # no final norm
            return
        h = env["g"] + layer.self_attn.o_proj(env[ATTN_OUT])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        env["out_hidden"], env["logits"] = h, self.lm_head(h)
        env["ids"] = env["logits"].argmax(-1)

    def logits(self, h: Tensor) -> Tensor:
        """out_hidden [..., hidden] -> logits [..., vocab]: the target's lm_head on h (no final norm)."""
        return gemv(h, self.lm_head.weight) if self.fused else self.lm_head(h)


def eagle_config(target: ModelArgs) -> dict:
    """config.json of a one-layer EAGLE head of the target's shape (random init, training)."""
    return llama_config(target, EagleHead.architecture)
