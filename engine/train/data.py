"""Training data for draft heads: samples on disk, length-bucketed batches, target features per batch.

    samples.jsonl   one self-distilled sample per line: {"user", "prompt_ids", "answer_ids", "cut"}
    meta.json       what produced them (target checkpoint, generation settings): a cache key
    stats.json      how long the synthesis took, whole and by phase (reported again when the samples are reused)

The target's aux hidden states and distributions are recomputed per batch from the ids (a 135M target
forward costs less than reading stored features back), in `target_batch`:

    ids [B, L] right-padded  ->  draft positions p = 0..L-2:
        tokens x_{p+1}, feats f_p (aux), label_logits z_{p+1} over the draft vocab (the labels are
        softmax(z / T), T the training's label_temperature, 1 for held-out figures; the loss reads the
        logits: kernels/soft_ce.py), top: draft id of x_{p+2} (-1 outside the draft vocabulary),
        mask: x_{p+2} is an answer token (the part the draft is asked to predict), and spans: where it
        is True, [first, end) per row, on the host (it is the answer's span, shifted by two)

`top` is what the held-out figures score the draft against. The answers are the target's greedy
continuations, so x_{p+2} is the target's greedy token where it wrote the sample: what the eval's
draft-and-verify loop verifies against. It needs no target logits over the whole vocabulary, so the
target's pass ends at its final hidden state and only the draft vocabulary's rows of its lm_head run.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.drafts.base import FeatureKind
from engine.drafts.train_contract import Batch
from engine.train import distributed
from engine.train.selfdistill import Sample, cut_share

if TYPE_CHECKING:
    from engine.train.target_graphs import TargetGraphs


def save_samples(
    path: Path, samples: list[Sample], meta: dict, synth_s: float, phase_s: Optional[dict[str, float]] = None
) -> None:
    """samples.jsonl, meta.json (the cache key) and stats.json (how long synthesis took: `synth_s`, and
    by phase, e.g. graph capture, messages, answers)."""
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f"samples.jsonl.{os.getpid()}.tmp"  # per process: two jobs may synthesise the same key
    with open(tmp, "w") as f:
        for s in samples:
            f.write(
                json.dumps({"user": s.user, "prompt_ids": s.prompt_ids, "answer_ids": s.answer_ids, "cut": s.cut})
                + "\n"
            )
    tmp.rename(path / "samples.jsonl")  # complete or absent: never half-written
    (path / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    (path / "stats.json").write_text(json.dumps({"synth_s": synth_s, "phase_s": phase_s or {}}))


def synth_seconds(path: Path) -> tuple[float, dict[str, float]]:
    """The recorded synthesis time of cached samples and its phases (0.0 and {} when unknown)."""
    stats = path / "stats.json"
    if not stats.is_file():
        return 0.0, {}
    s = json.loads(stats.read_text())
    return s["synth_s"], s.get("phase_s", {})


def load_samples(path: Path, meta: dict) -> Optional[list[Sample]]:
    """The cached samples when they were produced with exactly `meta`, else None."""
    if not (path / "samples.jsonl").is_file() or not (path / "meta.json").is_file():
        return None
    if json.loads((path / "meta.json").read_text()) != json.loads(json.dumps(meta, sort_keys=True)):
        return None
    with open(path / "samples.jsonl") as f:
        return [Sample(r["user"], r["prompt_ids"], r["answer_ids"], r.get("cut", False)) for r in map(json.loads, f)]


def cached_samples(
    root: Path, meta: dict, make: Callable[[dict, tuple[int, int]], list[Sample]]
) -> tuple[list[Sample], float, dict[str, float], bool]:
    """The samples `meta` describes, from their folder under `root` (named by a hash of `meta`), else made
    by `make(phase_s, (rank, ranks))` and saved -> (samples, synthesis seconds, by phase, reused).

    Under torchrun every rank makes its shard (saved under the folder's shards/), rank 0 joins them in
    rank order after a barrier, and every rank reads the whole set back."""
    path = root / hashlib.sha1(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:12]
    samples = load_samples(path, meta)
    if samples is not None:
        print(f"[train_draft] reusing {len(samples)} samples from {path}", flush=True)
        return (samples, *synth_seconds(path), True)
    t0, phase_s = time.perf_counter(), {}
    rank, ranks = distributed.rank(), distributed.world_size()
    samples = make(phase_s, (rank, ranks))
    if torch.cuda.is_available():  # the generation's KV cache and graph pools (49.5 GiB reserved at 1024
        gc.collect()  # rows on SmolLM2) go back to the driver: other runs may share the GPU
        torch.cuda.empty_cache()
    if ranks == 1:
        synth_s = time.perf_counter() - t0
        save_samples(path, samples, meta, synth_s, phase_s)
        return samples, synth_s, phase_s, False
    shards = path / "shards"
    save_samples(shards / str(rank), samples, meta, time.perf_counter() - t0, phase_s)
    distributed.barrier()
    synth_s = time.perf_counter() - t0
    if rank == 0:
        joined = [x for r in range(ranks) for x in load_samples(shards / str(r), meta)]
        save_samples(path, joined, meta, synth_s, phase_s)
        shutil.rmtree(shards)
    distributed.barrier()
    return load_samples(path, meta), synth_s, phase_s, False


DEGENERATE_SHARE = 0.5  # one token above this share of the answers' tokens: the data teaches nothing


def top_token(samples: list[Sample]) -> tuple[int, int, int]:
    """(the most frequent answer token, its count, all answer tokens): a target that repeats one token
    writes answers a head predicts by always proposing it, which held-out acceptance scores as perfect."""
    counts = Counter(t for s in samples for t in s.answer_ids)
    if not counts:
        return -1, 0, 0
    tok, n = counts.most_common(1)[0]
    return tok, n, sum(counts.values())


def describe_data(
    samples: list[Sample],
    train: list[Sample],
    heldout: list[Sample],
    synth_s: float,
    phase_s: dict[str, float],
    reused: bool,
    max_prompt_tokens: int,
    decode: Callable[[list[int]], str],
) -> tuple[dict, dict[str, float], str]:
    """A training run's data in words and figures -> (its facts for training.json, its MLflow figures, the
    lines the run prints: a WARNING when one token fills the answers)."""
    facts = {
        "samples": len(samples),
        "answer_tokens": sum(len(s.answer_ids) for s in samples),
        "prompts_cut": cut_share(samples),
        "data_s": synth_s,
    }
    tok, n, total = top_token(samples)
    figures = {
        "data_s": synth_s,
        "data_reused": float(reused),
        **{f"data_{k}": facts[k] for k in ("samples", "prompts_cut", "answer_tokens")},
        "data_train_samples": len(train),
        "data_heldout_samples": len(heldout),
        **{f"data_{k}_s": v for k, v in phase_s.items()},
        "data_top_token_share": n / max(total, 1),
    }
    text = (
        f"[train_draft] {facts['samples']} samples ({facts['answer_tokens']} answer tokens, "
        f"{facts['prompts_cut']:.0%} of the user messages cut at {max_prompt_tokens} tokens) in "
        f"{synth_s:.1f}s ({', '.join(f'{k} {v:.1f}s' for k, v in phase_s.items()) or 'phases unknown'}); "
        f"{len(train)} train / {len(heldout)} held out"
    )
    if n > DEGENERATE_SHARE * total:
        text += (
            f"\nWARNING: degenerate data: token {tok} ({decode([tok])!r}) is {n} of the {total} answer tokens "
            f"({n / total:.0%}): a target that repeats one token teaches a head nothing, and its held-out "
            "acceptance will read high. A random target needs wider weights: model=tiny_trainable"
        )
    return facts, figures, text


def split(samples: list[Sample], heldout: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, held-out): a seeded shuffle, at least one held-out sample."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    n = max(1, round(heldout * len(samples)))
    return [samples[i] for i in order[n:]], [samples[i] for i in order[:n]]


def batch_width(samples: list[Sample], max_len: int) -> int:
    """A batch's columns: its longest sample, cut to max_len."""
    return min(max(len(s.ids) for s in samples), max_len)


