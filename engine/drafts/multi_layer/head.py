"""Multi-layer EAGLE (MTP-style): k draft modules, module i proposes draft token i + 1.

Module i (0-based) at position p reads the token x_{p+i+1} and a hidden state h^{i-1}_p (module
i - 1's output at p; module -1 is the target's final normed hidden state) and predicts x_{p+i+2}:

    x   = eh_proj(cat(enorm(embed(tok)), hnorm(h_in)))          [b, t, 2H] -> [b, t, H]
          (a public MTP layer, config ZERO_EMBED_AT_0: embed(tok) = 0 at position p = 0, as vLLM and sglang)
    h   = decoder layer(x)  (attention over module i's own KV pool, MLP)   -> out_hidden [b, t, H]
    logits = lm_head(norm_i(h))                                   the target's lm_head: [b, t, vocab]

Embedding and lm_head are the target's (shared storage). Every module has its own KV pool (its own
StaticKVCache) and its own graph runners: a module that wrote into another's pool would corrupt
that module's keys (sglang #22954; DESIGN.md hazard 6). Slots are positional per row (slot p holds
position p, padding goes to the dummy slot), so the only pool a module can get wrong is the cache.

Cache discipline, per row with L tokens in the target cache and x_L (the last emitted token) not:

    committed   module i holds true entries at positions 0..L-1-i (its token x_{p+i+1} is known)
    pool[i]     [b, H] module i's output at L-1-i, its last committed position
    propose     d_1 = module 0's output at L-1 (computed by the last commit); module i = 1..k-1 runs
                a window of i positions L-i..L-1 on tokens d_1..d_i and hidden states
                [pool[i-1], module i-1's window outputs], and its output at L-1 gives d_{i+1}
    commit      a of k accepted, L' = L + a + 1: module i re-runs positions L-i..L-i+k on the
                emitted tokens (the same k+1 tokens for every module) with hidden states
                [pool[i-1] (before this commit), module i-1's commit outputs]; rows valid up to
                index a; pool[i] = output at index a (position L'-1-i); module 0 at index a gives the
                next d_1

The window overwrites the positions that hold speculative entries from earlier rounds, and the commit
overwrites the window's: a module never attends over a stale slot. With every draft right the
proposal equals the teacher-forced forward of training (engine/drafts/multi_layer/train.py) exactly.

Checkpoint (`architectures: ["LlamaForCausalLMMultiLayerEagle"]`, DeepSeek-V3 MTP names per module):
    layers.{i}.{enorm,hnorm}.weight, layers.{i}.eh_proj.weight, layers.{i}.input_layernorm.weight,
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.post_attention_layernorm.weight,
    layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.shared_head.norm.weight
    config: num_nextn_predict_layers (modules), hidden_size, ... (a one-layer Llama config per module)
    zero_embed_at_position_0 (ZERO_EMBED_AT_0): true for a target's own MTP layers (public.py sets it)
A target checkpoint's own MTP layers load into these names through public.py's tables.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from engine.drafts.common.head import DraftOut, HeadBase, llama_config
from engine.model import DecoderLayer, ModelArgs, RMSNorm, StaticKVCache
from engine.ops import AttnInputs, Op
from kernels.fused import add_rmsnorm
from kernels.gemv import add_rmsnorm_gemv, cat_rmsnorm_gemv, gemv

ARCHITECTURE = "LlamaForCausalLMMultiLayerEagle"
ZERO_EMBED_AT_0 = "zero_embed_at_position_0"  # config.json: every module reads a zero token embedding at p = 0


class StepCaches:
    """One KV pool per module: module i reads and writes `caches[i]` only."""

    def __init__(self, caches: list[StaticKVCache]):
        self.caches = caches

    def __getitem__(self, i: int) -> StaticKVCache:
        return self.caches[i]

    def rows(self, n: int | slice) -> "StepCaches":
        return StepCaches([c.rows(n) for c in self.caches])

    def take(self, src: "StepCaches", width: int) -> None:
        for c, s in zip(self.caches, src.caches):
            c.take(s, width)

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)


class MTPIn(Op):
    """The module's input fusion: (tokens [b, t], hidden [b, t, H], positions [b, t]) ->
    eh_proj([enorm(embed), hnorm(hidden)]), the embedding zeroed where the head's zero_rows says."""

    def __init__(self, mod: "MTPModule", head):
        super().__init__(mod)
        self.head = head  # () -> the head (bound to the target's embedding after it is built)

    def forward_native(self, tokens: Tensor, hidden: Tensor, positions: Tensor) -> Tensor:
        head = self.head()
        return self.layer.fuse_input(head.embed_tokens(tokens), hidden, head.zero_rows(positions))  # [b, t, H]

    def forward_fused(self, tokens: Tensor, hidden: Tensor, positions: Tensor) -> Tensor:
        mod, head = self.layer, self.head()  # the embedding gather, both norms and eh_proj in one kernel
        table, rows = head.embed_gather(tokens)
        eps, w = mod.enorm.variance_epsilon, mod.eh_proj.weight
        zero = head.zero_rows(positions)
        return cat_rmsnorm_gemv(table, hidden, mod.enorm.weight, mod.hnorm.weight, eps, w, index1=rows, zero1=zero)


