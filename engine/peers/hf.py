"""Peers: other ways to generate from the same weights, timed on the same prompts in the same job.

Each peer takes the loaded target, the tokenized prompts and the sampling params, and returns its
generated tokens and wall time, so that eval can log `peer_tokens_per_s.<name>` and our ratio to it
side by side. Registered peers:

    hf_generate       transformers `generate` with its default dynamic cache, batched with left padding
    hf_static_compile the same with `cache_implementation="static"`, whose decode step transformers
                      compiles with torch.compile on CUDA. Every batch has one shape (prompts left-padded
                      to the longest prompt of the set, the last batch filled up, the full max_new_tokens),
                      so the static cache has one length and the step compiles once, in the warm-up
    hf_prompt_lookup  transformers prompt-lookup decoding (`prompt_lookup_num_tokens=10`): n-gram drafts
                      from the prompt, verified by the model; batch size 1 (transformers' limit)
    torch_compile     the target's weights decoded the way gpt-fast does (engine/peers/compiled_decode.py): plain
                      torch ops over a static KV cache, the decode step under torch.compile with CUDA graphs

Timing: `wall_s` is the generation over every batch after a warm-up at the timed shape; the warm-up's
time (compilation included) is `warmup_s`, logged apart as `peer_warmup_s.<name>`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from engine.loading import LoadedModel
from engine.peers.compiled_decode import CompiledDecoder
from engine.sampling import SamplingParams
from engine.speculative.generate import sync


@dataclass
class PeerResult:
    outputs: list[list[int]]  # generated tokens per prompt (cut after the first stop token)
    wall_s: float  # generation time over all batches, warm-up excluded
    warmup_s: float = 0.0  # the warm-up at the timed shape (compilation included)

    @property
    def generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def hf_model(loaded: LoadedModel, device: torch.device, dtype: torch.dtype):
    """A transformers model with the target's weights (same tensors' values, its own storage)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if loaded.hf_dir:
        model = AutoModelForCausalLM.from_pretrained(loaded.hf_dir, dtype=dtype)
    else:  # random-init target: mirror its args into a LlamaConfig and copy the weights
        a = loaded.model.args
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=a.vocab_size,
                hidden_size=a.hidden_size,
                intermediate_size=a.intermediate_size,
                num_hidden_layers=a.num_layers,
                num_attention_heads=a.num_heads,
                num_key_value_heads=a.num_kv_heads,
                head_dim=a.head_dim,
                rms_norm_eps=a.rms_norm_eps,
                rope_theta=a.rope_theta,
                tie_word_embeddings=a.tie_word_embeddings,
                max_position_embeddings=loaded.model.max_seq_len,
            )
        )
        model.load_state_dict(loaded.model.state_dict(), strict=False)
    return model.to(device=device, dtype=dtype).eval()


