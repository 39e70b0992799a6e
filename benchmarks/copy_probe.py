"""Could an EAGLE3 head draft the context's out-of-vocabulary tokens through the target's embedding rows?
`python benchmarks/copy_probe.py HEAD_DIR [--train 256] [--limit 40] [--tokens 256] [--rank R] [overrides...]`.

Most answer tokens outside a head's draft vocabulary are already in the context (`accept_shift.py`:
70% on MT-bench). A copy path would give the first draft extra candidates: every out-of-vocabulary
token of the context so far (the prompt and the answer up to the position), scored through the target's
tied embedding rows, `a * (x . E[tok]) + b`, where x [H] is the input of the head's lm_head (its normed
hidden state) and a, b two scalars, fitted here by cross-entropy on `--train` self-distilled samples
(never on the eval set) with the head frozen. The draft then takes the argmax over its own logits [Vd]
and the extras. On the eval set's answers (greedy, up to `--tokens`), teacher-forced step 0 as in
`Trainer.evaluate`, the script reports how often the first draft is right with and without the extras,
how many out-of-vocabulary context tokens the extras get right, and how many in-vocabulary positions they
take wrongly. With `--rank R` the score also goes through a fitted rank-R correction of x,
`(x + x U V^T) . E[tok]`, a small trained copy path on the frozen head (`fit_projection`). A measurement
of the idea's step 0, without training the head for it: not a drafting mode.

Layouts, one row per answer position p (where the target's greedy token at p + 2 is the label):
    own_lse, own_max  [N]         logsumexp and max of the head's own logits
    own_hit           [N]         the head's own argmax is the greedy token (in-vocabulary labels only)
    own_label         [N]         the head's logit of the greedy token (-inf when outside the draft vocab)
    extra             [N, C]      x . E[tok] for the context's out-of-vocabulary tokens (-inf: padding, or
                                  not yet in the context at p)
    extra_label       [N]         the index into `extra` of the greedy token, -1 when it is not among them
    x                 [N, H]      the lm_head input at p (fp32)
    groups            per sample: (candidate ids [C], their first positions [C], answer positions [n])
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from accept_shift import first_drafts, head_and_eval_answers, scoring_trainer  # benchmarks/, the script's dir
from tqdm import tqdm

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
    rows = {k: [] for k in ("own_lse", "own_max", "own_hit", "own_label", "extra", "extra_label", "x")}
    groups = []  # per sample: (candidate ids [C], first positions [C], answer positions [n]) for `extras`
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
                rows["own_label"].append(
                    torch.where(
                        d >= 0, lg.gather(-1, d.clamp(min=0)[:, None])[:, 0], torch.full_like(lg[:, 0], float("-inf"))
                    )
                )
                t = torch.tensor(toks, dtype=torch.long, device=x.device)  # [C]
                f = torch.tensor(first, dtype=torch.long, device=x.device)  # [C]
                hit = (label[:, None] == t[None, :]) & (f[None, :] <= ps[:, None] + 1)  # [n, C]
                idx = hit.float().argmax(-1) if toks else torch.zeros_like(label)
                rows["extra"].append(_scores(x[b, ps], embed[t].float(), f, ps))
                rows["extra_label"].append(torch.where(hit.any(-1), idx, torch.full_like(label, -1)))
                rows["x"].append(x[b, ps])
                groups.append((t.cpu(), f.cpu(), ps.cpu()))
    finally:
        hook.remove()
    rows["extra"] = [_padded(rows["extra"])]
    out = {k: torch.cat(v).cpu() for k, v in rows.items()}
    out["groups"] = groups
    return out


def _scores(x: torch.Tensor, rows: torch.Tensor, first: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """x [n, H] . rows [C, H] -> [n, C], -inf where the candidate is not yet in the context at p."""
    return (x @ rows.T).masked_fill(first[None, :] > ps[:, None] + 1, float("-inf"))


def _padded(parts: list[torch.Tensor]) -> torch.Tensor:
    width = max(e.shape[1] for e in parts) or 1
    return torch.cat([torch.nn.functional.pad(e, (0, width - e.shape[1]), value=float("-inf")) for e in parts])


def _union_nll(r: dict, keep: torch.Tensor, ex: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the greedy token over the head's own logits and the extras ex [N, C] (finite,
    -1e9 where no candidate), at the positions `keep` whose label is a candidate."""
    ex = ex[keep]
    z = torch.logaddexp(r["own_lse"][keep], ex.logsumexp(-1))  # [N]
    label = r["extra_label"][keep]
    lab = torch.where(label >= 0, ex.gather(-1, label.clamp(min=0)[:, None])[:, 0], r["own_label"][keep])
    return (z - lab).mean()


def _keep(r: dict) -> torch.Tensor:
    return (r["own_label"] > float("-inf")) | (r["extra_label"] >= 0)  # positions whose label is a candidate


def _fit(r: dict, scores, a: torch.Tensor, b: torch.Tensor, opt: torch.optim.Optimizer, steps: int) -> None:
    """Minimise `_union_nll` of the extras' logits a * scores() + b over `opt`'s parameters (a kept > 0)."""
    keep = _keep(r)
    for _ in tqdm(range(steps), desc="fit", unit="step", leave=False):
        e = scores()  # [N, C], -inf: padding and not-yet-seen tokens are no candidates
        valid = e > float("-inf")
        ex = (a * e.masked_fill(~valid, 0.0) + b).masked_fill(~valid, -1e9)  # finite: no NaN gradients
        loss = _union_nll(r, keep, ex)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            a.clamp_(min=1e-3)