class MTPOut(Op):
    """+ residual, then for the picked rows the module's norm and the target's lm_head:
    (h, delta, pick) -> DraftOut. pick: x [b, t, ...] -> [b, 1 or t, ...] (None: no logits)."""

    def __init__(self, mod: "MTPModule", lm_head):
        super().__init__(mod)
        self.lm_head = lm_head  # () -> the target's lm_head

    def forward_native(self, h: Tensor, delta: Tensor, pick, sampled: bool) -> DraftOut:
        h = h + delta  # [b, t, H]
        if pick is None:
            return DraftOut(h, None, None)
        logits = self.lm_head()(self.layer.shared_head.norm(pick(h)))  # [b, 1 or t, vocab]
        return DraftOut(h, logits, logits.argmax(-1))

    def forward_fused(self, h: Tensor, delta: Tensor, pick, sampled: bool) -> DraftOut:
        norm = self.layer.shared_head.norm
        if pick is None:
            return DraftOut(h + delta, None, None)
        if sampled:  # + residual and the norm, then the picked rows' lm_head
            h, normed = add_rmsnorm(h, delta, norm.weight, norm.variance_epsilon)
            return DraftOut(h, gemv(pick(normed), self.lm_head().weight), None)
        h, ids = add_rmsnorm_gemv(h, delta, norm.weight, norm.variance_epsilon, self.lm_head().weight, argmax=True)
        return DraftOut(h, None, pick(ids))  # + residual, the norm, lm_head and argmax in one kernel


class MTPModule(DecoderLayer):
    """A Llama decoder layer (layer_idx 0 of its own one-layer pool) with MTP's input fusion and norm."""

    def __init__(self, args: ModelArgs, head: "MultiLayerEagleHead"):
        super().__init__(args, 0)
        h = args.hidden_size
        self.enorm = RMSNorm(h, args.rms_norm_eps)
        self.hnorm = RMSNorm(h, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, args.rms_norm_eps)
        self.fused_in = MTPIn(self, lambda: head)
        self.out = MTPOut(self, lambda: head.lm_head)

    def fuse_input(self, embeds: Tensor, hidden: Tensor, zero: Optional[Tensor] = None) -> Tensor:
        """[b, t, H] token embeddings, [b, t, H] hidden input -> [b, t, H] the layer's input; zero [b, t] bool
        (None: none): the rows whose embedding reads as zeros."""
        if zero is not None:
            embeds = embeds.masked_fill(zero[..., None], 0)
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))

    def fuse_projections(self) -> None:
        super().fuse_projections()
        self.fused_in.fuse()
        self.out.fuse()


class MultiLayerEagleHead(HeadBase):
    architecture = ARCHITECTURE

    def __init__(self, cfg: dict[str, Any], max_seq_len: int):
        super().__init__(cfg, max_seq_len)
        self.num_modules = int(cfg["num_nextn_predict_layers"])
        self.zero_embed_at_0 = bool(cfg.get(ZERO_EMBED_AT_0, False))  # our own heads: trained without it
        self.layers = nn.ModuleList(MTPModule(self.args, self) for _ in range(self.num_modules))
        self.init_buffers()

    @property
    def feature_width(self) -> int:
        return self.args.hidden_size  # the target's final hidden state

    def init_from_target(self, target) -> None:
        """Training from scratch: each module's norm starts as the target's final norm (it feeds the
        target's lm_head; Gemma: its 1 + w)."""
        with torch.no_grad():
            for mod in self.layers:
                mod.shared_head.norm.weight.copy_(target.model.norm.scale())

    def zero_rows(self, positions: Tensor) -> Optional[Tensor]:
        """positions [b, t] -> [b, t] bool, the rows whose token embedding every module reads as zeros
        (position 0 of a public MTP layer; padding rows, at position 0 too, are never read); None: none."""
        return positions == 0 if self.zero_embed_at_0 else None

    def use_fused_kernels(self) -> None:
        for mod in self.layers:
            mod.fuse_projections()
        self.fused = True

    def new_cache(self, batch_size: int) -> StepCaches:
        return StepCaches([super(MultiLayerEagleHead, self).new_cache(batch_size) for _ in self.layers])

    def module_forward(
        self,
        i: int,
        tokens: Tensor,
        hidden: Tensor,
        cache: StaticKVCache,
        a: AttnInputs,
        pick=None,
        sampled: bool = False,
    ) -> DraftOut:
        """Module i over its own pool: tokens [b, t], hidden [b, t, H] -> out_hidden [b, t, H] and, at
        the rows `pick` takes ([b, t, ...] -> [b, 1 or t, ...]; None: none), logits and / or ids."""
        mod = self.layers[i]
        x = mod.fused_in(tokens, hidden, a.rope_pos)  # [b, t, H]
        x, delta = mod(x, None, cache, a)  # attention: eager under a breakable graph
        return mod.out(x, delta, pick, sampled)


def multi_layer_config(target: ModelArgs, num_modules: int, intermediate_size: Optional[int] = None) -> dict:
    """config.json of `num_modules` modules of the target's width (random init, training);
    intermediate_size: the modules' MLP width (None: the target's)."""
    return {
        **llama_config(target, ARCHITECTURE),
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_nextn_predict_layers": num_modules,
        "tie_word_embeddings": True,
    }
