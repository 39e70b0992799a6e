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
    config:  draft_vocab_size, target_hidden_size (absent: hidden_size, as several public Qwen3 heads ship),
             eagle_config.eagle_aux_hidden_state_layer_ids (output_of; absent: EAGLE3's default), head_dim

    Without `draft_vocab_size` in config.json the head predicts over the target's whole vocabulary
    through the target's lm_head (shared storage, frozen): no lm_head, d2t or t2d is stored. This is
    sglang's `load_lm_head_from_target` convention; every target token can be drafted.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from engine.drafts.common.head import DraftOut, HeadBase, llama_config
from engine.model import MLP, Attention, ModelArgs, RMSNorm
from engine.ops import MLPOut, Op
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


class Eagle3In(Op):
    """fc (first step: the target's aux features), the token embedding, both norms, q/k/v, RoPE and the
    cache write: (tokens or embeds, hidden) -> (g [b, t, H]: the layer's residual, q [b, heads, t, d])."""

    def forward_native(self, tokens, embeds, hidden: Tensor, cache, a) -> tuple[Tensor, Tensor]:
        head, m = self.layer, self.layer.midlayer
        embeds = embeds if embeds is not None else head.embed_tokens(tokens)  # [b, t, H]
        g = head.fc(hidden) if hidden.shape[-1] != head.args.hidden_size else hidden  # [b, t, H]
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(g)], dim=-1)  # [b, t, 2H]
        return g, m.self_attn.project(x, cache, a)

    def forward_fused(self, tokens, embeds, hidden: Tensor, cache, a) -> tuple[Tensor, Tensor]:
        head, m = self.layer, self.layer.midlayer
        g = gemv(hidden, head.fc.weight) if hidden.shape[-1] != head.args.hidden_size else hidden  # [b, t, H]
        table, rows = (embeds, None) if embeds is not None else head.embed_gather(tokens)  # gathered in-kernel
        qkv = cat_rmsnorm_gemv(
            table,
            g,
            m.input_layernorm.weight,
            m.hidden_norm.weight,
            head.args.rms_norm_eps,
            m.qkv_weight,
            m.qkv_bias,
            index1=rows,
        )  # [b, t, (heads + 2 kv) * d]
        att = m.self_attn
        return g, a.rope_write(qkv, cache, 0, att.n_heads, att.n_kv, att.q_norm, att.k_norm)


class Eagle3Out(Op):
    """+ residual, the final norm and the lm_head (target ids of the argmax): (h, delta) -> DraftOut."""

    def forward_native(self, h: Tensor, delta: Optional[Tensor], sampled: bool) -> DraftOut:
        head = self.layer
        h = h if delta is None else h + delta
        logits = head.lm_head(head.norm(h))  # [b, t, draft vocab]
        return DraftOut(h, logits, head.to_target(logits.argmax(-1)))

    def forward_fused(self, h: Tensor, delta: Optional[Tensor], sampled: bool) -> DraftOut:
        head = self.layer
        offsets = None if head.shares_lm_head or sampled else head.d2t
        h, y = add_rmsnorm_gemv(
            h, delta, head.norm.weight, head.args.rms_norm_eps, head.lm_head.weight, argmax=not sampled, offsets=offsets
        )  # [b, t, hidden], [b, t, draft vocab] logits or [b, t] target ids
        return DraftOut(h, y, None) if sampled else DraftOut(h, None, y)


class Eagle3Head(HeadBase):
    architecture = "LlamaForCausalLMEagle3"

    def __init__(self, cfg: dict[str, Any], max_seq_len: int):
        super().__init__(cfg, max_seq_len)
        a = self.args
        self.n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.draft_vocab_size = cfg.get("draft_vocab_size") or a.vocab_size
        target_hidden = cfg.get("target_hidden_size", a.hidden_size)  # absent: the head's (sglang's reading)
        self.fc = nn.Linear(self.n_aux * target_hidden, a.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(a)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if cfg.get("draft_vocab_size") is not None:  # else the target's lm_head (shares_lm_head)
            self.lm_head = nn.Linear(a.hidden_size, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(a.vocab_size) < self.draft_vocab_size)
        self.qkv_in, self.mlp_out, self.out = Eagle3In(self), MLPOut(self.midlayer, always_rows=True), Eagle3Out(self)
        self.init_buffers()

    @property
    def attention(self) -> Attention:
        return self.midlayer.self_attn

    @property
    def feature_width(self) -> int:
        """Width of the target features the draft extend takes: n_aux x target hidden."""
        return self.fc.in_features

    @property
    def layer(self) -> Eagle3Layer:
        return self.midlayer

    def logits(self, h: Tensor) -> Tensor:
        """out_hidden [..., hidden] -> logits [..., draft vocab]: lm_head(norm(h))."""
        return self.out(h, None, True).logits

    def init_from_target(self, target) -> None:
        """Training from scratch: the final norm, and the own lm_head's rows (of the draft vocabulary set
        in d2t), start as the target's: the head starts from the target's output layer."""
        with torch.no_grad():
            self.norm.weight.copy_(target.model.norm.scale())  # Gemma: its 1 + w
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
