"""Multi-layer EAGLE (MTP-style): k draft modules, module i proposes draft token i + 1.

Module i (0-based) at position p reads the token x_{p+i+1} and a hidden state h^{i-1}_p (module
i - 1's output at p; module -1 is the target's final normed hidden state) and predicts x_{p+i+2}:

    x   = eh_proj(cat(enorm(embed(tok)), hnorm(h_in)))          [b, t, 2H] -> [b, t, H]
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
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from engine.decoder import DELTA, STREAM, AttnSource, Residual, StepNames, decoder_steps
from engine.drafts.common.head import HeadBase, llama_config
from engine.model import DecoderLayer, ModelArgs, RMSNorm, StaticKVCache
from engine.program import Step
from kernels.fused import add_rmsnorm
from kernels.gemv import add_rmsnorm_gemv, cat_rmsnorm_gemv, gemv

ARCHITECTURE = "LlamaForCausalLMMultiLayerEagle"


class StepCaches:
    """One KV pool per module: module i reads and writes `caches[i]` only."""

    def __init__(self, caches: list[StaticKVCache]):
        self.caches = caches

    def __getitem__(self, i: int) -> StaticKVCache:
        return self.caches[i]

    def rows(self, n: int | slice) -> "StepCaches":
        return StepCaches([c.rows(n) for c in self.caches])


class MTPModule(DecoderLayer):
    """A Llama decoder layer (layer_idx 0 of its own one-layer pool) with MTP's input fusion and norm."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, 0)
        h = args.hidden_size
        self.enorm = RMSNorm(h, args.rms_norm_eps)
        self.hnorm = RMSNorm(h, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, args.rms_norm_eps)

    def fuse_input(self, embeds: Tensor, hidden: Tensor) -> Tensor:
        """[b, t, H] token embeddings, [b, t, H] hidden input -> [b, t, H] the layer's input."""
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))


class MultiLayerEagleHead(HeadBase):
    architecture = ARCHITECTURE

    def __init__(self, cfg: dict[str, Any], max_seq_len: int):
        super().__init__(cfg, max_seq_len)
        self.num_modules = int(cfg["num_nextn_predict_layers"])
        self.layers = nn.ModuleList(MTPModule(self.args) for _ in range(self.num_modules))
        self.init_buffers()

    @property
    def feature_width(self) -> int:
        return self.args.hidden_size  # the target's final hidden state

    def use_fused_kernels(self) -> None:
        for mod in self.layers:
            mod.fuse_projections()
        self.fused = True

    def new_cache(self, batch_size: int) -> StepCaches:
        return StepCaches([super(MultiLayerEagleHead, self).new_cache(batch_size) for _ in self.layers])

    def module_program(self, i: int, caches: StepCaches, logits: str, sampled: bool = False) -> list[Step]:
        """Module i's forward as steps over its own pool `caches[i]`.

        env in:  tokens [b, t], hidden [b, t, H], positions [b, t], valid [b, t], kv_len,
                 logits_index [b] (logits="index")
        env out: out_hidden [b, t, H]; ids [b, 1] (the greedy token) at the last position ("last") or
                 at logits_index ("index"), [b, t] ("all"), absent ("none"); on the unfused path, or
                 `sampled` (then without ids on the fused path), the logits behind them ([b, 1 or t, vocab])
        """
        mod, cache, fused, eps = self.layers[i], caches[i], self.fused, self.args.rms_norm_eps
        dtype = next(self.parameters()).dtype

        def start(env):
            if fused:  # the embedding gather, both norms and eh_proj in one kernel
                return cat_rmsnorm_gemv(
                    self.embed.weight,
                    env["hidden"],
                    mod.enorm.weight,
                    mod.hnorm.weight,
                    eps,
                    mod.eh_proj.weight,
                    index1=env["tokens"],
                )
            return mod.fuse_input(self.embed(env["tokens"]), env["hidden"])  # [b, t, H]

        def pick(env, x):
            """x [b, t, ...] -> the rows the logits mode asks for: [b, 1 or t, ...]."""
            if logits == "last":
                return x[:, -1:]
            if logits == "index":
                return x[torch.arange(x.shape[0], device=x.device), env["logits_index"]][:, None]
            return x

        def finish(env):
            h, delta = env[STREAM], env[DELTA]
            if logits != "none" and fused and sampled:  # + residual and the norm, then the picked rows' lm_head
                env["out_hidden"], normed = add_rmsnorm(h, delta, mod.shared_head.norm.weight, eps)
                env["logits"] = gemv(pick(env, normed), self.lm_head.weight)  # [b, 1 or t, vocab]
                return
            if logits != "none" and fused:  # + residual, the head's norm, lm_head and argmax in one kernel
                env["out_hidden"], ids = add_rmsnorm_gemv(
                    h, delta, mod.shared_head.norm.weight, eps, self.lm_head.weight, argmax=True
                )
                env["ids"] = pick(env, ids)
                return
            env["out_hidden"] = h = h + delta  # [b, t, H]
            if logits != "none":
                env["logits"] = self.lm_head(mod.shared_head.norm(pick(env, h)))
                env["ids"] = env["logits"].argmax(-1)

        return decoder_steps(
            [Residual(mod, cache, fused)],
            cache,
            AttnSource(self, cache.dummy_slot, dtype),
            StepNames(f"mtp{i}_pre", f"mtp{i}_attn", "", f"mtp{i}_post"),
            start=start,
            finish=finish,
            kernel=self.attention_kernel,
            meta=self.graph_meta(),
        )


def multi_layer_config(target: ModelArgs, num_modules: int, intermediate_size: Optional[int] = None) -> dict:
    """config.json of `num_modules` modules of the target's width (random init, training);
    intermediate_size: the modules' MLP width (None: the target's)."""
    return {
        **llama_config(target, ARCHITECTURE),
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_nextn_predict_layers": num_modules,
        "tie_word_embeddings": True,
    }
