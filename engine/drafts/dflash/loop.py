"""The DFlash draft loop over `DFlashHead` (engine/drafts/dflash/head.py states the model and the cache
discipline): the prefill and each extend write context k/v, each proposal is one block forward."""

from __future__ import annotations

import torch

from engine.drafts.base import DeviceDraft, FeatureKind
from engine.drafts.dflash.head import DFlashHead
from engine.program import Step, merge_runs, run_steps, scoped
from engine.sampling import DRAFT, Draws, draw


class DFlashDraft(DeviceDraft):
    """The draft loop: `begin` and the extend write context k/v, the proposal runs one block forward.

    State per row: the context cache holds positions 0..L-1; the next block starts with x_L, the round's
    `last` (the bonus token): the draft keeps no buffers of its own but d_q [b, k, vocab] (a sampled
    round draws every block position i from the one forward's q_i, at position L+i, and keeps q_i).
    Round env keys: b.* (the block program), x.* (the context write).
    """

    features = FeatureKind.aux

    def __init__(self, head: DFlashHead, batch_size: int, k: int):
        if not 1 <= k < head.block_size:
            raise ValueError(
                f"draft.num_steps={k}: a DFlash block of {head.block_size} tokens proposes 1..{head.block_size - 1}"
            )
        super().__init__(head, batch_size, k)
        device = head.fc.weight.device
        self.offsets = torch.arange(head.block_size, device=device)  # [B] block index: constant, read by graphs
        self.is_bonus = self.offsets == 0  # [B] the block's first slot holds the bonus token, the rest masks

    # -- the Draft interface ------------------------------------------------------------------------
    def begin(self, state, feats, prompt_tokens, valid, input_embeds, first, rows=None, draws=None) -> None:
        """Context k/v of the prompt positions 0..T-1 (the draft reads no prompt token: only features)."""
        b, t = prompt_tokens.shape
        positions = torch.arange(t, device=first.device).expand(b, t)
        cache = self.cache.rows(rows if rows is not None else b)
        run_steps(self.head.context_program(cache), {"feats": feats, "positions": positions, "valid": valid})

    def propose_steps(self, cache, k: int, sampled: bool = False) -> list[Step]:
        B = self.head.block_size

        def bind(env):  # two kernels: the block's tokens and positions
            last, lengths = env["last"], env["lengths"]  # [b], [b]
            env.update(
                {
                    "b.tokens": torch.where(self.is_bonus, last[:, None], self.head.mask_token_id),  # [b, B]
                    "b.positions": lengths[:, None] + self.offsets,  # [b, B]
                    "b.valid": env["live"][:, None].expand(last.shape[0], B),
                }
            )

        def pick(env):
            if sampled:  # d_1..d_k at positions L+1..L+k, each from its own q
                q = env["d_q"][:, :k]
                ids = draw(
                    env["b.logits"], Draws.of(env), env["lengths"], DRAFT, kernels=self.head.fused, offset=1, q_out=q
                )
            else:
                ids = env["b.ids"]
            env["draft"][:, :k].copy_(ids)  # [b, k]

        return [
            Step("block_in", bind),
            *scoped("b.", merge_runs(self.head.block_program(cache, k, sampled)), B),
            Step("block_pick", pick),
        ]

    def commit_steps(self, cache, k: int, sampled: bool = False) -> list[Step]:
        """Context k/v of the verified positions L..L+a (a = accepted; the rest to the dummy slot)."""

        def bind(env):
            accepted, lengths = env["accepted"], env["lengths"]
            steps = torch.arange(k + 1, device=accepted.device)
            env.update(
                {
                    "x.feats": env["t.aux"],
                    "x.positions": lengths[:, None] + steps,
                    "x.valid": (steps[None] <= accepted[:, None]) & env["live"][:, None],
                }
            )

        return [Step("context_in", bind), *scoped("x.", self.head.context_program(cache))]


def make_dflash(plan, head, ctx) -> DFlashDraft:
    return DFlashDraft(head, ctx.batch_size, ctx.k)
