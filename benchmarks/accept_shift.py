"""How far an EAGLE3 head's acceptance moves from its own data to an eval set:
`python benchmarks/accept_shift.py HEAD_DIR [--dataset mt_bench] [--limit 80] [--tokens 256]
[--recipe OVERRIDE ...] [overrides...]`.

The target answers the eval set's prompts greedily (batched, `--tokens` new tokens at most) and writes
`--limit` Magpie samples of its own (`engine.train.selfdistill.synthesize`, the training data's kind: under
the recipe's system messages or, with `--plain`, the template's default). Each `--recipe`, a set of
overrides of the recipe's data such as `--recipe magpie=topics_detailed`, adds a candidate's samples: how
new its prompts are to the head (with passage tasks, `--recipe passages=tasks`, those also as a set of
their own). The head is then scored on every set with the trainer's held-out
evaluation (`Trainer.evaluate`: teacher-forced per-step accuracy, draft-vocabulary coverage, and the
greedy loop replayed over each answer up to `--tokens`, which the eval stage's accept_length matches).
Two more columns: the share of answer tokens outside the draft vocabulary, and the share of those already
in the context (the prompt or earlier in the answer: what a copying path could draft). One row per set,
then one per category of the eval set. It also prints how far the head's lm_head rows moved from the
target's they were initialized from. No eval prompt is ever trained on: the eval answers are only scored.

`--misses` adds a second table: where the first draft (step 0, teacher-forced) misses the target's
greedy token on answer positions whose greedy token is a draft token, how close the target's own call
was (its top probability over the draft vocabulary, and whether the draft took its second choice):
near-ties are where labels sharpened toward the greedy token (`train.label_temperature`) can act.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
from pathlib import Path

import torch

from engine.drafts.registry import train_spec
from engine.generate import Generator
from engine.prompts import load_prompts
from engine.sampling import SamplingParams
from engine.train.data import VocabMap, batches
from engine.train.selfdistill import Sample, cut_share, passage_task_count
from engine.train.trainer import Trainer
from pipeline.config import compose_run_config
from pipeline.plan import build_plan
from stages.train_draft import settings, synthesize_data

COLUMNS = ("val_loop_accept_length_k5", "val_accept_length_k5", "val_acc_0", "val_draft_vocab_coverage", "val_loss")


def out_of_vocab(samples: list[Sample], to_draft: torch.Tensor) -> tuple[float, float]:
    """The share of answer tokens outside the draft vocabulary (`to_draft` [V]: -1 there), and the share
    of those already in the context (the prompt, or earlier in the answer): what copying could draft."""
    n = oov = copied = 0
    for s in samples:
        seen = set(s.prompt_ids)
        for t in s.answer_ids:
            n += 1
            if to_draft[t] < 0:
                oov += 1
                copied += t in seen
            seen.add(t)
    return oov / max(n, 1), copied / max(oov, 1)


def first_drafts(trainer: Trainer, samples: list[Sample]):
    """(group, batch, logits [B, T, Vd]) batch by batch: the head's first draft (step 0, teacher-forced)
    on `samples`, with the labels at T = 1 (the target's own distribution), in eval mode."""
    s = trainer.s
    trainer.head.eval()
    for group in batches(samples, s.max_tokens, s.max_len, None):
        batch = trainer._batch(group)  # as the trainer's held-out evaluation builds it (labels at T = 1)
        (logits,) = trainer.spec.forward(trainer.head, batch, 1)  # [B, T, Vd], step 0
        yield group, batch, logits


@torch.no_grad()
def miss_anatomy(trainer: Trainer, samples: list[Sample]) -> dict[str, float]:
    """The first draft's misses on `samples` (answer positions, greedy token inside the draft vocab)."""
    hit_p, miss_p, second = [], [], 0
    for _, batch, logits in first_drafts(trainer, samples):
        m = batch.mask & (batch.top >= 0)
        draft, top, p = logits.argmax(-1)[m], batch.top[m], batch.labels[m]  # [N], [N], [N, Vd]
        p_top = p.gather(-1, top[:, None])[:, 0]  # [N]
        miss = draft != top
        hit_p.append(p_top[~miss])
        miss_p.append(p_top[miss])
        second += int((p.topk(2, -1).indices[:, 1] == draft)[miss].sum())
    hit, missed = torch.cat(hit_p), torch.cat(miss_p)
    n = len(hit) + len(missed)
    return {
        "positions": n,
        "miss": len(missed) / max(n, 1),
        "second_choice": second / max(len(missed), 1),
        "p_top_miss": float(missed.median()) if len(missed) else float("nan"),
        "p_top_hit": float(hit.median()) if len(hit) else float("nan"),
        "near_tie": float((missed < 0.5).float().mean()) if len(missed) else float("nan"),
    }


def head_and_eval_answers(args):
    """-> plan, loaded target, head, eval prompts, eval samples: the head of `args.head` on its target
    (`args.overrides`), and the target's greedy answers (up to `args.tokens`) to `args.limit` prompts
    spread over `args.dataset`."""
    cfg = compose_run_config(
        "+experiment=eagle3",
        "tracking=off",
        "draft.init=checkpoint",
        f"draft.path={Path(args.head).resolve()}",
        *args.overrides,
    )
    plan = build_plan(cfg)
    ctx = plan.set_up("load", "configure_aux_capture")
    loaded, head = ctx["target"], ctx["draft_head"]
    tok = loaded.tokenizer
    prompts = load_prompts(args.dataset)
    prompts = prompts[:: max(1, len(prompts) // args.limit)][: args.limit]
    ids = [tok.encode_chat(p.text) for p in prompts]
    answers = Generator(loaded.model, len(ids)).generate(
        ids, SamplingParams(max_new_tokens=args.tokens), tok.eos_token_ids, sync_every=16
    )
    return plan, loaded, head, prompts, [Sample(p.text, i, r.tokens) for p, i, r in zip(prompts, ids, answers)]


def scoring_trainer(plan, loaded, head, samples: list[Sample], recipe, name: str) -> Trainer:
    """A trainer that only scores: its KV rows sized for every one of `samples`, each set evaluated in
    turn as its held-out split."""
    return Trainer(
        head,
        loaded.model,
        samples,
        samples,
        VocabMap.of(head),
        settings(recipe, plan.env.device),
        plan.env.outputs_dir / name,
        lambda *a, **k: None,
        train_spec(recipe.draft.algorithm),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", help="an EAGLE3 head directory (config.json, model.safetensors)")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--limit", type=int, default=80, help="eval prompts (spread over the set) and Magpie samples")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per answer; the replay's horizon")
    ap.add_argument("--plain", action="store_true", help="Magpie under the template's default system message only")
    ap.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="OVERRIDES",
        help="a candidate recipe's data (space-separated overrides of the recipe), its Magpie samples "
        "one more set (repeatable), e.g. 'magpie=topics_detailed train.data.max_prompt_tokens=128'",
    )
    ap.add_argument("--misses", action="store_true", help="also the first draft's misses, set by set")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()  # overrides may follow the options
    plan, loaded, head, prompts, evalset = head_and_eval_answers(args)
    target, tok = loaded.model, loaded.tokenizer
    recipe = compose_run_config("+experiment=train_eagle3_smollm2")
    sets = {args.dataset: evalset}
    for overrides in [""] + args.recipe:  # the recipe's own Magpie samples, then each candidate's
        d = compose_run_config("+experiment=train_eagle3_smollm2", *overrides.split()).train.data
        name = overrides or ("magpie (plain)" if args.plain else "magpie")
        sets[name] = synthesize_data(
            loaded,
            dataclasses.replace(
                d,
                num_samples=args.limit,
                batch_size=min(args.limit, d.batch_size),
                max_answer_tokens=args.tokens,
                seed=12345,
                sync_every=16,
                system_prompts=[] if args.plain and not overrides else list(d.system_prompts),
            ),
        )
        print(
            f"{name}: median user message {statistics.median(len(tok.encode(s.user)) for s in sets[name]):g} "
            f"tokens, {cut_share(sets[name]):.2f} cut",
            flush=True,
        )
        n_tasks = passage_task_count(args.limit, d.passage_share, d.passage_tasks)
        if n_tasks:  # the passage tasks (the last n_tasks samples) also as a set of their own
            sets[f"{name} [tasks]"] = sets[name][-n_tasks:]
    everything = [s for samples in sets.values() for s in samples]
    print(f"{args.dataset}: median user message {statistics.median(len(tok.encode(p.text)) for p in prompts):g} tokens")
    by_category = collections.defaultdict(list)
    for p, s in zip(prompts, evalset):
        by_category[p.category or "-"].append(s)
    sets.update({f"  {c}": s for c, s in by_category.items()})

    recipe.train.loop_eval_tokens = args.tokens  # the replay's horizon
    # one trainer (its KV rows sized for every set), evaluating one set at a time as its held-out split
    trainer = scoring_trainer(plan, loaded, head, everything, recipe, "accept_shift")
    w = max(16, *map(len, sets))  # the name column
    to_draft = trainer.vocab.to_draft.cpu()
    if not head.shares_lm_head:  # how far the head's lm_head rows moved from the target's they started from
        cos = torch.nn.functional.cosine_similarity(
            head.lm_head.weight.float(), target.lm_head.weight[trainer.vocab.used].float(), dim=-1
        )
        print(f"the head's lm_head rows against the target's: median cosine {cos.median():.3f}")
    print(
        f"{'set':{w}} {'n':>3} {'tokens':>6} "
        + " ".join(f"{c.removeprefix('val_'):>22}" for c in COLUMNS)
        + f" {'out_of_vocab':>12} {'oov_in_context':>14}"
    )
    for name, samples in sets.items():
        trainer.heldout = samples
        m = trainer.evaluate()
        oov, in_context = out_of_vocab(samples, to_draft)
        print(
            f"{name:{w}} {len(samples):>3} {sum(len(s.answer_ids) for s in samples):>6} "
            + " ".join(f"{m[c]:>22.3f}" for c in COLUMNS)
            + f" {oov:>12.3f} {in_context:>14.3f}",
            flush=True,
        )
    if args.misses:
        print(
            "\nfirst draft's misses (step 0, answer positions with a draft-vocab greedy token; p_top: the "
            "target's probability of its greedy token;\nnear_tie: misses where it is below 0.5; "
            "second_choice: misses where the draft took the target's second token)"
        )
        cols = ("positions", "miss", "second_choice", "near_tie", "p_top_miss", "p_top_hit")
        print(f"{'set':{w}} " + " ".join(f"{c:>14}" for c in cols))
        for name, samples in sets.items():
            a = miss_anatomy(trainer, samples)
            print(f"{name:{w}} {a['positions']:>14} " + " ".join(f"{a[c]:>14.3f}" for c in cols[1:]), flush=True)


if __name__ == "__main__":
    main()