def batches(samples: list[Sample], max_tokens: int, max_len: int, seed: Optional[int]) -> list[list[Sample]]:
    """Length-bucketed batches of at most `max_tokens` padded tokens (sequences cut to `max_len`);
    the batch order is shuffled with `seed` (None: kept, for evaluation)."""
    ordered = sorted(samples, key=lambda s: len(s.ids))
    out, cur = [], []
    for s in ordered:
        width = min(len(s.ids), max_len)
        if cur and width * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    if seed is not None:
        random.Random(seed).shuffle(out)
    return out


class VocabMap:
    """Target <-> draft ids for a reduced draft vocabulary (d2t/t2d of the public EAGLE3 format)."""

    def __init__(self, d2t: Tensor, t2d: Tensor):
        self.used = torch.arange(d2t.shape[0], device=d2t.device) + d2t  # [Vd] target id of each draft id
        self.to_draft = torch.full((t2d.shape[0],), -1, dtype=torch.long, device=d2t.device)  # [V]
        self.to_draft[self.used] = torch.arange(d2t.shape[0], device=d2t.device)
        self.full = bool((d2t == 0).all()) and d2t.shape[0] == t2d.shape[0]  # the identity map

    @classmethod
    def identity(cls, vocab_size: int, device) -> "VocabMap":
        """Drafts that predict over the target's whole vocabulary (its lm_head)."""
        return cls(
            torch.zeros(vocab_size, dtype=torch.long, device=device),
            torch.ones(vocab_size, dtype=torch.bool, device=device),
        )

    @classmethod
    def of(cls, head) -> "VocabMap":
        """A head's map: its d2t/t2d (an lm_head of its own), else the identity (the target's lm_head)."""
        if head.shares_lm_head:
            return cls.identity(head.args.vocab_size, next(head.parameters()).device)
        return cls(head.d2t, head.t2d)


