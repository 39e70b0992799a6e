"""Golden outputs recorded from the engine as it was before its restructuring; behaviour must not change.

    tokens    greedy outputs and per-round accept counts of every draft under graph policies none and
              debug, plain (SDPA, unfused) and fused (the Triton kernels, interpreted on CPU), on the tiny
              target with heads trained and saved by the old code (tests/data/heads: they must load), and
              on the real SmolLM2 with its shipped heads (plain); sampled outputs for a few seeds
    hashes    sha256 of every tensor a program writes: the target's forward outputs, the KV caches and
              the round's state buffers after the prefill and after each round, the training forwards'
              logits; compared only on the CPU kind, torch and numpy they were recorded on

Record from a tree whose outputs are the reference: SPECPIPE_GOLDEN=record python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy
import pytest
import torch
from helpers.runs import compose_cfg

from engine.drafts.base import SpecState
from engine.drafts.registry import DRAFTS, load_head, make_draft, plan_draft
from engine.loading import load_model
from engine.sampling import RowSettings, SamplingParams
from engine.speculative.generate import Generator
from engine.speculative.graph_set import GraphSet
from pipeline.config import to_run_config
from pipeline.paths import REPO

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden.json"
HEADS = DATA / "heads"  # tiny heads trained and saved before the restructuring: config.json + model.safetensors
RECORD = os.environ.get("SPECPIPE_GOLDEN") == "record"
MACHINE = {"cpu": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "numpy": numpy.__version__}
TINY = ["model=tiny_trainable", "model.max_seq_len=128"]
TINY_DRAFTS = {  # algorithm -> its draft.* overrides on the tiny target (k = 3)
    "none": [],
    "eagle3": [f"draft.path={HEADS / 'eagle3'}", "draft.aux_layer_ids=null", "draft.num_steps=3"],
    "eagle": [f"draft.path={HEADS / 'eagle'}", "draft.num_steps=3"],
    "multi_layer_eagle": [f"draft.path={HEADS / 'mtp'}", "draft.num_steps=3"],
    "dflash": [f"draft.path={HEADS / 'dflash'}", "draft.aux_layer_ids=null", "draft.num_steps=3"],
    "ngram": ["draft.num_steps=3"],
    "oracle": ["draft.num_steps=3"],
}
# plain: SDPA, unfused; fused: the Triton kernels (interpreted on CPU: seconds a forward, so the fused
# sets run the target's forwards and a few greedy tokens only)
KERNELS = {"plain": ("sdpa", "false"), "fused": ("triton", "true"), "fused_sdpa": ("sdpa", "true")}
DEVICE = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Hashes are recorded on one thread: how many threads share a CPU matmul changes its bits."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def golden():
    store = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    yield store
    if RECORD:
        store["machine"] = MACHINE
        DATA.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")


def check(golden: dict, key: str, value) -> None:
    """value equals the recorded one (record mode: it is recorded)."""
    value = json.loads(json.dumps(value))  # tuples -> lists, as the file holds them
    if RECORD:
        golden[key] = value
        return
    assert key in golden, f"no golden value for {key}: record it with SPECPIPE_GOLDEN=record"
    assert value == golden[key], key


def check_hashes(golden: dict, key: str, value: dict) -> None:
    if not RECORD and golden.get("machine") != MACHINE:
        pytest.skip(f"hashes recorded on {golden.get('machine')}, this is {MACHINE}")
    want = golden.get(key, {}) if not RECORD else value
    if not RECORD:
        bad = sorted(n for n in value.keys() | want.keys() if value.get(n) != want.get(n))
        assert not bad, f"{key}: tensors differ from the recorded ones: {bad[:12]}"
    check(golden, key, value)


def digest(x) -> str:
    if x is None:
        return "none"
    t = x.detach().cpu().contiguous()
    return _sha(t.to(torch.uint8) if t.dtype == torch.bool else t)


def _sha(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def cache_tensors(prefix: str, cache) -> dict:
    """A static cache's k/v without its dummy slot (padding's writes land there in any order)."""
    caches = getattr(cache, "caches", [cache])
    out = {}
    for i, c in enumerate(caches):
        out[f"{prefix}{i}.k"] = c.k[..., : c.max_seq_len, :]
        out[f"{prefix}{i}.v"] = c.v[..., : c.max_seq_len, :]
    return out


# ------------------------------------------------------------------------------------------- setup
def run_cfg(*overrides: str):
    return to_run_config(compose_cfg(*overrides, "device=cpu", "dtype=float32", "tracking=off"))


def load_target(model: list[str], kernels: str):
    attention, fused = KERNELS[kernels]
    cfg = run_cfg(*model, f"model.attention={attention}", f"model.fused={fused}")
    return load_model(cfg.model, REPO / "outputs" / "weights", DEVICE, torch.float32).model


def draft_cfg(model: list[str], algorithm: str, overrides: list[str]):
    return run_cfg(*model, f"draft={algorithm}", *overrides).draft


def tiny_prompts(n: int = 2, seed: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


class Case:
    """One target with one draft (k = the config's), eager or replaying debug graphs."""

    def __init__(self, target, cfg, policy: str, batch: int, references=None, prompts=None, sampled=False):
        self.plan = plan_draft(cfg, target.args)
        target.set_aux_layers(self.plan.aux.input_of if self.plan and self.plan.aux else ())
        self.head = load_head(self.plan, target, 0, DEVICE, torch.float32)
        k = cfg.num_steps if self.plan is not None else 0
        lens = [len(p) for p in prompts] if prompts else None
        draft = None
        self.graphs = None
        if policy == "debug":
            if self.head is not None:
                draft = make_draft(self.plan, self.head, target, batch, k, cfg=cfg)
            self.graphs = GraphSet(
                target,
                draft,
                batch,
                k,
                "debug",
                "debug",
                [1, batch],
                [16, 64],
                features=self.plan is not None and self.plan.features.value != "none",
                sampled=sampled,
                round_ks=sorted({0, k}),
            ).capture()
        draft = make_draft(
            self.plan, self.head, target, batch, k, references=references, prompt_lens=lens, cfg=cfg, graphs=self.graphs
        )
        self.draft = draft
        self.gen = Generator(target, batch, draft, k, graphs=self.graphs)

    def generate(self, prompts, params, seeds=None) -> dict:
        batch, out = self.gen.batch_size, {"tokens": [], "accepts": []}
        for i in range(0, len(prompts), batch):
            rows = prompts[i : i + batch]
            s = seeds[i : i + batch] if seeds is not None else None
            for r in self.gen.generate(rows, params, row_ids=list(range(i, i + len(rows))), seeds=s):
                out["tokens"].append(r.tokens)
                out["accepts"].append(r.accepts)
        if self.graphs is not None:
            out["graphs"] = {n: [s.replays, s.fallbacks] for n, s in self.graphs.stats().items()}
        return out


GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=10, ignore_eos=True)
SEEDS = [11, 12, 13]


