"""Could an EAGLE3 head draft the context's out-of-vocabulary tokens through the target's embedding rows?
`python benchmarks/copy_probe.py HEAD_DIR [--train 256] [--limit 40] [--tokens 256] [overrides...]`.

Most answer tokens outside a head's draft vocabulary are already in the context (`accept_shift.py`:
70% on MT-bench). A copy path would give the first draft extra candidates: every out-of-vocabulary
token of the context so far (the prompt and the answer up to the position), scored through the target's
tied embedding rows, `a * (x . E[tok]) + b`, where x [H] is the input of the head's lm_head (its normed
hidden state) and a, b two scalars, fitted here by cross-entropy on `--train` self-distilled samples
(never on the eval set) with the head frozen. The draft then takes the argmax over its own logits [Vd]
and the extras. On the eval set's answers (greedy, up to `--tokens`), teacher-forced step 0 as in
`Trainer.evaluate`, the script reports how often the first draft is right with and without the extras,
how many out-of-vocabulary context tokens the extras get right, and how many in-vocabulary positions they
take wrongly. A measurement of the idea's step 0, without training the head for it: not a drafting mode.

Layouts, one row per answer position p (where the target's greedy token at p + 2 is the label):
    own_lse, own_max  [N]         logsumexp and max of the head's own logits
    own_hit           [N]         the head's own argmax is the greedy token (in-vocabulary labels only)
    own_label         [N]         the head's logit of the greedy token (-inf when outside the draft vocab)
    extra             [N, C]      x . E[tok] for the context's out-of-vocabulary tokens (-inf: padding, or
                                  not yet in the context at p)
    extra_label       [N]         the index into `extra` of the greedy token, -1 when it is not among them
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from accept_shift import first_drafts, head_and_eval_answers, scoring_trainer  # benchmarks/, the script's dir
from engine.train.selfdistill import Sample
from engine.train.trainer import Trainer
from pipeline.config import compose_run_config
from stages.train_draft import synthesize_data


@torch.no_grad()
def positions(trainer: Trainer, samples: list[Sample], embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows of the module docstring for every answer position of `samples` (step 0, teacher-forced)."""
    s, head, to_draft = trainer.s, trainer.head, trainer.vocab.to_draft
    seen: list[torch.Tensor] = []
    hook = head.lm_head.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    rows = {k: [] for k in ("own_lse", "own_max", "own_hit", "own_label", "extra", "extra_label")}
    try:
        for group, batch, logits in first_drafts(trainer, samples):
            x = seen.pop().float()  # [B, T, H]: the lm_head input of this batch's forward
            for b, sample in enumerate(group):
                full = torch.tensor(sample.ids[: s.max_len], device=x.device)  # [L_b]
                ps = batch.mask[b].nonzero()[:, 0]  # answer positions with a label
                ps = ps[ps + 2 < len(full)]
                label = full[ps + 2]  # [n]: the greedy token each position predicts
                oov = (to_draft[full] < 0).nonzero()[:, 0]  # context positions holding an OOV token
                toks, first = [], []
                for q in oov.tolist():  # unique OOV tokens with their first position
                    if int(full[q]) not in toks:
                        toks.append(int(full[q]))
                        first.append(q)
                lg = logits[b, ps].float()  # [n, Vd]
                rows["own_lse"].append(lg.logsumexp(-1))
                rows["own_max"].append(lg.max(-1).values)
                d = to_draft[label]  # [n]
                rows["own_hit"].append((lg.argmax(-1) == d) & (d >= 0))
                rows["own_label"].append(torch.where(d >= 0, lg.gather(-1, d.clamp(min=0)[:, None])[:, 0],
                                                     torch.full_like(lg[:, 0], float("-inf"))))
                if toks:
                    t, f = torch.tensor(toks, device=x.device), torch.tensor(first, device=x.device)
                    e = x[b, ps] @ embed[t].float().T  # [n, C]
                    e = e.masked_fill(f[None, :] > ps[:, None] + 1, float("-inf"))  # not yet in the context
                    hit = (label[:, None] == t[None, :]) & (f[None, :] <= ps[:, None] + 1)  # [n, C]
                    idx = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(label, -1))
                else:
                    e, idx = x.new_full((len(ps), 0), float("-inf")), torch.full_like(label, -1)
                rows["extra"].append(e)
                rows["extra_label"].append(idx)
    finally:
        hook.remove()
    width = max(e.shape[1] for e in rows["extra"]) or 1
    rows["extra"] = [torch.nn.functional.pad(e, (0, width - e.shape[1]), value=float("-inf")) for e in rows["extra"]]
    return {k: torch.cat(v).cpu() for k, v in rows.items()}