def _cut(tokens: list[int], stop: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def _timed(
    run: Callable[[list[list[int]]], list[list[int]]], warmup: Callable[[], object], prompts, batch_size, device
) -> PeerResult:
    """`warmup()` timed alone, then `run` over the prompts batch by batch, each batch timed between syncs;
    a progress bar over both (the warm-up may compile for minutes)."""
    bar = tqdm(total=len(prompts), desc="peer (warm-up)", unit="prompt", dynamic_ncols=True)
    try:
        sync(device)
        t0 = time.perf_counter()
        warmup()
        sync(device)
        warmup_s = time.perf_counter() - t0
        bar.set_description("peer")
        outputs, wall = [], 0.0
        for i in range(0, len(prompts), batch_size):
            sync(device)
            t0 = time.perf_counter()
            outputs += run(prompts[i : i + batch_size])
            sync(device)
            wall += time.perf_counter() - t0
            bar.update(len(prompts[i : i + batch_size]))
    finally:
        bar.close()
    return PeerResult(outputs, wall, warmup_s)


def _hf_peer(extra: dict, max_batch: int | None = None, fixed_shape: bool = False) -> Callable[..., PeerResult]:
    """A transformers `generate` peer with `extra` generation kwargs; `fixed_shape`: every batch is
    [batch_size, longest prompt] (left padding, the last batch filled with copies of its first prompt)."""

    @torch.inference_mode()
    def peer(
        loaded: LoadedModel,
        prompts: list[list[int]],
        params: SamplingParams,
        batch_size: int,
        stop_ids: frozenset[int],
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> PeerResult:
        model = hf_model(loaded, device, dtype)
        pad = next(iter(stop_ids), 0)
        batch_size = min(batch_size, max_batch or batch_size)

        def gen_kwargs(max_new: int) -> dict:
            kw = dict(max_new_tokens=max_new, pad_token_id=pad, do_sample=not params.greedy, **extra)
            if not params.greedy:
                kw.update(temperature=params.temperature, top_p=params.top_p, top_k=None)
            if params.ignore_eos:  # fixed-length benchmark: no stop token (min_new_tokens would mask EOS instead)
                kw.update(eos_token_id=None)
            else:
                kw.update(eos_token_id=sorted(stop_ids))
            return kw

        longest = max(len(p) for p in prompts)

        def run(batch: list[list[int]], max_new: int = params.max_new_tokens) -> list[list[int]]:
            n = len(batch)
            if fixed_shape:
                batch = batch + [batch[0]] * (batch_size - n)
            width = longest if fixed_shape else max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(batch):  # left padding, as decoder-only generate expects
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **gen_kwargs(max_new))
            stop = frozenset() if params.ignore_eos else stop_ids
            return [_cut(row[width:].tolist(), stop) for row in out[:n]]

        torch.manual_seed(seed)
        warm_new = params.max_new_tokens if fixed_shape else 8  # fixed shape: the warm-up compiles the timed shape
        return _timed(run, lambda: run(prompts[:batch_size], max_new=warm_new), prompts, batch_size, device)

    return peer


hf_generate = _hf_peer({})

STOP_CHECK_EVERY = 16  # decode steps between the host's looks at the stop tokens (one sync each)


@torch.inference_mode()
def torch_compile_peer(
    loaded: LoadedModel,
    prompts: list[list[int]],
    params: SamplingParams,
    batch_size: int,
    stop_ids: frozenset[int],
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
) -> PeerResult:
    """The target's weights decoded gpt-fast's way (engine/peers/compiled_decode.py), greedily; every batch
    [batch_size, longest prompt] so that the step compiles once, in the warm-up."""
    width, max_new = max(len(p) for p in prompts), params.max_new_tokens
    dec = CompiledDecoder(loaded.model, batch_size, width, max_new, device)
    stop = frozenset() if params.ignore_eos else stop_ids

    def run(batch: list[list[int]], steps: int = max_new) -> list[list[int]]:
        n = len(batch)
        batch = batch + [batch[0]] * (batch_size - n)
        pad = torch.tensor([width - len(p) for p in batch])
        tokens = torch.stack([torch.tensor([0] * (width - len(p)) + p) for p in batch])  # [b, W] left-padded
        out = torch.empty(batch_size, steps, dtype=torch.long, device=device)  # [b, max_new]
        out[:, 0] = dec.prefill(tokens.to(device), pad.to(device))
        slot = torch.tensor([width], device=device)  # [1]: the slot every row writes next
        done = 1
        for t in range(1, steps):
            out[:, t] = dec.step(out[:, t - 1 : t], slot)
            slot += 1
            done = t + 1
            if stop and done % STOP_CHECK_EVERY == 0:
                seen = torch.isin(out[:n, :done], torch.tensor(sorted(stop), device=device)).any(-1)
                if bool(seen.all()):
                    break
        return [_cut(row, stop) for row in out[:n, :done].tolist()]

    # the warm-up runs the timed shape: compilation, CUDA graph capture
    return _timed(run, lambda: run(prompts[:batch_size]), prompts, batch_size, device)


GREEDY_PEERS = frozenset({"torch_compile"})  # peers that decode greedily only (eval.temperature=0)

PEERS: dict[str, Callable[..., PeerResult]] = {
    "hf_generate": hf_generate,
    "hf_static_compile": _hf_peer({"cache_implementation": "static"}, fixed_shape=True),
    "hf_prompt_lookup": _hf_peer({"prompt_lookup_num_tokens": 10}, max_batch=1),
    "torch_compile": torch_compile_peer,
}
