"""How much of an eval set's answers a draft vocabulary of each size covers:
`python benchmarks/vocab_coverage.py [--samples 1024] [--sizes 8192,12288,16384] [--dataset mt_bench] [--head DIR]`.

The target writes `--samples` self-distilled samples as the recipe does (`+experiment=train_eagle3_smollm2`)
and answers the eval set's prompts greedily (up to the recipe's `max_answer_tokens`). For each size, a
draft vocabulary is built from the samples (`build_draft_vocab`: the most frequent tokens, EOS kept),
counting the whole samples (prompt and answer, what the stage counts) or the answers only, and the
share of the eval answers' tokens inside it is printed. A greedy chain stops at any token outside the
vocabulary; `chain bound` scales the head's per-position acceptance by the coverage ratio (each of the
i + 1 tokens of position i, as if the head were as accurate on the newly covered tokens as on the
others) from `--rates` (a head's accept_rate_pos measured with the first size's vocabulary).
With `--head`, the coverage of that head's own vocabulary (its t2d) too.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from safetensors import safe_open

from engine.drafts.eagle3.vocab import build_draft_vocab
from engine.generate import Generator
from engine.prompts import load_prompts
from engine.sampling import SamplingParams
from pipeline.config import compose_run_config
from pipeline.plan import build_plan
from stages.train_draft import synthesize_data


def coverage(t2d: torch.Tensor, answers: list[list[int]]) -> float:
    tokens = torch.tensor([t for a in answers for t in a])
    return float(t2d[tokens].float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1024, help="self-distilled samples the vocabulary is counted on")
    ap.add_argument("--batch", type=int, default=256, help="generation batch")
    ap.add_argument("--sizes", default="8192,12288,16384")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument(
        "--rates",
        default="0.674,0.468,0.337,0.259,0.200",
        help="accept_rate_pos of a head with the first size (default: e3a's on MT-bench, 2.938)",
    )
    ap.add_argument("--head", help="an EAGLE3 head directory: its own vocabulary's coverage too")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = compose_run_config("+experiment=train_eagle3_smollm2", "tracking=off", *args.overrides)
    loaded = build_plan(cfg).set_up("load")["target"]
    tok, d, vocab = loaded.tokenizer, cfg.train.data, loaded.model.args.vocab_size
    eos = sorted(set(loaded.model.args.eos_token_ids))
    samples = synthesize_data(
        loaded, dataclasses.replace(d, num_samples=args.samples, batch_size=args.batch, sync_every=16)
    )
    prompts = [tok.encode_chat(p.text) for p in load_prompts(args.dataset)]
    answers = [
        r.tokens
        for r in Generator(loaded.model, len(prompts)).generate(
            prompts, SamplingParams(max_new_tokens=d.max_answer_tokens), tok.eos_token_ids, sync_every=16
        )
    ]
    print(
        f"{len(samples)} samples ({sum(len(s.answer_ids) for s in samples)} answer tokens); {args.dataset}: "
        f"{len(answers)} answers, {sum(map(len, answers))} tokens"
    )
    if args.head:
        with safe_open(f"{args.head}/model.safetensors", "pt") as f:
            t2d = f.get_tensor("t2d").bool()  # [V]: the head's draft tokens (public EAGLE3 format)
        print(f"the head's own vocabulary ({int(t2d.sum())} tokens): coverage {coverage(t2d, answers):.4f}")
    rates = [float(r) for r in args.rates.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{'size':>6} {'counted on':>12} {'coverage':>9} {'chain bound':>12}")
    for counted, seqs in (("whole", [s.ids for s in samples]), ("answers", [s.answer_ids for s in samples])):
        first = None
        for size in sizes:
            c = coverage(build_draft_vocab(seqs, vocab, size, eos)[1], answers)
            first = first or c
            bound = 1 + sum(r * (c / first) ** (i + 1) for i, r in enumerate(rates))
            print(f"{size:>6} {counted:>12} {c:>9.4f} {bound:>12.3f}", flush=True)


if __name__ == "__main__":
    main()
