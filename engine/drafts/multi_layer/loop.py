"""The multi-layer EAGLE draft loop over `MultiLayerEagleHead` (engine/drafts/multi_layer/head.py states the
cache discipline: each module its own KV pool, a window per proposal step, a re-run per commit)."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.drafts.base import DeviceDraft, FeatureKind, write_rows
from engine.drafts.multi_layer.head import MultiLayerEagleHead, StepCaches
from engine.graphs.runner import InputSpec
from engine.program import Step, merge_runs, run_steps, scoped
from engine.sampling import DRAFT, Draws, draw


class MultiLayerDraft(DeviceDraft):
    """The draft loop of `MultiLayerEagleHead` (see the module docstring for the cache discipline).

    State buffers: d_pool [b, k, H] (module i's output at its last committed position), d_next [b] (d_1),
    d_q [b, k, vocab] (a sampled round's proposal distributions: module i's draw of d_{i+1} at position
    L+i+1, the commit's (and begin's) d_1 at L'+1).
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

    def own_specs(self, k: int) -> dict[str, InputSpec]:
        dtype = next(self.head.parameters()).dtype
        return {
            "d_pool": InputSpec((k, self.head.args.hidden_size), dtype, None, per_row=True, state=True),
            "d_next": InputSpec((), torch.long, None, per_row=True, state=True),
        }

    def _module(
        self, i: int, prefix: str, caches: StepCaches, logits: str, kv_offset: int, sampled: bool = False
    ) -> list[Step]:
        return scoped(prefix, merge_runs(self.head.module_program(i, caches, logits, sampled)), kv_offset)

    def _draw(self, logits: Tensor, draws: Draws, pos: Tensor, offset: int, q: Tensor) -> Tensor:
        """[b] ids drawn from logits [b, 1, vocab] at positions pos + offset, their q written into q [b, 1, vocab]."""
        return draw(logits, draws, pos, DRAFT, kernels=self.head.fused, offset=offset, q_out=q)[:, 0]

    # -- the Draft interface ------------------------------------------------------------------------
    def begin(self, state, feats, prompt_tokens, valid, input_embeds, first, rows=None, draws=None) -> None:
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
            sampled = draws is not None and i == 0  # sampled rows draw d_1 (at position L + 1)
            run_steps(self.head.module_program(i, caches, "index" if i == 0 else "none", sampled), env)
            hidden = env["out_hidden"]  # [n, t, H]
            pool.append(hidden[r, last])
            if i == 0:
                q = self.buf["d_q"][rows if rows is not None else slice(0, n), :1]
                nxt = self._draw(env["logits"], draws, lens, 1, q) if sampled else env["ids"][:, 0]
                write_rows(self.buf["d_next"], nxt, rows)
        write_rows(self.buf["d_pool"], torch.stack(pool, 1), rows)

    def propose_steps(self, caches: StepCaches, k: int, sampled: bool = False) -> list[Step]:
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
                if sampled:  # d_{i+1} at position L+i+1
                    q = env["d_q"][:, i : i + 1]
                    tok = self._draw(env[f"m{i}.logits"], Draws.of(env), env["lengths"], i + 1, q)
                else:
                    tok = env[f"m{i}.ids"][:, -1]
                env["draft"][:, i].copy_(tok)
                env["c.win"] = env[f"m{i}.out_hidden"]  # [b, i, H]

            return fn

        steps = [Step("mtp_first", first)]
        for i in range(1, k):
            steps += [
                Step(f"mtp_bind{i}", bind(i)),
                *self._module(i, f"m{i}.", caches, "last", 0, sampled),
                Step(f"mtp_pick{i}", pick(i)),
            ]
        return steps

    def commit_steps(self, caches: StepCaches, k: int, sampled: bool = False) -> list[Step]:
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
            if sampled:  # the next round's d_1, at position L + a + 2
                nxt = self._draw(env["c0.logits"], Draws.of(env), env["lengths"] + idx, 2, env["d_q"][:, :1])
            else:
                nxt = env["c0.ids"][:, 0]
            env["d_next"].copy_(nxt)

        steps: list[Step] = []
        for i in range(k):
            steps += [
                Step(f"mtp_commit_in{i}", bind(i)),
                *self._module(i, f"c{i}.", caches, "index" if i == 0 else "none", k + 1, sampled and i == 0),
            ]
        return steps + [Step("mtp_take", take)]


def make_multi_layer(plan, head, ctx) -> MultiLayerDraft:
    return MultiLayerDraft(head, ctx.k, ctx.batch_size)