@pytest.fixture(scope="module")
def references() -> dict:
    """The no-draft greedy outputs per kernel set (the oracle proposes them)."""
    return {}


def baseline(references: dict, model, kernels: str, prompts, params=GREEDY) -> list[list[int]]:
    key = (tuple(model), kernels)
    if key not in references:
        target = load_target(model, kernels)
        references[key] = Case(target, draft_cfg(model, "none", []), "none", 2).generate(prompts, params)["tokens"]
    return references[key]


# ------------------------------------------------------------------------------------------- tiny: tokens
@pytest.mark.parametrize("kernels", ["plain"])
@pytest.mark.parametrize("policy", ["none", "debug"])
@pytest.mark.parametrize("algorithm", list(TINY_DRAFTS))
def test_tiny_greedy_tokens_and_accepts(golden, references, algorithm, policy, kernels):
    prompts = tiny_prompts()
    refs = baseline(references, TINY, kernels, prompts)
    target = load_target(TINY, kernels)
    case = Case(target, draft_cfg(TINY, algorithm, TINY_DRAFTS[algorithm]), policy, 2, refs, prompts)
    got = case.generate(prompts, GREEDY)
    assert got["tokens"] == refs  # lossless, as before
    check(golden, f"tiny.greedy.{algorithm}.{policy}.{kernels}", got)


@pytest.mark.parametrize("kernels", ["plain"])
@pytest.mark.parametrize("policy", ["none", "debug"])
@pytest.mark.parametrize("algorithm", ["none", "eagle3", "eagle", "multi_layer_eagle", "dflash", "ngram"])
def test_tiny_sampled_tokens(golden, algorithm, policy, kernels):
    prompts = tiny_prompts()
    target = load_target(TINY, kernels)
    case = Case(target, draft_cfg(TINY, algorithm, TINY_DRAFTS[algorithm]), policy, 2, prompts=prompts, sampled=True)
    check(golden, f"tiny.sampled.{algorithm}.{policy}.{kernels}", case.generate(prompts, SAMPLED, SEEDS))


