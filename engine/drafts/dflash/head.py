"""DFlash: a block-diffusion drafter. One forward proposes a whole block of draft tokens.

Model (z-lab's `DFlashDraftModel`, with decoder layers of the target's width: Qwen3 layers, q/k norms
included, for a target with q/k norms (config.json model_type qwen3, z-lab's Qwen3 drafters), else Llama's):

    c      = hidden_norm(fc(aux))          aux [b, t, n_aux * target_hidden] -> c [b, t, hidden]    (context)
    block  = [x_L, m, ..., m]              [b, B]: the bonus token, then B - 1 mask tokens (mask_token_id)
    x      = embed(block)                  [b, B, hidden]: the target's embedding (shared, never stored)
    layer l (num_hidden_layers decoder layers, q from the block only):
             keys/values = k_l/v_l(c) at the context positions 0..L-1   (the draft's KV cache)
                         + k_l/v_l(input_layernorm(x)) at L..L+B-1      (the block itself)
             every block query sees all of them: non-causal inside the block
    logits = target lm_head(norm(h))[:, 1:k+1]   [b, k, vocab]: d_i = argmax at block index i

The context enters every layer as extra keys and values only: it has no queries, no MLP, no residual
stream, so writing it is a few matmuls and one cache scatter per layer, with no attention at all. On the
fused path it is 2 + layers kernels: fc, then hidden_norm in the prologue of one projection onto every
layer's k and v rows stacked ([layers * 2 * kv * d, hidden]), then RoPE + cache write per layer.

Cache discipline (the draft's static cache, [layers, batch, kv_heads, max_seq + B + 1, head_dim]):

    slots 0..L-1      context k/v of positions 0..L-1 (L = tokens in the target cache), written by
                      `begin` (the prompt) and `commit` (the verified positions L..L+a of each round,
                      from the verify's aux features; rejected positions go to the dummy slot)
    slots L..L+B-1    this round's block, written by `propose` before its attention reads them; stale
                      afterwards, and overwritten before anything reads them again: the next commit
                      rewrites L..L+a and the next block L+a+1..L+a+B, a superset of the rest

    Block queries attend over slots 0..L+B-1: every query of a row gets qpos = L + B - 1 (the slot
    bound that `AttnInputs.mask` and the Triton kernel read) while RoPE uses its own position.
    With a context window W (config.json's sliding_window over `sliding_attention` layers), a query
    at position p reads slots > p - W only (AttnInputs.qlo): a drafter trained on samples of a few
    hundred tokens meets no longer key distances at inference than it was trained on.

In the round (engine/speculative/round.py): the proposal is one block forward [b, B] (phase draft), the extend one
context write over the k + 1 verified positions [b, k + 1] (phase extend, no attention).

Checkpoint (config.json + model.safetensors, no embedding and no lm_head: both are the target's):

    config:  architectures ["DFlashDraftModel"], model_type (llama | qwen3), the layers' shape keys
             (head_dim included), num_hidden_layers, block_size,
             mask_token_id, target_hidden_size, dflash_config.{target_layer_ids (output_of),
             block_size, mask_token_id}; with a window: layer_types (all sliding_attention),
             sliding_window, is_causal false
    tensors: fc.weight, hidden_norm.weight, layers.N.{input_layernorm,post_attention_layernorm}.weight,
             layers.N.self_attn.{q,k,v,o}_proj.weight, layers.N.mlp.{gate,up,down}_proj.weight, norm.weight;
             qwen3: layers.N.self_attn.{q,k}_norm.weight [head_dim] too
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor, nn

from engine.drafts.common.head import DraftOut, HeadBase, llama_config
from engine.model import DecoderLayer, ModelArgs, RMSNorm, StaticKVCache
from engine.ops import AttnInputs, Op
from kernels.gemv import add_rmsnorm_gemv, gemv

ARCHITECTURE = "DFlashDraftModel"
SLIDING = "sliding_attention"  # Hugging Face's layer type of a windowed layer (z-lab's reference reads it)
WINDOW_KEYS = ("layer_types", "sliding_window", "is_causal")


def window_keys(num_layers: int, window: int) -> dict:
    """config.json keys of a context window of `window` positions: every layer a non-causal
    `sliding_attention` layer (is_causal false: the block stays non-causal). No keys for window 0."""
    if not window:
        return {}
    return {"layer_types": [SLIDING] * num_layers, "sliding_window": window, "is_causal": False}


def context_window(cfg: dict) -> int:
    """The context window a config.json declares (0: none)."""
    return int(cfg["sliding_window"]) if SLIDING in (cfg.get("layer_types") or ()) else 0


def dflash_value(cfg: dict, key: str, default: Any = None) -> Any:
    """A DFlash setting from `dflash_config` (z-lab's place), else the top level of config.json."""
    return (cfg.get("dflash_config") or {}).get(key, cfg.get(key, default))


def dflash_config(
    target: ModelArgs,
    aux_output_of: list[int],
    block_size: int,
    mask_token_id: int,
    num_layers: int,
    intermediate_size: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    window: int = 0,
) -> dict:
    """config.json of a DFlash head of the target's width (random init, training); intermediate_size and
    num_kv_heads: the layers' MLP width and key/value heads (None: the target's); window: the context
    window (0: none)."""
    return {
        **llama_config(target, ARCHITECTURE),  # the Llama shape keys of a head of the target's width
        "model_type": "qwen3" if target.qk_norm else "llama",  # z-lab's layer for the target's family
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_key_value_heads": num_kv_heads or target.num_kv_heads,
        "num_hidden_layers": num_layers,
        "tie_word_embeddings": False,
        "target_hidden_size": target.hidden_size,
        "num_target_layers": target.num_layers,
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "dflash_config": {
            "target_layer_ids": list(aux_output_of),
            "block_size": block_size,
            "mask_token_id": mask_token_id,
        },
        **window_keys(num_layers, window),
    }


class ContextWrite(Op):
    """The context's k/v into every layer's cache: (feats [b, t, F], cache, a) -> None. Fused: fc, then
    hidden_norm in the prologue of one projection onto every layer's k and v rows, then RoPE + cache
    write per layer: 2 + layers kernels instead of about 15 per layer."""

    def forward_native(self, feats: Tensor, cache: StaticKVCache, a: AttnInputs) -> None:
        head = self.layer
        c = head.context(feats)  # [b, t, hidden]
        for layer in head.layers:
            layer.self_attn.write_kv(c, cache, a)

    def forward_fused(self, feats: Tensor, cache: StaticKVCache, a: AttnInputs) -> None:
        head, norm = self.layer, self.layer.hidden_norm
        kv = add_rmsnorm_gemv(
            gemv(feats, head.fc.weight),
            None,
            norm.weight,
            norm.variance_epsilon,
            head.context_kv_weight,
            head.context_kv_bias,
        )[1]  # [b, t, layers * 2 * kv * d]
        for i, layer in enumerate(head.layers):
            att = layer.self_attn
            width = 2 * att.n_kv * att.head_dim
            a.rope_write(kv[..., i * width : (i + 1) * width], cache, att.layer_idx, 0, att.n_kv, k_norm=att.k_norm)


class BlockOut(Op):
    """+ residual, the final norm and the target's lm_head at the block's draft indices -> DraftOut."""

    def forward_native(self, x: Tensor, delta: Tensor, sampled: bool) -> DraftOut:
        head = self.layer
        logits = head.lm_head(head.norm(x + delta))  # [b, k, vocab]
        return DraftOut(None, logits, logits.argmax(-1))

    def forward_fused(self, x: Tensor, delta: Tensor, sampled: bool) -> DraftOut:
        head = self.layer  # + residual, norm, lm_head and (greedy) argmax in one kernel
        y = add_rmsnorm_gemv(
            x, delta, head.norm.weight, head.args.rms_norm_eps, head.lm_head.weight, argmax=not sampled
        )[1]  # [b, k] or [b, k, vocab]
        return DraftOut(None, y, None) if sampled else DraftOut(None, None, y)


class DFlashHead(HeadBase):
    """The drafter's weights and its two programs (context write, block forward) over a static cache."""

    architecture = ARCHITECTURE

    def __init__(self, cfg: dict[str, Any], max_seq_len: int):
        super().__init__(cfg, max_seq_len)
        self.args = a = ModelArgs.from_hf_config(cfg)  # num_hidden_layers: the draft's own layers
        self.block_size = int(dflash_value(cfg, "block_size"))
        self.mask_token_id = int(dflash_value(cfg, "mask_token_id"))
        self.n_aux = len(dflash_value(cfg, "target_layer_ids"))
        self.sliding_window = context_window(cfg)  # 0: every context position
        target_hidden = cfg.get("target_hidden_size", a.hidden_size)
        self.fc = nn.Linear(self.n_aux * target_hidden, a.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.write_context, self.out = ContextWrite(self), BlockOut(self)
        self.init_buffers()

    def use_fused_kernels(self) -> None:
        for layer in self.layers:
            layer.fuse_projections()
        # every layer's context k and v rows stacked: one projection writes the whole context
        kv = [m for layer in self.layers for m in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        self.context_kv_weight = torch.cat([m.weight for m in kv]).contiguous()  # [layers * 2 * kv * d, hidden]
        self.context_kv_bias = torch.cat([m.bias for m in kv]).contiguous() if kv[0].bias is not None else None
        self.write_context.fuse()
        self.out.fuse()
        self.fused = True

    # -- storage ------------------------------------------------------------------------------------
    @property
    def cache_slots(self) -> int:
        """Cache slots: a block may start at max_seq_len - 1 and reach B - 1 slots past it."""
        return self.max_seq_len + self.block_size

    @property
    def feature_width(self) -> int:
        return self.fc.in_features  # n_aux x target hidden

    def init_from_target(self, target) -> None:
        """Training from scratch: the final norm starts as the target's (it feeds the target's lm_head)."""
        with torch.no_grad():
            self.norm.weight.copy_(target.model.norm.scale())  # Gemma: its 1 + w

    # -- programs -----------------------------------------------------------------------------------
    def context(self, feats: Tensor, norm=lambda mod, x: mod(x)) -> Tensor:
        """aux [b, t, n_aux * target_hidden] -> c [b, t, hidden]: what every layer's context k/v read.
        `norm` (module, x): how hidden_norm runs (training passes its ForwardOps' norm)."""
        return norm(self.hidden_norm, self.fc(feats.to(self.fc.weight.dtype)))

    def block_inputs(self, positions: Tensor, valid: Optional[Tensor], kv_len, dtype) -> AttnInputs:
        """A block's attention metadata: non-causal inside the block (every query of a row sees up to
        the row's last slot; padding rows 0), RoPE at each token's own position; the mask covers kv_len
        + B (kv_len covers the live rows' blocks; + B a static kv_len too, when a block runs past it)."""
        a = self.attn_inputs(positions, valid, kv_len, dtype, kv_extra=self.block_size)
        if self.sliding_window:
            a = a.windowed(self.sliding_window, a.rope_cos, a.rope_sin)  # qlo [b, t]: slots > p - window
        last = a.qpos.amax(1, keepdim=True).expand_as(a.qpos)  # [b, t]
        return dataclasses.replace(a, qpos=last.masked_fill(a.slots == self.cache_slots, 0))

    def forward(self, tokens: Tensor, cache: StaticKVCache, a: AttnInputs, num_drafts: int, sampled: bool) -> DraftOut:
        """The block forward: tokens [b, B] = [x_L, m, ..., m] -> logits and / or ids [b, num_drafts] at
        block indices 1..num_drafts (DraftOut.hidden: None)."""
        x, delta = self.embed_tokens(tokens), None  # [b, B, hidden]
        for layer in self.layers:
            x, delta = layer(x, delta, cache, a)  # attention: eager under a breakable graph
        k = slice(1, num_drafts + 1)
        return self.out(x[:, k], delta[:, k], sampled)  # [b, k, ...]
