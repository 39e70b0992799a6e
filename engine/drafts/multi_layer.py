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

from engine.drafts.base import Draft, FeatureKind, Proposal, SpecState, cache_and_runners, put_rows
from engine.drafts.heads import _Head, eagle_config
from engine.graphs.graph_set import DraftPhase, InputSpec
from engine.graphs.runner import CaptureHiddenMode as M
from engine.model import AttnInputs, DecoderLayer, ModelArgs, RMSNorm, StaticKVCache, Step, run_steps
from engine.sampling import SamplingParams, draft_draw

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

    def new_cache(self, batch_size: int) -> StepCaches:
        return StepCaches([super(MultiLayerEagleHead, self).new_cache(batch_size) for _ in self.layers])

    def module_program(self, i: int, caches: StepCaches, logits: str) -> list[Step]:
        """Module i's forward as steps over its own pool `caches[i]`.

        env in:  tokens [b, t], hidden [b, t, H], positions [b, t], valid [b, t], kv_len,
                 logits_index [b] (logits="index")
        env out: out_hidden [b, t, H]; logits [b, 1, vocab] at the last position ("last") or at
                 logits_index ("index"), [b, t, vocab] ("all"), absent ("none")
        """
        mod, cache = self.layers[i], caches[i]

        def start(env):
            e = self.embed(env["tokens"])  # [b, t, H]
            env["attn"] = AttnInputs.build(env["positions"], env["valid"], self.rope_cos, self.rope_sin,
                                           cache.dummy_slot, e.dtype)
            env["x"], env["q"] = mod.pre(mod.fuse_input(e, env["hidden"]), None, cache, env["attn"], False)

        def attend(env):
            env["mask"] = None if self.attention_kernel else env["attn"].mask(env["kv_len"])
            env["o"] = mod.self_attn.attend(env["q"], cache, env["mask"], env["attn"])

        def post(env):
            h, delta = mod.post(env["x"], env["o"], False)
            h = h + delta  # [b, t, H]
            env["out_hidden"] = h
            if logits == "last":
                h = h[:, -1:]
            elif logits == "index":
                h = h[torch.arange(h.shape[0], device=h.device), env["logits_index"]][:, None]
            if logits != "none":
                env["logits"] = self.lm_head(mod.shared_head.norm(h))

        meta = self.graph_meta()
        return [Step(f"mtp{i}_pre", start, meta=meta), Step(f"mtp{i}_attn", attend, is_break=True, meta=meta),
                Step(f"mtp{i}_post", post, meta=meta)]

    def graph_phases(self, k: int) -> list[DraftPhase]:
        """mtp_extend{i} [B, k+1] for every module (the commit; module 0 also gives the next d_1) and
        mtp_step{i} [B, i] for modules 1..k-1 (the proposal windows), all over one buffer set."""
        dtype = next(self.parameters()).dtype
        hidden = {"hidden": InputSpec((self.args.hidden_size,), dtype)}
        both = {M.NULL: ("logits",), M.LAST: ("logits", "out_hidden"), M.FULL: ("logits", "out_hidden")}
        only_h = {m: ("out_hidden",) for m in M}
        phases = [DraftPhase("mtp_extend0", k + 1, M.FULL, {**hidden, "logits_index": InputSpec((), torch.long,
                                                                                                 per_row=True)},
                             both, lambda c: self.module_program(0, c, "index"))]
        phases += [DraftPhase(f"mtp_extend{i}", k + 1, M.FULL, hidden, only_h,
                              lambda c, i=i: self.module_program(i, c, "none"), shares="mtp_extend0")
                   for i in range(1, k)]
        phases += [DraftPhase(f"mtp_step{i}", i, M.FULL, hidden, both,
                              lambda c, i=i: self.module_program(i, c, "last"), shares="mtp_extend0")
                   for i in range(1, k)]
        return phases

    def card_summary(self, f: dict) -> str:
        return (f"A multi-layer EAGLE (MTP-style) draft of {self.num_modules} modules (`{self.architecture}`: per module "
                "`enorm`, `hnorm`, `eh_proj`, one Llama decoder layer and `shared_head.norm`); module i reads module "
                "i-1's hidden state (module 0: the target's final hidden state) and proposes draft token i+1. The "
                "token embedding and lm_head are the target's and are not stored here.")

    def card_objective(self, f: dict) -> str:
        return f"Teacher-forced multi-token prediction, one module per draft position ({self.num_modules} modules)"


def multi_layer_config(target: ModelArgs, num_modules: int) -> dict:
    return {**eagle_config(target), "architectures": [ARCHITECTURE], "num_nextn_predict_layers": num_modules,
            "tie_word_embeddings": True}


