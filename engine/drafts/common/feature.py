"""`FeatureDraft`: the draft loop shared by the EAGLE-family heads (EAGLE3, EAGLE).

State per row, after `begin` or a round's extend: the draft has processed positions 0..L-1 (L =
tokens in the target cache), and holds `d_hidden` (its output at L-1) and `d_next` (its first
proposal, d_1, a target id).

    begin    pairs (f_j, x_{j+1}) for prompt positions j = 0..L-1 (x_L: the target's first token);
             reuses the target's input embeddings for prompt positions when the prompt came as embeds
    propose  d_1 = d_next; step i = 1..k-1 at position L+i-1 on (h, d_i) -> d_{i+1}   (phase draft)
    commit   pairs (f_j, x_{j+1}) for the verified positions j = L..L+a (x: accepted tokens, then
             the bonus); overwrites the draft cache where the proposal steps wrote      (phase extend)

Each proposal is the argmax of the head's logits, or in a sampled round (sampled rows) a draw from its
q at the proposal's position (d_{i+1}: L+i+1; the extend's d_next: L+a+2; begin's: the prompt's length
+ 1), q kept in d_q[:, i] (d_next's in d_q[:, 0]).

Tensors in the round's env (engine/round.py), b rows:
    d_hidden [b, hidden]   d_next [b]   d_q [b, K, Vd]   the draft's state buffers
    c.tok [b], c.h [b, hidden]               the chain's running token and hidden state
    s{i}.*, e.*                              step i's and the extend's head program (scoped keys)
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.drafts.base import FEATURE_KEYS, DeviceDraft, FeatureKind, write_rows
from engine.graphs.runner import InputSpec
from engine.program import Step, merge_runs, run_steps, scoped
from engine.sampling import DRAFT, Draws, draw


class FeatureDraft(DeviceDraft):
    def __init__(self, head, batch_size: int, k: int, features: FeatureKind):
        self.features = features
        super().__init__(head, batch_size, k)

    def own_specs(self, k: int) -> dict[str, InputSpec]:
        dtype = next(self.head.parameters()).dtype
        return {
            "d_hidden": InputSpec((self.head.args.hidden_size,), dtype, None, per_row=True, state=True),
            "d_next": InputSpec((), torch.long, None, per_row=True, state=True),
        }

    def begin(self, state, feats, prompt_tokens, valid, input_embeds, first, rows=None, draws=None) -> None:
        b, t = prompt_tokens.shape
        last = valid.sum(1) - 1  # [b] index of each prompt's last token
        r = torch.arange(b, device=first.device)
        shifted = torch.cat([prompt_tokens[:, 1:], prompt_tokens[:, :1]], 1)  # x_{j+1}; last column is filler
        shifted[r, last] = first
        embeds = None
        if input_embeds is not None:  # the multimodal path: reuse the target's embeddings
            embeds = torch.cat([input_embeds[:, 1:], input_embeds[:, :1]], 1).clone()
            embeds[r, last] = self.head.embed(first)
        positions = torch.arange(t, device=first.device).expand(b, t)
        env = {
            "tokens": shifted,
            "hidden": feats,
            "positions": positions,
            "valid": valid,
            "kv_len": t,
            "input_embeds": embeds,
        }
        cache = self.cache.rows(rows if rows is not None else b)
        run_steps(self.head.program(cache, embeds_input=embeds is not None), env)
        h, nxt = env["out_hidden"][r, last], env["ids"][r, last]  # [b, hidden], [b]
        if draws is not None:  # sampled rows draw d_1 (at position L + 1) from the head's q
            q = self.buf["d_q"][rows if rows is not None else slice(0, b), :1]
            drawn = self._draw(self.head.logits(h[:, None]), draws, last, 2, q)[:, 0]
            nxt = torch.where(draws.temperature > 0, drawn, nxt)
        write_rows(self.buf["d_hidden"], h, rows)
        write_rows(self.buf["d_next"], nxt, rows)

    def _draw(self, logits: Tensor, draws: Draws, pos0: Tensor, offset: int, q: Tensor, index=None) -> Tensor:
        """Target ids [b, 1 or t] drawn from the head's logits [b, t, Vd] at pos0 + offset (+ index), their q
        written into q."""
        return draw(
            logits,
            draws,
            pos0,
            DRAFT,
            kernels=self.head.fused,
            offset=offset,
            index=index,
            q_out=q,
            offsets=self.offsets,
        )

    def propose_steps(self, cache, k: int, sampled: bool = False) -> list[Step]:
        def first(env):
            env["draft"][:, 0].copy_(env["d_next"])
            env["c.tok"], env["c.h"] = env["d_next"], env["d_hidden"]

        def bind(i):
            def fn(env):
                live = env["live"][:, None]  # [b, 1]
                env.update(
                    {
                        f"s{i}.tokens": env["c.tok"][:, None],
                        f"s{i}.hidden": env["c.h"][:, None],
                        f"s{i}.positions": (env["lengths"] + i - 1)[:, None],
                        f"s{i}.valid": live,
                    }
                )

            return fn

        def pick(i):
            def fn(env):
                if sampled:  # d_{i+1} at position L+i+1
                    q = env["d_q"][:, i : i + 1]
                    tok = self._draw(env[f"s{i}.logits"], Draws.of(env), env["lengths"], i + 1, q)[:, 0]
                else:
                    tok = env[f"s{i}.ids"][:, 0]  # [b] target ids
                env["draft"][:, i].copy_(tok)
                env["c.tok"], env["c.h"] = tok, env[f"s{i}.out_hidden"][:, 0]

            return fn

        steps = [Step("chain0", first)]
        for i in range(1, k):  # step i at position L+i-1: kv_len covers it
            steps += [
                Step(f"bind{i}", bind(i)),
                *scoped(f"s{i}.", merge_runs(self.head.program(cache, sampled=sampled)), i),
                Step(f"pick{i}", pick(i)),
            ]
        return steps

    def commit_steps(self, cache, k: int, sampled: bool = False) -> list[Step]:
        kind = self.features

        def bind(env):
            emitted, accepted, live = env["emitted"], env["accepted"], env["live"]  # [b, k+1], [b], [b]
            steps = torch.arange(k + 1, device=emitted.device)
            feats = env[FEATURE_KEYS[kind]]
            env.update(
                {
                    "e.tokens": emitted,
                    "e.hidden": feats,
                    "e.positions": env["lengths"][:, None] + steps,
                    "e.valid": (steps[None] <= accepted[:, None]) & live[:, None],
                }
            )

        def take(env):
            idx = env["accepted"]
            r = torch.arange(idx.shape[0], device=idx.device)
            env["d_hidden"].copy_(env["e.out_hidden"][r, idx])
            if sampled:  # the next round's d_1, at position L + a + 2
                nxt = self._draw(env["e.logits"], Draws.of(env), env["lengths"], 2, env["d_q"][:, :1], idx)[:, 0]
            else:
                nxt = env["e.ids"][r, idx]
            env["d_next"].copy_(nxt)

        return [
            Step("extend_in", bind),
            *scoped("e.", merge_runs(self.head.program(cache, sampled=sampled)), k + 1),
            Step("extend_take", take),
        ]

    @property
    def embed(self) -> torch.nn.Embedding:
        return self.head.embed

    # -- the state, as views -------------------------------------------------------------------------
    @property
    def hidden(self) -> Tensor:
        return self.buf["d_hidden"]

    @property
    def next(self) -> Tensor:
        return self.buf["d_next"]


def make_feature(plan, head, ctx) -> FeatureDraft:
    """`Algorithm.make` of the EAGLE-family heads: the loop reads the plan's feature kind."""
    return FeatureDraft(head, ctx.batch_size, ctx.k, plan.features)
