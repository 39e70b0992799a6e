"""Speculative generators on the tiny target: drafts built from a config, graph sets captured under a
policy, taps into a draft's steps, and partial acceptance forced from the target's own tokens."""

from __future__ import annotations

import torch

from engine.drafts.multi_layer.train import multi_layer_forward
from engine.drafts.registry import draft_config, load_head, make_draft, plan_draft
from engine.drafts.train_contract import Batch
from engine.graphs.breakable import eager
from engine.speculative.generate import Generator
from engine.speculative.graph_set import GraphSet
from helpers.models import pair

AUX = [1, 2, 3]  # the tiny target has 3 layers: input_of ids 1..3


def weights(algorithm: str, reads_aux) -> dict:
    """A random head's keys for a draft with weights (none for ngram and oracle); AUX for `reads_aux`."""
    if algorithm in ("ngram", "oracle"):
        return {}
    return {"init": "random", **({"aux_layer_ids": AUX} if algorithm in reads_aux else {})}


def build(target, algorithm, batch, params, references=None, prompts=None, k=3, **kw):
    cfg = draft_config(algorithm, num_steps=k, **weights(algorithm, ("eagle3", "dflash")), **kw)
    plan = plan_draft(cfg, target.args)
    target.set_aux_layers(plan.aux.input_of if plan.aux else ())
    head = load_head(plan, target, 0, target.lm_head.weight.device, torch.float32)
    return generator(target, plan, head, k, batch, cfg, references, prompts)


def generator(target, plan, head, k, batch, cfg, references=None, prompts=None, graphs=None):
    """A speculative Generator over `plan`'s draft (with `graphs`: replaying them)."""
    lens = [len(p) for p in prompts] if prompts else None
    draft = make_draft(plan, head, target, batch, k, references=references, prompt_lens=lens, cfg=cfg, graphs=graphs)
    return Generator(target, batch, draft, k, graphs=graphs)


def run_all(gen, prompts, params, batch, stop=frozenset(), rng=None):
    out = []
    for i in range(0, len(prompts), batch):
        out += gen.generate(prompts[i : i + batch], params, stop, rng, row_ids=list(range(i, i + batch)))
    return out


def tap(draft, phase: str, fn) -> None:
    """A host hook after the draft's proposal or extend (phase propose | commit), eager under every
    graph policy that splits: fn(s, k, extra) sees the RoundState s (s.state.value: the host mirror, not
    yet advanced) and the proposal's logits (propose) or the Verified (commit). Attach before the round
    is built (before a GraphSet captures it); at capture time (no host state) it is skipped."""
    name = {"propose": "propose_into", "commit": "extend"}[phase]
    inner = getattr(draft, name)

    def hook(s, k, extra):
        if s.state.value is not None:
            fn(s, k, extra)

    hook = eager(hook, host=True)

    def propose(s, cache, k, kv_len, sampled=False):
        logits = inner(s, cache, k, kv_len, sampled)
        hook(s, k, logits)
        return logits

    def extend(s, cache, v, kv_len, sampled=False):
        inner(s, cache, v, kv_len, sampled)
        hook(s, v.emitted.shape[1] - 1, v)

    setattr(draft, name, propose if phase == "propose" else extend)


def mtp_training_proposal(target, head, seq: list[int], k: int) -> list[int]:
    """A multi-layer head's proposal by its training forward over seq = history + [d_1 .. d_{k-1}] (history
    ends with the pending token x_L): module i at position L-1 reads x_{L+i} = d_i and predicts d_{i+1}."""
    ids = torch.tensor([seq])
    n = len(seq) - k  # L: tokens in the target cache
    out = target(ids, torch.arange(len(seq))[None], target.new_cache(1), kv_len=len(seq))
    t = len(seq) - 1
    batch = Batch(ids[:, 1:], torch.arange(t)[None], out.hidden_states[:, :-1], None, None, None)
    logits = multi_layer_forward(head, batch, k)  # logits[i][:, q]: module i at q - i
    return [int(logits[i][0, n - 1 + i].argmax()) for i in range(k)]


def oracle_prefix(tokens, state, references, prompt_lens, g, k, rows=None):
    """Proposals [b, k] with each row's first `depth` tokens (depth random in 0..k) replaced by the
    target's own continuation: partial acceptance of a different depth per row. rows: those to touch."""
    tokens = tokens.clone()
    for i, (r, hist) in enumerate(zip(state.row_ids, state.history)):
        if rows is not None and i not in rows:
            continue
        done = len(hist) - prompt_lens[r]
        ref = references[r][done : done + int(torch.randint(0, k + 1, (1,), generator=g))]
        tokens[i, : len(ref)] = torch.tensor(ref, dtype=tokens.dtype)
    return tokens


CUDA = torch.cuda.is_available()


POLICIES = ["debug"] + (["full", "breakable"] if CUDA else [])


def setup(
    algorithm="none",
    policy="debug",
    draft_policy=None,
    k=3,
    sizes=(1, 2),
    batch=4,
    device="cpu",
    prefill=(16, 64),
    target_policy=None,
    prefill_rows=None,
    sampled=False,
):
    _, target = pair()
    target = target.to(device)
    target.init_buffers(torch.device(device))
    plan = head = draft = None
    if algorithm != "none":
        cfg = draft_config(algorithm, num_steps=k, **weights(algorithm, ("eagle3", "dflash")))
        plan = plan_draft(cfg, target.args)
        target.set_aux_layers(plan.aux.input_of if plan.aux else ())
        head = load_head(plan, target, 0, torch.device(device), torch.float32)
        if head is not None:
            draft = make_draft(plan, head, target, batch, k, cfg=cfg)
    else:
        k = 0
    gs = GraphSet(
        target,
        draft,
        batch,
        k,
        target_policy or policy,
        draft_policy or policy,
        list(sizes),
        list(prefill),
        features=plan is not None and plan.features.value != "none",
        round_ks=sorted({0, k}),
        prefill_rows=prefill_rows,
        sampled=sampled,
    ).capture()
    return target, plan, head, gs, k


def spec_generator(target, plan, head, gs, k, batch, params, references=None, prompts=None):
    cfg = draft_config(plan.algorithm, num_steps=k) if plan else draft_config("none")
    return generator(target, plan, head, k, batch, cfg, references, prompts, graphs=gs)


def poison(runner) -> None:
    """NaN into every floating tensor the runner's graphs own (the state buffers excepted)."""
    state = {t.data_ptr() for t in runner.buffers.values()}
    with torch.inference_mode():
        for _, env in runner.captured.values():
            for v in env.values():
                if torch.is_tensor(v) and v.is_floating_point() and v.data_ptr() not in state:
                    v.fill_(float("nan"))
