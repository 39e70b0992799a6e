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
proposal equals the teacher-forced forward of training (engine/train/multi_layer.py) exactly.

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

from engine.drafts.base import DeviceDraft, FeatureKind, write_rows
from engine.drafts.heads import _Head, eagle_config
from engine.graphs.runner import InputSpec
from engine.model import AttnInputs, DecoderLayer, ModelArgs, RMSNorm, StaticKVCache
from engine.program import Step, merge_runs, run_steps, scoped
from kernels.gemv import add_rmsnorm_gemv, cat_rmsnorm_gemv

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


class MultiLayerEagleHead(_Head):
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

    def module_program(self, i: int, caches: StepCaches, logits: str) -> list[Step]:
        """Module i's forward as steps over its own pool `caches[i]`.

        env in:  tokens [b, t], hidden [b, t, H], positions [b, t], valid [b, t], kv_len,
                 logits_index [b] (logits="index")
        env out: out_hidden [b, t, H]; ids [b, 1] (the greedy token) at the last position ("last") or
                 at logits_index ("index"), [b, t] ("all"), absent ("none"); on the unfused path also
                 the logits behind them ([b, 1 or t, vocab])
        """
        mod, cache, fused, eps = self.layers[i], caches[i], self.fused, self.args.rms_norm_eps
        dtype = next(self.parameters()).dtype

        def start(env):
            env["attn"] = AttnInputs.build(
                env["positions"], env["valid"], self.rope_cos, self.rope_sin, cache.dummy_slot, dtype
            )
            if fused:  # the embedding gather, both norms and eh_proj in one kernel
                x = cat_rmsnorm_gemv(
                    self.embed.weight,
                    env["hidden"],
                    mod.enorm.weight,
                    mod.hnorm.weight,
                    eps,
                    mod.eh_proj.weight,
                    index1=env["tokens"],
                )
            else:
                x = mod.fuse_input(self.embed(env["tokens"]), env["hidden"])  # [b, t, H]
            env["x"], env["q"] = mod.pre(x, None, cache, env["attn"], fused)

        def attend(env):
            env["mask"] = None if self.attention_kernel else env["attn"].mask(env["kv_len"])
            env["o"] = mod.self_attn.attend(env["q"], cache, env["mask"], env["attn"])

        def pick(env, x):
            """x [b, t, ...] -> the rows the logits mode asks for: [b, 1 or t, ...]."""
            if logits == "last":
                return x[:, -1:]
            if logits == "index":
                return x[torch.arange(x.shape[0], device=x.device), env["logits_index"]][:, None]
            return x

        def post(env):
            h, delta = mod.post(env["x"], env["o"], fused)
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

        meta = self.graph_meta()
        return [
            Step(f"mtp{i}_pre", start, meta=meta),
            Step(f"mtp{i}_attn", attend, is_break=True, meta=meta),
            Step(f"mtp{i}_post", post, meta=meta),
        ]

    def card_summary(self, f: dict) -> str:
        return (
            f"A multi-layer EAGLE (MTP-style) draft of {self.num_modules} modules (`{self.architecture}`: per module "
            "`enorm`, `hnorm`, `eh_proj`, one Llama decoder layer and `shared_head.norm`); module i reads module "
            "i-1's hidden state (module 0: the target's final hidden state) and proposes draft token i+1. The "
            "token embedding and lm_head are the target's and are not stored here."
        )

    def card_objective(self, f: dict) -> str:
        return f"Teacher-forced multi-token prediction, one module per draft position ({self.num_modules} modules)"


def multi_layer_config(target: ModelArgs, num_modules: int, intermediate_size: Optional[int] = None) -> dict:
    """config.json of `num_modules` modules of the target's width (random init, training);
    intermediate_size: the modules' MLP width (None: the target's)."""
    return {
        **eagle_config(target),
        "intermediate_size": intermediate_size or target.intermediate_size,
        "architectures": [ARCHITECTURE],
        "num_nextn_predict_layers": num_modules,
        "tie_word_embeddings": True,
    }


