"""The EAGLE-3 head: one Llama decoder layer over fused aux features, with a reduced draft vocabulary.

EAGLE3 (public format, `architectures: ["LlamaForCausalLMEagle3"]`):

    g   = fc(aux)                      aux [b, t, n_aux * target_hidden] -> [b, t, hidden]   (first step)
    g   = previous draft output        [b, t, hidden]                                        (later steps)
    x   = cat(input_layernorm(embed(tok)), hidden_norm(g))           [b, t, 2 * hidden]
    h   = g + o_proj(attn(q/k/v_proj(x)));  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))          [b, t, draft_vocab];  target id = draft id + d2t[draft id]

    tensors: fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
             midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
             norm.weight, lm_head.weight, d2t [draft_vocab] int64, t2d [vocab] bool
    config:  draft_vocab_size, target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids (output_of)

    Without `draft_vocab_size` in config.json the head predicts over the target's whole vocabulary
    through the target's lm_head (shared storage, frozen): no lm_head, d2t or t2d is stored. This is
    sglang's `load_lm_head_from_target` convention; every target token can be drafted.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from engine.decoder import ATTN, ATTN_OUT, QUERY
from engine.drafts.common.head import HeadBase, llama_config
from engine.model import MLP, Attention, ModelArgs, RMSNorm
from kernels.gemv import add_rmsnorm_gemv, cat_rmsnorm_gemv, gemv


class Eagle3Layer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.self_attn = Attention(args, 0, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.mlp = MLP(args)


class Eagle3Head(HeadBase):
    architecture = "LlamaForCausalLMEagle3"

    def __init__(self, cfg: dict[str, Any], max_seq_len: int):
        super().__init__(cfg, max_seq_len)
        a = self.args
        self.n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.draft_vocab_size = cfg.get("draft_vocab_size") or a.vocab_size
        self.fc = nn.Linear(self.n_aux * cfg["target_hidden_size"], a.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(a)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if cfg.get("draft_vocab_size") is not None:  # else the target's lm_head (shares_lm_head)
            self.lm_head = nn.Linear(a.hidden_size, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(a.vocab_size) < self.draft_vocab_size)
        self.init_buffers()

    @property
    def attention(self) -> Attention:
        return self.midlayer.self_attn

    @property
    def feature_width(self) -> int:
        """Width of the target features the draft extend takes: n_aux x target hidden."""
        return self.fc.in_features

    @property
    def mlp_module(self) -> MLP:
        return self.midlayer.mlp

    def pre(self, env: dict, embeds: Optional[Tensor], cache) -> None:
        hidden, m, eps = env["hidden"], self.midlayer, self.args.rms_norm_eps
        if self.fused:  # fc, then the embedding gather, both norms and q/k/v in one kernel
            g = gemv(hidden, self.fc.weight) if hidden.shape[-1] != self.args.hidden_size else hidden  # [b, t, H]
            table, rows = self._embed_rows(env, embeds)
            qkv = cat_rmsnorm_gemv(
                table,
                g,
                m.input_layernorm.weight,
                m.hidden_norm.weight,
                eps,
                self.qkv_weight,
                self.qkv_bias,
                index1=rows,
            )  # [b, t, (heads + 2 kv) * d]
            env["g"], env[QUERY] = g, self._attend_fused(qkv, cache, env[ATTN])
            return
        embeds = embeds if embeds is not None else self.embed(env["tokens"])  # [b, t, H]
        g = self.fc(hidden) if hidden.shape[-1] != self.args.hidden_size else hidden  # [b, t, hidden]
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(g)], dim=-1)  # [b, t, 2 * hidden]
        env["g"], env[QUERY] = g, m.self_attn.project(x, cache, env[ATTN])

    def post(self, env: dict, sampled: bool = False) -> None:
        m, eps = self.midlayer, self.args.rms_norm_eps
        if self.fused:  # o_proj; + residual, norm, gate_up, SwiGLU; down; + residual, norm, lm_head (argmax)
            o = m.self_attn.o_proj
            h, act = add_rmsnorm_gemv(
                env["g"],
                gemv(env[ATTN_OUT], o.weight, o.bias),
                m.post_attention_layernorm.weight,
                eps,
                self.gate_up_weight,
                self.gate_up_bias,
                swiglu=True,
            )
            mlp = gemv(act, m.mlp.down_proj.weight, m.mlp.down_proj.bias)
            env["out_hidden"], env["logits" if sampled else "ids"] = add_rmsnorm_gemv(
                h,
                mlp,
                self.norm.weight,
                eps,
                self.lm_head.weight,
                argmax=not sampled,
                offsets=None if self.shares_lm_head or sampled else self.d2t,
            )  # [b, t, hidden], [b, t] target ids or [b, t, draft vocab] logits
            return
        h = env["g"] + m.self_attn.o_proj(env[ATTN_OUT])
        h = h + m.mlp(m.post_attention_layernorm(h))
        env["out_hidden"], env["logits"] = h, self.lm_head(self.norm(h))  # [b, t, hidden], [b, t, draft vocab]
        env["ids"] = self.to_target(env["logits"].argmax(-1))

    def logits(self, h: Tensor) -> Tensor:
        """out_hidden [..., hidden] -> logits [..., draft vocab]: lm_head(norm(h))."""
        if self.fused:
            return add_rmsnorm_gemv(h, None, self.norm.weight, self.args.rms_norm_eps, self.lm_head.weight)[1]
        return self.lm_head(self.norm(h))

    def init_from_target(self, target) -> None:
        """Training from scratch: the final norm, and the own lm_head's rows (of the draft vocabulary set
        in d2t), start as the target's: the head starts from the target's output layer."""
        with torch.no_grad():
            self.norm.weight.copy_(target.model.norm.weight)
            if not self.shares_lm_head:
                used = self.to_target(torch.arange(self.draft_vocab_size, device=self.d2t.device))  # [draft_vocab]
                self.lm_head.weight.copy_(target.lm_head.weight[used.to(target.lm_head.weight.device)])

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids if self.shares_lm_head else draft_ids + self.d2t[draft_ids]


def eagle3_config(
    target: ModelArgs,
    aux_output_of: list[int],
    draft_vocab_size: Optional[int] = None,
    lm_head: str = "own",
    intermediate_size: Optional[int] = None,
) -> dict:
    """A public-format EAGLE3 config.json for a head matching `target` (random init, training).
    lm_head="own": its own lm_head over `draft_vocab_size` tokens (None: the target's vocabulary);
    "target": the target's lm_head, so no draft_vocab_size key (Eagle3Head.shares_lm_head).
    intermediate_size: the draft layer's MLP width (None: the target's)."""
    vocab = {} if lm_head == "target" else {"draft_vocab_size": draft_vocab_size or target.vocab_size}
    return {
        **llama_config(target, Eagle3Head.architecture),
        "intermediate_size": intermediate_size or target.intermediate_size,
        "tie_word_embeddings": False,
        **vocab,
        "target_hidden_size": target.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_output_of), "use_aux_hidden_state": True},
    }