def fit(r: dict[str, torch.Tensor], steps: int = 300) -> tuple[float, float]:
    """a, b of the extras' logits by cross-entropy over own + extra candidates (the head frozen)."""
    a, b = torch.ones((), requires_grad=True), torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([a, b], lr=0.05)
    keep = (r["own_label"] > float("-inf")) | (r["extra_label"] >= 0)  # positions whose label is a candidate
    own_lse, own_label, extra, extra_label = (r[k][keep] for k in ("own_lse", "own_label", "extra", "extra_label"))
    valid = extra > float("-inf")  # [N, C]: padding and not-yet-seen tokens are no candidates
    extra = extra.masked_fill(~valid, 0.0)
    for _ in range(steps):
        ex = (a * extra + b).masked_fill(~valid, -1e9)  # [N, C] (finite: no NaN gradients)
        z = torch.logaddexp(own_lse, ex.logsumexp(-1))  # [N]
        lab = torch.where(extra_label >= 0, ex.gather(-1, extra_label.clamp(min=0)[:, None])[:, 0], own_label)
        loss = (z - lab).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            a.clamp_(min=1e-3)
    return a.item(), b.item()


def report(name: str, r: dict[str, torch.Tensor], a: float, b: float) -> None:
    ex = (a * r["extra"] + b).max(-1)
    extra_wins = ex.values > r["own_max"]  # [N]: the draft takes an extra candidate
    extra_right = extra_wins & (ex.indices == r["extra_label"]) & (r["extra_label"] >= 0)
    with_extras = (r["own_hit"] & ~extra_wins) | extra_right
    copyable = r["extra_label"] >= 0
    n = len(r["own_hit"])
    print(f"{name:10} {n:>9} {r['own_hit'].float().mean():>9.3f} {with_extras.float().mean():>11.3f} "
          f"{copyable.float().mean():>9.3f} {extra_right.sum() / max(int(copyable.sum()), 1):>14.3f} "
          f"{(r['own_hit'] & extra_wins).float().mean():>13.4f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", help="an EAGLE3 head directory with its own draft vocabulary")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--limit", type=int, default=40, help="eval prompts (spread over the set)")
    ap.add_argument("--train", type=int, default=256, help="self-distilled samples a and b are fitted on")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per answer")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    plan, loaded, head, _, evalset = head_and_eval_answers(args)
    if head.shares_lm_head:
        raise SystemExit(f"{args.head}: the head drafts over the target's whole vocabulary; nothing is out of it")
    recipe = compose_run_config("+experiment=train_eagle3_smollm2")
    d = recipe.train.data
    train = synthesize_data(loaded, dataclasses.replace(
        d, num_samples=args.train, batch_size=min(args.train, 128), max_answer_tokens=args.tokens, seed=4242,
        sync_every=16))
    everything = evalset + train
    trainer = scoring_trainer(plan, loaded, head, everything, recipe, "copy_probe")
    embed = loaded.model.lm_head.weight  # [V, H]: tied to the embedding in SmolLM2
    fitted = positions(trainer, train, embed)
    a, b = fit(fitted)
    print(f"extras' logits: {a:.3f} * (x . E[tok]) + {b:.3f}, fitted on {len(train)} self-distilled samples")
    print(f"{'set':10} {'positions':>9} {'own acc':>9} {'with extras':>11} {'copyable':>9} "
          f"{'copies right':>14} {'own hits lost':>13}")
    report("magpie", fitted, a, b)
    report(args.dataset, positions(trainer, evalset, embed), a, b)


if __name__ == "__main__":
    main()