def fit(r: dict[str, torch.Tensor], steps: int = 300) -> tuple[float, float]:
    """a, b of the extras' logits by cross-entropy over own + extra candidates (the head frozen)."""
    a, b = torch.ones((), requires_grad=True), torch.zeros((), requires_grad=True)
    _fit(r, lambda: r["extra"], a, b, torch.optim.Adam([a, b], lr=0.05), steps)
    return a.item(), b.item()


def project(r: dict, embed: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The extras' scores through the corrected input x + x U V^T: (x') . E[tok] -> [N, C] (-inf as in r)."""
    xp = r["x"] + (r["x"] @ u) @ v.T  # [N, H]
    embed = embed.detach()  # frozen: no gradient into the [V, H] table
    # one split (its backward is one cat), not a slice per sample (each slice's backward is a [N, H] zero tensor)
    parts = xp.split([len(ps) for _, _, ps in r["groups"]])
    return _padded([_scores(xs, embed[t].float(), f, ps) for xs, (t, f, ps) in zip(parts, r["groups"])])


def fit_projection(
    r: dict, embed: torch.Tensor, rank: int, steps: int = 200, weight_decay: float = 1e-2
) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """a, b and a rank-`rank` correction U V^T of the lm_head input (starting at the identity: V = 0),
    fitted together by the same cross-entropy as `fit` on every position (the head frozen). Every position
    trains it: a copyable one to pick its copy, an own-vocabulary one to keep the extras below."""
    h = r["x"].shape[1]
    u = (torch.randn(h, rank, generator=torch.Generator().manual_seed(0)) / h**0.5).requires_grad_()
    v = torch.zeros(h, rank, requires_grad=True)
    a, b = torch.ones((), requires_grad=True), torch.zeros((), requires_grad=True)
    opt = torch.optim.AdamW(
        [{"params": [u, v], "weight_decay": weight_decay}, {"params": [a, b], "weight_decay": 0.0}], lr=0.01
    )
    _fit(r, lambda: project(r, embed, u, v), a, b, opt, steps)
    return a.item(), b.item(), u.detach(), v.detach()


def report(name: str, r: dict[str, torch.Tensor], a: float, b: float, extra: torch.Tensor | None = None) -> None:
    """One row of the table; `extra`: scores in place of r["extra"] (e.g. `project`'s)."""
    ex = (a * (r["extra"] if extra is None else extra) + b).max(-1)
    extra_wins = ex.values > r["own_max"]  # [N]: the draft takes an extra candidate
    extra_right = extra_wins & (ex.indices == r["extra_label"]) & (r["extra_label"] >= 0)
    with_extras = (r["own_hit"] & ~extra_wins) | extra_right
    copyable = r["extra_label"] >= 0
    n = len(r["own_hit"])
    print(
        f"{name:12} {n:>9} {r['own_hit'].float().mean():>9.3f} {with_extras.float().mean():>11.3f} "
        f"{copyable.float().mean():>9.3f} {extra_right.sum() / max(int(copyable.sum()), 1):>14.3f} "
        f"{(r['own_hit'] & extra_wins).float().mean():>13.4f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", help="an EAGLE3 head directory with its own draft vocabulary")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--limit", type=int, default=40, help="eval prompts (spread over the set)")
    ap.add_argument("--train", type=int, default=256, help="self-distilled samples a and b are fitted on")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per answer")
    ap.add_argument(
        "--rank",
        type=int,
        default=0,
        help="also fit a rank-R correction of x with a and b (`fit_projection`) on the first 3/4 of "
        "the self-distilled samples, reported on the last 1/4 and on the eval set",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    plan, loaded, head, _, evalset = head_and_eval_answers(args)
    if head.shares_lm_head:
        raise SystemExit(f"{args.head}: the head drafts over the target's whole vocabulary; nothing is out of it")
    recipe = compose_run_config("+experiment=train_eagle3_smollm2")
    d = recipe.train.data
    train = synthesize_data(
        loaded,
        dataclasses.replace(
            d,
            num_samples=args.train,
            batch_size=min(args.train, 128),
            max_answer_tokens=args.tokens,
            seed=4242,
            sync_every=16,
        ),
    )
    everything = evalset + train
    trainer = scoring_trainer(plan, loaded, head, everything, recipe, "copy_probe")
    embed = loaded.model.lm_head.weight  # [V, H]: tied to the embedding in SmolLM2
    cut = len(train) * 3 // 4 if args.rank else len(train)  # --rank: the last 1/4 held out of both fits
    fitted, evaluated = positions(trainer, train[:cut], embed), positions(trainer, evalset, embed)
    sets = [("magpie fit" if args.rank else "magpie", fitted)]
    if args.rank:
        sets.append(("magpie held", positions(trainer, train[cut:], embed)))
    sets.append((args.dataset, evaluated))
    a, b = fit(fitted)
    print(f"extras' logits: {a:.3f} * (x . E[tok]) + {b:.3f}, fitted on {cut} self-distilled samples")
    header = (
        f"{'set':12} {'positions':>9} {'own acc':>9} {'with extras':>11} {'copyable':>9} "
        f"{'copies right':>14} {'own hits lost':>13}"
    )
    print(header)
    for name, r in sets:
        report(name, r, a, b)
    if args.rank:
        a, b, u, v = fit_projection(fitted, embed, args.rank)
        print(f"with a rank-{args.rank} correction of x: {a:.3f} * (x' . E[tok]) + {b:.3f}, fitted on {cut} samples")
        print(header)
        for name, r in sets:
            report(name, r, a, b, project(r, embed, u, v))


if __name__ == "__main__":
    main()
