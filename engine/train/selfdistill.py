"""Self-distilled training data: the target writes the prompts and the answers (Magpie-style).

    1. prompt the target with its chat template cut where a user message begins, and sample until the
       user turn ends: a user message in the target's own distribution, no evaluation set involved.
       `system_prompts` steer what is asked, as Magpie does per task: row i of every batch is prompted
       under system_prompts[i % n] ("" or none: the template's default system message);
    2. apply the chat template to that message and let the target answer (greedy by default, as the
       draft will be asked to predict the target's greedy continuation);
    3. keep the token ids: `prompt_ids` (template + message) and `answer_ids`. Aux hidden states and
       target distributions are recomputed from these ids during training, so the data stays small;

Everything runs batched through the `generator` the caller passes in (an `engine.speculative.generate.Generator`
over the target, with its graphs or none), on whatever device the target is on, with
the decode bookkeeping on the device (`sync_every`: the host looks every few steps, not every step; the
same tokens as the eval loop). Each generation batch draws from its own seeded generator, so the
samples depend on the seed, the sizes and the device's kernels, not on the host's looks (sync_every).
The training stage runs it with the target's `batch_invariant` off: its hundreds of rows a step go to
cuBLAS, not to the rows kernels that keep a row's output independent of its batch.

Sharded over ranks (`shard=(r, n)`, data-parallel training: engine/train/distributed.py), rank r draws its
generation batches from seeds r, r + n, r + 2n, ... of the one-process sequence 0, 1, 2, ...: disjoint
slices, the same samples for the same (seed, r, n), and `shard=(0, 1)` is the one-process run itself.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from engine.loading import LoadedModel
from engine.sampling import SamplingParams

# The user messages' sampling and the generator seed: fixed (no recipe varies them), and in the data's
# cache key and training.json beside the train.data settings.
FIXED = {"prompt_temperature": 1.0, "prompt_top_p": 0.95, "seed": 0}


@dataclass(frozen=True)
class Sample:
    user: str  # the synthesised user message
    prompt_ids: list[int]  # chat template applied to it
    answer_ids: list[int]  # the target's answer (the stop token included when it ended the answer)
    cut: bool = False  # the user message reached max_prompt_tokens before its turn ended

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


def cut_share(samples: Sequence[Sample]) -> float:
    """The share of samples whose user message was cut at `max_prompt_tokens`."""
    return sum(s.cut for s in samples) / max(len(samples), 1)


def synthesize(
    target: LoadedModel,
    generator,
    n: int,
    max_prompt_tokens: int = 64,
    max_answer_tokens: int = 256,
    prompt_temperature: float = FIXED["prompt_temperature"],
    prompt_top_p: float = FIXED["prompt_top_p"],
    answer_temperature: float = 0.0,
    seed: int = FIXED["seed"],
    min_prompt_chars: int = 8,
    sync_every: int = 16,
    system_prompts: Sequence[str] = (),
    drop_cut: bool = False,
    phase_s: Optional[dict[str, float]] = None,
    shard: tuple[int, int] = (0, 1),
) -> list[Sample]:
    """`n` samples; user messages shorter than `min_prompt_chars` are drawn again (bounded tries), and so
    are those cut at `max_prompt_tokens` with `drop_cut` (else they are answered as they are, `Sample.cut`).
    `generator`: an engine.speculative.generate.Generator over target.model (its rows: the generation batch; its
    graphs, if any, the decode's), built by the caller.
    `sync_every`: decode steps between host looks (up to sync_every - 1 steps run past a batch's end).
    `system_prompts`: the system messages the user messages are written under, row by row (the answers
    are always asked for under the template's default, as the eval asks).
    `phase_s`: if given, the seconds spent writing the user messages ("messages") and the answers
    ("answers") are added to it (each phase ends on a host read of its tokens, so the times are whole).
    `shard`: (rank, ranks): this rank's slice of the generation batches' seeds; only rank 0 shows progress."""
    tok, model = target.tokenizer, target.model
    turns = [tok.user_turn(sp or None) for sp in (system_prompts or [""])]
    gen, batch_size = generator, generator.batch_size
    prefixes = [turns[i % len(turns)][0] for i in range(batch_size)]
    end_ids = turns[0][1]
    rng = torch.Generator(device=model.lm_head.weight.device)  # seeded per batch below
    ask = SamplingParams(temperature=prompt_temperature, top_p=prompt_top_p, max_new_tokens=max_prompt_tokens)
    answer = SamplingParams(temperature=answer_temperature, max_new_tokens=max_answer_tokens)
    samples: list[Sample] = []
    rank, ranks = shard
    bar = tqdm(total=n, desc="self-distill", unit="sample", dynamic_ncols=True, disable=rank != 0)
    tries = 4 * (n // batch_size + 1)  # generation batches at most: short (and cut) messages are dropped
    for attempt in range(tries):
        if len(samples) >= n:
            break
        rng.manual_seed((seed << 32) + rank + ranks * attempt)
        t0 = time.perf_counter()
        users = []  # (message, cut)
        for r in gen.generate(prefixes, ask, end_ids, rng, sync_every=sync_every):
            cut = r.finish_reason == "length"  # no end of turn within max_prompt_tokens
            text = tok.decode([t for t in r.tokens if t not in end_ids]).strip()
            if len(text) >= min_prompt_chars and not (cut and drop_cut):
                users.append((text, cut))
        users = users[: n - len(samples)]
        if not users:
            continue
        prompts = [tok.encode_chat(u) for u, _ in users]
        t1 = time.perf_counter()
        for (u, cut), p, r in zip(
            users, prompts, gen.generate(prompts, answer, tok.eos_token_ids, rng, sync_every=sync_every)
        ):
            samples.append(Sample(u, p, r.tokens, cut))
        if phase_s is not None:
            phase_s["messages"] = phase_s.get("messages", 0.0) + t1 - t0
            phase_s["answers"] = phase_s.get("answers", 0.0) + time.perf_counter() - t1
        bar.update(len(users))
    bar.close()
    if len(samples) < n:
        warnings.warn(
            f"self-distill: {len(samples)} of {n} samples after {tries} generation "
            f"batches; the rest of the user messages were shorter than min_prompt_chars={min_prompt_chars}"
            f"{' or cut at max_prompt_tokens=' + str(max_prompt_tokens) if drop_cut else ''}",
            stacklevel=2,
        )
    return samples