def test_tiny_heads_load_bitwise(golden):
    """Each head saved by the old code loads into the same weights."""
    target = load_target(TINY, "plain")
    got = {}
    for algorithm in ("eagle3", "eagle", "multi_layer_eagle", "dflash"):
        plan = plan_draft(draft_cfg(TINY, algorithm, TINY_DRAFTS[algorithm]), target.args)
        head = load_head(plan, target, 0, DEVICE, torch.float32)
        got[algorithm] = {n: _sha(t) for n, t in head.state_dict().items()}
        assert plan.checkpoint is not None and DRAFTS[algorithm].head is type(head)
    check_hashes(golden, "tiny.heads", {f"{a}.{n}": h for a, d in got.items() for n, h in d.items()})


# ------------------------------------------------------------------------------------------- tiny: tensors
@pytest.mark.parametrize("kernels", list(KERNELS))
def test_tiny_target_forward_tensors(golden, kernels):
    """Prefill, decode and verify forwards: logits, hidden, aux hidden states, embeds and the cache."""
    target = load_target(TINY, kernels)
    target.set_aux_layers([1, 2, 4])
    g = torch.Generator().manual_seed(0)
    cache = target.new_cache(2)
    tokens = torch.randint(0, 320, (2, 20), generator=g)  # 20 > ROWS_KERNEL_TOKENS: the prefill's cuBLAS path
    valid = torch.arange(20)[None] < torch.tensor([[20], [7]])
    got = {}
    with torch.inference_mode():
        steps = [
            ("prefill", tokens, torch.arange(20).expand(2, 20), valid, 20, {}),
            (
                "prefill_index",
                tokens,
                torch.arange(20).expand(2, 20),
                valid,
                20,
                {"logits_index": torch.tensor([19, 6])},
            ),
            ("decode", tokens[:, :1], torch.tensor([[20], [7]]), None, 21, {}),
            ("verify", tokens[:, :4], torch.tensor([[21], [8]]) + torch.arange(4), None, 25, {}),
        ]
        for name, tok, pos, val, kv_len, kw in steps:
            out = target(tok, pos, cache, valid=val, kv_len=kv_len, **kw)
            for field in ("logits", "hidden_states", "aux_hidden_states", "input_embeds"):
                got[f"{name}.{field}"] = digest(getattr(out, field))
            got.update({f"{name}.{n}": digest(t) for n, t in cache_tensors("cache", cache).items()})
        embeds = target.model.embed_tokens(tokens) * 0.5
        out = target(None, torch.arange(20).expand(2, 20), target.new_cache(2), input_embeds=embeds, kv_len=20)
        got["embeds.logits"], got["embeds.aux"] = digest(out.logits), digest(out.aux_hidden_states)
    check_hashes(golden, f"tiny.forward.{kernels}", got)


@pytest.mark.parametrize("kernels", ["plain"])
@pytest.mark.parametrize("policy", ["none", "debug"])
@pytest.mark.parametrize("algorithm", ["none", "eagle3", "eagle", "multi_layer_eagle", "dflash"])
def test_tiny_round_tensors(golden, algorithm, policy, kernels):
    """The prefill's outputs, then after the draft's prefill and after each of 3 rounds (greedy, then
    sampled rows) every state buffer and KV cache of the target and the draft."""
    prompts = tiny_prompts(2)
    target = load_target(TINY, kernels)
    case = Case(target, draft_cfg(TINY, algorithm, TINY_DRAFTS[algorithm]), policy, 2, sampled=True)
    gen, got = case.gen, {}

    def snapshot(tag: str) -> None:
        tensors = {**{f"buf.{n}": t for n, t in gen.buffers.items()}, **cache_tensors("target", gen.cache)}
        if case.draft is not None and case.draft.on_device:
            tensors.update(cache_tensors("draft", case.draft.cache))
        got.update({f"{tag}.{n}": digest(t) for n, t in tensors.items()})

    with torch.inference_mode():
        for params, tag in ((GREEDY, "greedy"), (SAMPLED, "sampled")):
            state = SpecState([list(p) for p in prompts], [len(p) for p in prompts], [True, True], [0, 1], DEVICE)
            pre = gen.prefill(prompts, None)
            for field in ("logits", "hidden_states", "aux_hidden_states"):
                got[f"{tag}.prefill.{field}"] = digest(getattr(pre.out, field))
            first = gen.start(state, pre, RowSettings.uniform(params, SEEDS[:2]))
            for i, t in enumerate(first.tolist()):
                state.history[i].append(t)
            snapshot(f"{tag}.begin")
            for r in range(2):
                res = gen.round(state)
                got[f"{tag}.round{r}.accepted"] = res.accepted
                snapshot(f"{tag}.round{r}")
    check_hashes(golden, f"tiny.round.{algorithm}.{policy}.{kernels}", got)


