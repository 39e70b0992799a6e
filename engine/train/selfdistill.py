"""Self-distilled training data: the target writes the prompts and the answers (Magpie-style).

    1. prompt the target with its chat template cut where a user message begins, and sample until the
       user turn ends: a user message in the target's own distribution, no evaluation set involved.
       `system_prompts` steer what is asked, as Magpie does per task: row i of every batch is prompted
       under system_prompts[i % n] ("" or none: the template's default system message);
    2. apply the chat template to that message and let the target answer (greedy by default, as the
       draft will be asked to predict the target's greedy continuation);
    3. keep the token ids: `prompt_ids` (template + message) and `answer_ids`. Aux hidden states and
       target distributions are recomputed from these ids during training, so the data stays small;
    4. with `passage_share` > 0, that share of the samples asks a task about a text instead (summarize,
       extract, rewrite, critique...: `passage_tasks`, templates with a `{passage}` slot): the text is
       one of the target's own complete answers from steps 1-2, and the target answers the task (greedy).
       Magpie's messages are short (a median of about 30 tokens) and never hold a document, while real
       requests often do (MT-bench's extraction prompts: a median 214 tokens), and answers to them copy
       names, terms and numbers from it: the contexts a draft trained on Magpie alone has never seen.

Everything runs batched through `engine.generate.Generator`, on whatever device the target is on, with
the decode bookkeeping on the device (`sync_every`: the host looks every few steps, not every step; the
same tokens as the eval loop). Each generation batch draws from its own seeded generator, so the
samples depend on the seed, the sizes and the device's kernels, not on the host's looks (sync_every).
The training stage runs it with the target's `batch_invariant` off: its hundreds of rows a step go to
cuBLAS, not to the rows kernels that keep a row's output independent of its batch.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from engine.generate import Generator
from engine.loading import LoadedModel
from engine.sampling import SamplingParams


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
    n: int,
    batch_size: int = 16,
    max_prompt_tokens: int = 64,
    max_answer_tokens: int = 256,
    prompt_temperature: float = 1.0,
    prompt_top_p: float = 0.95,
    answer_temperature: float = 0.0,
    seed: int = 0,
    min_prompt_chars: int = 8,
    graphs=None,
    sync_every: int = 16,
    system_prompts: Sequence[str] = (),
    drop_cut: bool = False,
    passage_share: float = 0.0,
    passage_tasks: Sequence[str] = (),
    passage_tokens: tuple[int, int] = (32, 160),
    passage_temperature: float = 0.0,
    phase_s: Optional[dict[str, float]] = None,
) -> list[Sample]:
    """`n` samples; user messages shorter than `min_prompt_chars` are drawn again (bounded tries), and so
    are those cut at `max_prompt_tokens` with `drop_cut` (else they are answered as they are, `Sample.cut`).
    `graphs`: an engine.graphs GraphSet for the target's decode (CUDA graphs), or None (eager).
    `sync_every`: decode steps between host looks (up to sync_every - 1 steps run past a batch's end).
    `system_prompts`: the system messages the user messages are written under, row by row (the answers
    are always asked for under the template's default, as the eval asks).
    `passage_share` of the `n` samples (rounded) are tasks about passages (step 4): `passage_tasks` over
    the complete answers of `passage_tokens` (min, max) tokens, paired by `task_messages` (a passage met
    again gets the next task), answered under the default system message;
    `passage_temperature` > 0: the passages are answers sampled anew at that temperature (_passage_tasks).
    `phase_s`: if given, the seconds spent writing the user messages ("messages"), the answers ("answers")
    and the passage tasks' answers ("passages") are added to it (each phase ends on a host read of its
    tokens, so the times are whole)."""
    n_tasks = passage_task_count(n, passage_share, passage_tasks)
    samples = _magpie(
        target,
        n - n_tasks,
        batch_size,
        max_prompt_tokens,
        max_answer_tokens,
        prompt_temperature,
        prompt_top_p,
        answer_temperature,
        seed,
        min_prompt_chars,
        graphs,
        sync_every,
        system_prompts,
        drop_cut,
        phase_s,
    )
    if n_tasks:
        samples += _passage_tasks(
            target,
            samples,
            n_tasks,
            passage_tasks,
            passage_tokens,
            passage_temperature,
            batch_size,
            max_answer_tokens,
            answer_temperature,
            seed,
            graphs,
            sync_every,
            phase_s,
        )
    return samples


def passage_task_count(n: int, share: float, tasks: Sequence[str]) -> int:
    """How many of `n` samples are passage tasks (synthesize puts them last): the share, rounded; none
    without tasks."""
    return round(n * share) if tasks else 0


def _magpie(
    target: LoadedModel,
    n: int,
    batch_size: int,
    max_prompt_tokens: int,
    max_answer_tokens: int,
    prompt_temperature: float,
    prompt_top_p: float,
    answer_temperature: float,
    seed: int,
    min_prompt_chars: int,
    graphs,
    sync_every: int,
    system_prompts: Sequence[str],
    drop_cut: bool,
    phase_s: Optional[dict[str, float]],
) -> list[Sample]:
    """Steps 1-3: `n` Magpie samples (synthesize's arguments)."""
    tok, model = target.tokenizer, target.model
    turns = [tok.user_turn(sp or None) for sp in (system_prompts or [""])]
    prefixes = [turns[i % len(turns)][0] for i in range(batch_size)]
    end_ids = turns[0][1]
    gen = Generator(model, batch_size, graphs=graphs)
    rng = torch.Generator(device=model.lm_head.weight.device)  # seeded per batch below
    ask = SamplingParams(temperature=prompt_temperature, top_p=prompt_top_p, max_new_tokens=max_prompt_tokens)
    answer = SamplingParams(temperature=answer_temperature, max_new_tokens=max_answer_tokens)
    samples: list[Sample] = []
    bar = tqdm(total=n, desc="self-distill", unit="sample", dynamic_ncols=True)
    tries = 4 * (n // batch_size + 1)  # generation batches at most: short (and cut) messages are dropped
    for attempt in range(tries):
        if len(samples) >= n:
            break
        rng.manual_seed((seed << 32) + attempt)
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


def passages(target: LoadedModel, samples: Sequence[Sample], tokens: tuple[int, int]) -> list[str]:
    """The texts tasks are asked about: the answers that ended on a stop token (complete) and hold
    tokens[0]..tokens[1] tokens before it, decoded, in the samples' order."""
    stop = set(target.tokenizer.eos_token_ids)
    low, high = tokens
    return [
        target.tokenizer.decode(s.answer_ids[:-1]).strip()
        for s in samples
        if s.answer_ids and s.answer_ids[-1] in stop and low <= len(s.answer_ids) - 1 <= high
    ]


def task_messages(texts: Sequence[str], tasks: Sequence[str], n: int) -> list[str]:
    """`n` user messages: message i is tasks[i % T] about texts[i % P]; a text met again (n > P) gets the
    next task in turn, so it is never asked the same task twice before all T were asked."""
    p, t = len(texts), len(tasks)
    return [tasks[(i % p + i // p) % t].format(passage=texts[i % p]) for i in range(n)]


def _passage_tasks(
    target: LoadedModel,
    samples: Sequence[Sample],
    n: int,
    tasks: Sequence[str],
    tokens: tuple[int, int],
    passage_temperature: float,
    batch_size: int,
    max_answer_tokens: int,
    answer_temperature: float,
    seed: int,
    graphs,
    sync_every: int,
    phase_s: Optional[dict[str, float]],
) -> list[Sample]:
    """Step 4: `n` samples whose user message is a task about one of `samples`' answers (with
    `passage_temperature` > 0: about answers to the first ceil(n / 4) of `samples`' messages sampled anew
    at that temperature, texts the target would not write greedily, whose words must be copied rather
    than guessed)."""
    tok = target.tokenizer
    gen = Generator(target.model, batch_size, graphs=graphs)
    rng = torch.Generator(device=target.model.lm_head.weight.device)
    t0 = time.perf_counter()
    source = samples
    if passage_temperature > 0:
        firsts = samples[: -(-n // 4)]
        sampled = SamplingParams(temperature=passage_temperature, top_p=0.95, max_new_tokens=max_answer_tokens)
        source = [
            Sample(s.user, s.prompt_ids, a)
            for s, a in zip(
                firsts, _answers(gen, [s.prompt_ids for s in firsts], sampled, tok, rng, seed, 1, sync_every)
            )
        ]
    texts = passages(target, source, tokens)
    if not texts:
        raise ValueError(
            f"self-distill: no complete answer of {tokens[0]}..{tokens[1]} tokens among "
            f"{len(source)} samples to ask passage tasks about; valid: more samples, or a wider "
            f"train.data.passage_tokens"
        )
    users = task_messages(texts, tasks, n)
    prompts = [tok.encode_chat(u) for u in users]
    answer = SamplingParams(temperature=answer_temperature, max_new_tokens=max_answer_tokens)
    out = [
        Sample(u, p, a)
        for u, p, a in zip(users, prompts, _answers(gen, prompts, answer, tok, rng, seed, 2, sync_every))
    ]
    if phase_s is not None:
        phase_s["passages"] = phase_s.get("passages", 0.0) + time.perf_counter() - t0
    return out


def _answers(
    gen: Generator,
    prompts: list[list[int]],
    params: SamplingParams,
    tok,
    rng: torch.Generator,
    seed: int,
    stream: int,
    sync_every: int,
) -> list[list[int]]:
    """The target's answers to `prompts`, a generation batch at a time, batch b drawing from its own
    generator seeded by (seed, stream, b): apart from the Magpie batches' seeds and from each other stream."""
    out: list[list[int]] = []
    for b, i in enumerate(
        tqdm(range(0, len(prompts), gen.batch_size), desc="passage tasks", unit="batch", dynamic_ncols=True)
    ):
        rng.manual_seed((seed << 32) + (stream << 28) + (1 << 31) + b)
        out += [
            r.tokens
            for r in gen.generate(
                prompts[i : i + gen.batch_size], params, tok.eos_token_ids, rng, sync_every=sync_every
            )
        ]
    return out