class MultiLayerDraft(DeviceDraft):
    """The draft loop of `MultiLayerEagleHead` (see the module docstring for the cache discipline).

    State buffers: d_pool [b, k, H] (module i's output at its last committed position), d_next [b] (d_1).
    Round env keys: m{i}.* (module i's program in the proposal), c{i}.* (in the commit), c.win [b, i, H]
    (the proposal's last window outputs), c.pool{i} [b, H] (this commit's new pool entries).
    """

    features = FeatureKind.final

    def __init__(self, head: MultiLayerEagleHead, k: int, batch_size: int):
        if k > head.num_modules:
            raise ValueError(f"k={k} drafts need {k} modules; the head has {head.num_modules}")
        super().__init__(head, batch_size, k)

    @property
    def caches(self) -> StepCaches:  # one KV pool per module
        return self.cache

    @caches.setter
    def caches(self, value: StepCaches) -> None:
        self.cache = value

    @property
    def pool(self) -> Tensor:
        """[k, b, H]: module i's output at its last committed position (a view of d_pool)."""
        return self.buf["d_pool"].transpose(0, 1)

    @property
    def next(self) -> Tensor:
        return self.buf["d_next"]

    def state_specs(self, k: int) -> dict[str, InputSpec]:
        dtype = next(self.head.parameters()).dtype
        return {
            "d_pool": InputSpec((k, self.head.args.hidden_size), dtype, None, per_row=True, state=True),
            "d_next": InputSpec((), torch.long, None, per_row=True, state=True),
        }

    def _module(self, i: int, prefix: str, caches: StepCaches, logits: str, kv_offset: int) -> list[Step]:
        return scoped(prefix, merge_runs(self.head.module_program(i, caches, logits)), kv_offset)

    # -- the Draft interface ------------------------------------------------------------------------
    def begin(self, state, feats, prompt_tokens, valid, input_embeds, first, rows=None) -> None:
        n, t = prompt_tokens.shape
        dev = prompt_tokens.device
        lens = valid.sum(1)  # [n] L
        r = torch.arange(n, device=dev)
        seq = torch.cat([prompt_tokens, prompt_tokens.new_zeros(n, self.k)], 1)  # [n, t + k]: x_0..x_L, filler
        seq[r, lens] = first
        positions = torch.arange(t, device=dev).expand(n, t)
        caches = self.cache.rows(rows if rows is not None else n)
        hidden, pool = feats, []
        for i in range(self.k):
            last = (lens - 1 - i).clamp(min=0)
            env = {
                "tokens": seq[:, i + 1 : i + 1 + t],
                "hidden": hidden,
                "positions": positions,
                "kv_len": t,
                "valid": positions <= (lens - 1 - i)[:, None],
                "logits_index": last,
            }  # x_{p+i+1}
            run_steps(self.head.module_program(i, caches, "index" if i == 0 else "none"), env)
            hidden = env["out_hidden"]  # [n, t, H]
            pool.append(hidden[r, last])
            if i == 0:
                write_rows(self.buf["d_next"], env["ids"][:, 0], rows)
        write_rows(self.buf["d_pool"], torch.stack(pool, 1), rows)

    def propose_steps(self, caches: StepCaches, k: int) -> list[Step]:
        """Module i = 1..k-1 over the window L-i..L-1 on d_1..d_i -> d_{i+1} at its last position."""

        def first(env):
            env["draft"][:, 0].copy_(env["d_next"])

        def bind(i):
            def fn(env):
                lengths, pool = env["lengths"], env["d_pool"]  # [b], [b, k, H]
                positions = (lengths - i)[:, None] + torch.arange(i, device=lengths.device)  # [b, i]
                head = pool[:, i - 1 : i]  # [b, 1, H] module i-1 at L-i
                hidden = head if i == 1 else torch.cat([head, env["c.win"]], 1)  # [b, i, H]
                env.update(
                    {
                        f"m{i}.tokens": env["draft"][:, :i],
                        f"m{i}.hidden": hidden,
                        f"m{i}.positions": positions.clamp(min=0),
                        f"m{i}.valid": (positions >= 0) & env["live"][:, None],
                    }
                )

            return fn

        def pick(i):
            def fn(env):
                env["draft"][:, i].copy_(env[f"m{i}.ids"][:, -1])
                env["c.win"] = env[f"m{i}.out_hidden"]  # [b, i, H]

            return fn

        steps = [Step("mtp_first", first)]
        for i in range(1, k):
            steps += [
                Step(f"mtp_bind{i}", bind(i)),
                *self._module(i, f"m{i}.", caches, "last", 0),
                Step(f"mtp_pick{i}", pick(i)),
            ]
        return steps

    def commit_steps(self, caches: StepCaches, k: int) -> list[Step]:
        """Module i re-runs positions L-i..L-i+k on the emitted tokens, rows valid up to index a."""

        def bind(i):
            def fn(env):
                emitted, accepted, lengths = env["emitted"], env["accepted"], env["lengths"]
                steps = torch.arange(k + 1, device=emitted.device)
                positions = (lengths - i)[:, None] + steps  # [b, k+1]: L-i..L-i+k
                if i == 0:
                    hidden = env["t.hidden"]  # the target's final hidden states at L..L+k
                else:  # module i-1 at L-i (before this commit), then its commit outputs at L-i+1..
                    hidden = torch.cat([env["d_pool"][:, i - 1 : i], env[f"c{i - 1}.out_hidden"][:, :k]], 1)
                valid = (steps[None] <= accepted[:, None]) & env["live"][:, None] & (positions >= 0)
                env.update(
                    {
                        f"c{i}.tokens": emitted,
                        f"c{i}.hidden": hidden,
                        f"c{i}.positions": positions.clamp(min=0),
                        f"c{i}.valid": valid,
                        f"c{i}.logits_index": accepted,
                    }
                )

            return fn

        def take(env):
            idx = env["accepted"]
            r = torch.arange(idx.shape[0], device=idx.device)
            env["d_pool"][:, :k].copy_(torch.stack([env[f"c{i}.out_hidden"][r, idx] for i in range(k)], 1))
            env["d_next"].copy_(env["c0.ids"][:, 0])

        steps: list[Step] = []
        for i in range(k):
            steps += [
                Step(f"mtp_commit_in{i}", bind(i)),
                *self._module(i, f"c{i}.", caches, "index" if i == 0 else "none", k + 1),
            ]
        return steps + [Step("mtp_take", take)]


def make_multi_layer(plan, head, ctx) -> MultiLayerDraft:
    return MultiLayerDraft(head, ctx.k, ctx.batch_size)