def _train_batch(head, b: int = 2, t: int = 12):
    from engine.drafts.train_contract import Batch

    g = torch.Generator().manual_seed(0)
    feats = torch.randn(b, t, head.feature_width, generator=g)
    tokens = torch.randint(0, 320, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, :3] = False
    spans = torch.tensor([[0, t], [3, t]])
    return Batch(tokens, torch.arange(t).expand(b, t), feats, torch.zeros(b, t, 1), tokens, mask, spans=spans)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_training_forward_tensors(golden):
    """Each trainable draft's training forward over a fixed batch: its per-step logits (or Rows)."""
    from engine.drafts.common.ttt import TORCH_OPS, TRITON_OPS

    target = load_target(TINY, "plain")
    got = {}
    with torch.no_grad():
        for algorithm in ("eagle3", "eagle", "multi_layer_eagle", "dflash"):
            plan = plan_draft(draft_cfg(TINY, algorithm, TINY_DRAFTS[algorithm]), target.args)
            head = load_head(plan, target, 0, DEVICE, torch.float32)
            spec = DRAFTS[algorithm].train
            batch = _train_batch(head)
            runs = {"torch": spec.forward(head, batch, 3)}
            if spec.forward_ops:
                runs["triton"] = spec.forward(head, batch, 3, ops=TRITON_OPS)
            if spec.flex_attention is not None:
                runs["flex"] = spec.forward(head, batch, 3, attention=spec.flex_attention)
            if spec.packed_forward is not None:
                runs["packed"] = spec.packed_forward(head, batch, 3, ops=TORCH_OPS)
            for name, steps in runs.items():
                for s, x in enumerate(steps):
                    if torch.is_tensor(x):
                        got[f"{algorithm}.{name}.{s}"] = digest(x)
                    else:
                        got[f"{algorithm}.{name}.{s}"] = [digest(x.hidden), digest(x.position)]
    check_hashes(golden, "tiny.train", got)


# ------------------------------------------------------------------------------------------- SmolLM2
SMOL = ["model=smollm2"]
SMOL_CASES = [("eagle3", "none"), ("eagle3", "debug"), ("dflash", "none"), ("multi_layer_eagle", "none")]
SMOL_PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def smol(golden):
    """The real SmolLM2 (plain: the fused kernels take minutes a forward in the interpreter) and the
    prompts: two MT-bench questions in the chat template, as token ids."""
    if RECORD:
        from engine.loading import load_tokenizer
        from engine.prompts import load_prompts

        cfg = run_cfg(*SMOL)
        target = load_target(SMOL, "plain")
        tok = load_tokenizer(cfg.model, REPO / "outputs" / "weights", target.args)
        golden["smollm2.prompts"] = [tok.encode_chat(p.text) for p in load_prompts("mt_bench", 2)]
    return load_target(SMOL, "plain"), golden["smollm2.prompts"]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, policy", SMOL_CASES)
def test_smollm2_greedy_tokens_and_accepts(golden, smol, algorithm, policy):
    target, prompts = smol
    case = Case(target, draft_cfg(SMOL, algorithm, []), policy, 2, None, prompts)
    got = case.generate(prompts, SMOL_PARAMS)
    check(golden, f"smollm2.greedy.{algorithm}.{policy}", got)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["eagle3"])
def test_smollm2_sampled_tokens(golden, smol, algorithm):
    target, prompts = smol
    case = Case(target, draft_cfg(SMOL, algorithm, []), "none", 2, prompts=prompts, sampled=True)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=12, ignore_eos=True)
    check(golden, f"smollm2.sampled.{algorithm}", case.generate(prompts, params, [5, 6]))