@torch.no_grad()
def target_batch(
    target,
    cache,
    samples: list[Sample],
    vocab: VocabMap,
    max_len: int,
    device,
    features: FeatureKind = FeatureKind.aux,
    causal: bool = True,
    label_temperature: float = 1.0,
    graphs: Optional[TargetGraphs] = None,
    width: Optional[int] = None,
    rows: Optional[int] = None,
) -> Batch:
    """Run the target over the samples -> the draft's training batch; feats are the aux hidden states
    (aux capture configured) or the final normed hidden states (`features`). `causal`: the target's
    attention as one causal SDPA over the fresh rows (flash on CUDA) instead of its decode path.
    `label_temperature`: labels are softmax(z / T) over the draft vocabulary (T < 1 sharpens them
    toward the greedy token); the batch keeps z itself, in the target's dtype. `graphs`: the forward
    replayed from the target's training graphs (engine/train/target_graphs.py; causal, over `cache`).
    `width`: pad the rows to this many columns (at least the longest sample's, cut to max_len). `rows`: pad
    the batch to this many rows with copies of its last sample that train nothing (no answer tokens)."""
    trained = len(samples)
    samples = samples + samples[-1:] * ((rows or 0) - trained)
    lens = [min(len(s.ids), max_len) for s in samples]
    b, width = len(samples), max(max(lens), width or 0)
    # Built in pinned memory and copied without a sync, so the host queues this batch's target forward
    # while the device still runs the previous step (a pageable copy would wait for it).
    pinned = torch.device(device).type == "cuda"
    ids = torch.zeros(b, width, dtype=torch.long, pin_memory=pinned)
    answer = torch.zeros(b, width, dtype=torch.bool, pin_memory=pinned)
    length = torch.tensor(lens, pin_memory=pinned)
    ids_, answer_ = ids.numpy(), answer.numpy()  # filled through numpy: a torch op a row costs more than the row
    for i, s in enumerate(samples):
        ids_[i, : lens[i]] = s.ids[: lens[i]]
        answer_[i, len(s.prompt_ids) : lens[i]] = i < trained
    first = [max(len(s.prompt_ids) - 2, 0) for s in samples]  # mask[i, p] = answer[i, p + 2]
    ends = [max(n - 2, f) if i < trained else f for i, (f, n) in enumerate(zip(first, lens))]  # copies: none
    spans = torch.tensor(list(zip(first, ends)), dtype=torch.long)  # [B, 2] host
    ids, answer, length = (x.to(device, non_blocking=True) for x in (ids, answer, length))
    positions = torch.arange(width, device=device).expand(b, width)  # [B, L]
    valid = positions < length[:, None]
    first = torch.zeros(b, dtype=torch.long, device=device)  # full-vocabulary logits at one position only
    if graphs is not None:
        out = graphs(ids, positions, valid, first)
    else:
        out = target(ids, positions, cache.rows(b), valid=valid, kv_len=width, causal=causal, logits_index=first)
    feats = out.aux_hidden_states if features == FeatureKind.aux else out.hidden_states
    if feats is None:
        raise RuntimeError("the target captures no aux hidden states: configure_aux_capture must run first")
    w = target.lm_head.weight if vocab.full else target.lm_head.weight[vocab.used]  # [Vd, H]
    label_logits = F.linear(out.hidden_states[:, 1:], w)  # [B, L-1, Vd]: z_{p+1} over the draft vocabulary
    top = vocab.to_draft[torch.cat([ids[:, 2:], ids.new_zeros(b, 1)], 1)]  # [B, L-1]: x_{p+2}
    return Batch(
        tokens=ids[:, 1:],
        positions=positions[:, :-1],
        feats=feats[:, :-1],
        label_logits=label_logits,
        top=top,
        mask=torch.cat([answer[:, 2:], answer.new_zeros(b, 1)], 1),
        label_temperature=label_temperature,
        spans=spans,
    )