class MultiLayerDraft(Draft):
    """The draft loop of `MultiLayerEagleHead` (see the module docstring for the cache discipline)."""

    features = FeatureKind.final

    def __init__(self, head: MultiLayerEagleHead, k: int, batch_size: int, params: SamplingParams,
                 generator: Optional[torch.Generator], graphs=None):
        if k > head.num_modules:
            raise ValueError(f"k={k} drafts need {k} modules; the head has {head.num_modules}")
        self.head, self.k, self.batch_size, self.params, self.generator = head, k, batch_size, params, generator
        names = [f"mtp_extend{i}" for i in range(k)] + [f"mtp_step{i}" for i in range(1, k)]
        self.caches, runners = cache_and_runners(head, batch_size, graphs, names)  # one KV pool per module
        self.extends: dict[int, Any] = dict(enumerate(runners[:k]))
        self.steps: dict[int, Any] = dict(enumerate(runners[k:], start=1))
        self.pool: Optional[Tensor] = None  # [k, b, H]: module i's output at its last committed position
        self.next: Optional[Tensor] = None  # [b] d_1 (target ids)
        self.next_probs: Optional[Tensor] = None  # [b, vocab] (sampling)

    # -- one module forward ---------------------------------------------------------------------
    def _run(self, i: int, tokens: Tensor, hidden: Tensor, positions: Tensor, valid: Tensor, kv_len: int,
             logits: str, runner=None, rows: Optional[slice] = None, logits_index: Optional[Tensor] = None) -> dict:
        """Module i over [b, t] tokens -> {"out_hidden": [b, t, H], "logits": ...}. Through `runner`
        when given (it falls back to eager by itself and returns the eager outputs then: no consumer
        reads a graph's buffers); else eagerly over the pools' rows `rows` (default: the first b)."""
        env = {"tokens": tokens, "hidden": hidden, "positions": positions.clamp(min=0), "valid": valid,
               "kv_len": kv_len, "logits_index": logits_index}
        if runner is not None:
            out, _ = runner(env, kv_len, M.FULL)
            return out
        caches = self.caches.rows(rows if rows is not None else tokens.shape[0])
        return run_steps(self.head.module_program(i, caches, logits), env)

    def _store(self, pool: Tensor, nxt: Tensor, probs: Optional[Tensor], rows: Optional[slice]) -> None:
        """pool [k, n, H], next [n] for the whole batch (rows=None) or into rows of it."""
        n = self.batch_size
        self.pool = put_rows(self.pool, pool, rows, n, dim=1)
        self.next, self.next_probs = put_rows(self.next, nxt, rows, n), put_rows(self.next_probs, probs, rows, n)

    # -- the Draft interface ------------------------------------------------------------------------
    def begin(self, state, feats, prompt_tokens, valid, input_embeds, first, rows=None) -> None:
        n, t = prompt_tokens.shape
        dev = prompt_tokens.device
        lens = valid.sum(1)  # [n] L
        r = torch.arange(n, device=dev)
        seq = torch.cat([prompt_tokens, prompt_tokens.new_zeros(n, self.k)], 1)  # [n, t + k]: x_0..x_L, filler
        seq[r, lens] = first
        positions = torch.arange(t, device=dev).expand(n, t)
        hidden, pool, nxt, probs = feats, [], None, None
        for i in range(self.k):
            tokens = seq[:, i + 1: i + 1 + t]  # x_{p+i+1}
            ok = positions <= (lens - 1 - i)[:, None]  # [n, t] module i's committed positions
            last = (lens - 1 - i).clamp(min=0)
            out = self._run(i, tokens, hidden, positions, ok, t, "index" if i == 0 else "none", rows=rows,
                            logits_index=last)
            hidden = out["out_hidden"]  # [n, t, H]
            pool.append(hidden[r, last])
            if i == 0:
                nxt, probs = draft_draw(out["logits"][:, 0], self.params, self.generator)
        self._store(torch.stack(pool), nxt, probs, rows)

    def propose(self, state: SpecState, k: int) -> Proposal:
        lengths, live = state.on_device()  # [b], [b]
        tokens, probs = [self.next], [self.next_probs]
        window: Optional[Tensor] = None  # [b, i-1, H] module i-1's window outputs
        for i in range(1, k):
            steps = torch.arange(i, device=lengths.device)
            positions = (lengths - i)[:, None] + steps  # [b, i]: L-i..L-1
            hidden = self.pool[i - 1][:, None] if window is None else torch.cat([self.pool[i - 1][:, None], window], 1)
            valid = (positions >= 0) & live[:, None]
            out = self._run(i, torch.stack(tokens, 1), hidden, positions, valid, max(state.lengths),
                            "last", runner=self.steps.get(i))
            window = out["out_hidden"]  # [b, i, H]
            tok, p = draft_draw(out["logits"][:, -1], self.params, self.generator)
            tokens.append(tok)
            probs.append(p)
        return Proposal(torch.stack(tokens, 1), None if self.params.greedy else torch.stack(probs, 1))

    def commit(self, state, feats, emitted, accepted) -> None:
        b, width = emitted.shape  # width = k + 1
        dev = emitted.device
        steps = torch.arange(width, device=dev)
        lengths, live = state.on_device()
        r = torch.arange(b, device=dev)
        kv_len = max(state.lengths) + width
        hidden, pool, prev = feats, [], None
        for i in range(self.k):
            positions = (lengths - i)[:, None] + steps  # [b, k+1]: L-i..L-i+k
            valid = (steps[None] <= accepted[:, None]) & live[:, None] & (positions >= 0)
            if i > 0:  # module i-1 at L-i (before this commit), then its commit outputs at L-i+1..
                hidden = torch.cat([self.pool[i - 1][:, None], prev[:, : width - 1]], 1)
            out = self._run(i, emitted, hidden, positions, valid, kv_len, "index" if i == 0 else "none",
                            runner=self.extends.get(i), logits_index=accepted)
            prev = out["out_hidden"]  # [b, k+1, H]
            pool.append(prev[r, accepted])
            if i == 0:
                self.next, self.next_probs = draft_draw(out["logits"][:, 0], self.params, self.generator)
        self.pool = torch.stack(pool)


def make_multi_layer(plan, head, ctx) -> MultiLayerDraft:
    return MultiLayerDraft(head, ctx.cfg.num_steps if ctx.cfg is not None else head.num_modules, ctx.batch_size,
                           ctx.params, ctx.generator, ctx.graphs)
