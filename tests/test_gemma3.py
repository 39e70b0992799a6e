"""Gemma 3 text targets against transformers' Gemma3ForCausalLM with the same random weights (fp32, CPU):
logits, aux hidden states, the sliding windows, greedy generation, the fused kernels, a saved checkpoint
loaded by model=hf, and an EAGLE3 head drafting on one and training on one through the real loop."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.models import gemma3_pair, hf_greedy, random_prompts, save_tiny_gemma3, tiny_gemma3_config
from helpers.runs import compose_cfg, metric_history
from helpers.spec import build
from helpers.train import TINY_TRAIN
from mlflow import MlflowClient

from engine.aux_layers import normalise
from engine.drafts.registry import draft_config, load_head, plan_draft
from engine.errors import ConfigError
from engine.loading import describe_model, load_model
from engine.model import LlamaModel, ModelArgs, RMSNorm
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator
from pipeline.__main__ import run
from pipeline.config import to_run_config
from pipeline.tracking import default_tracking_uri

KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
SLIDING, FULL = "sliding_attention", "full_attention"
AUX = ("eagle3", "dflash")  # drafts that read aux layers


def _forward(model: LlamaModel, ids: torch.Tensor, **kw):
    b, t = ids.shape
    return model(ids, torch.arange(t, device=ids.device).expand(b, t), model.new_cache(b), kv_len=t, **kw)


def test_gemma3_1b_config_json_describes_its_layers_and_parameters():
    """google/gemma-3-1b-it's config.json (transformers 4.x keys): every field, and the parameter count
    and tensor names of transformers' model built from it (on the meta device: no weights)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = {
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "rms_norm_eps": 1e-06,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
    }
    args = ModelArgs.from_hf_config(cfg)
    assert args.layer_types == ((SLIDING,) * 5 + (FULL,)) * 4 + (SLIDING,) * 2
    assert (args.rope_theta, args.rope_local_theta, args.rope_scaling) == (1e6, 1e4, None)
    assert (args.sliding_window, args.attn_scale, args.embed_scale) == (512, 1 / 16, 1152**0.5)
    assert args.hidden_act == "gelu_pytorch_tanh" and args.tie_word_embeddings and args.eos_token_ids == (1, 106)
    assert args.norm_unit_offset and args.sandwich_norms and args.qk_norm
    with torch.device("meta"):
        hf = Gemma3ForCausalLM(Gemma3TextConfig(**cfg))
        ours = LlamaModel(args, 64)
    assert args.num_params() == sum(p.numel() for p in hf.parameters()) == 999_885_952
    assert set(ours.state_dict()) == set(hf.state_dict())


def test_a_random_gemma3_target_starts_with_unit_norms():
    """model.random.model_type=gemma3_text: Gemma's layer, its norms' w at 0 (a scale of 1 + w = 1)."""
    from engine.loading import random_args
    from engine.model import init_normal_
    from schema import RandomArchConfig

    args = random_args(RandomArchConfig(model_type="gemma3_text"))
    assert args.sandwich_norms and args.qk_norm and args.hidden_act == "gelu_pytorch_tanh"
    model = init_normal_(LlamaModel(args, 32), 0)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 6 * args.num_layers + 1 and all(
        torch.equal(m.scale(), torch.ones_like(m.scale())) for m in norms
    )
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(_forward(model, ids).logits).all()


@pytest.mark.parametrize("key", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_softcapping_is_refused_by_name(key):
    with pytest.raises(ValueError, match=f"{key}=30.0 is not supported; valid: null"):
        ModelArgs.from_hf_config({**tiny_gemma3_config().to_dict(), key: 30.0})


def test_logits_aux_states_and_windows_match_transformers():
    """Logits on both prefill paths (the masked one and SDPA's causal one, which the sliding layers
    leave for the windowed mask), aux hidden states in both conventions (input_of i: transformers'
    hidden_states[i]; output_of i: hidden_states[i + 1]), and the window: 12 tokens past a window of 4
    give other logits without it."""
    hf, ours = gemma3_pair()
    ours.set_aux_layers([0, 1, 3])
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        outs = [_forward(ours, ids, causal=causal) for causal in (False, True)]
        wide = _forward(gemma3_pair(sliding_window=64)[1], ids).logits
    assert ref.logits.abs().max() > 1.0
    for out in outs:
        assert (out.logits - ref.logits).abs().max() < 1e-4
        aux = out.aux_hidden_states.chunk(3, dim=-1)
        torch.testing.assert_close(aux[0], ref.hidden_states[0], rtol=1e-5, atol=1e-5)  # the scaled embeddings
        torch.testing.assert_close(aux[1], ref.hidden_states[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.model.norm(aux[2]), ref.hidden_states[3], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.hidden_states, ref.hidden_states[3], rtol=1e-5, atol=1e-5)
    assert (wide - ref.logits).abs().max() > 1e-2
    ours.set_aux_layers(normalise([0, 1], "output_of", 3))  # EAGLE3's convention: layer i's output
    with torch.no_grad():
        aux = _forward(ours, ids).aux_hidden_states.chunk(2, dim=-1)
    for got, i in zip(aux, (0, 1)):
        torch.testing.assert_close(got, ref.hidden_states[i + 1], rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_transformers_and_batches_alike():
    """Past the window (prompts of 5-29 tokens, 16 new): token for token transformers' greedy output,
    one prompt at a time and in a padded batch."""
    hf, ours = gemma3_pair()
    prompts = random_prompts(3, seed=11)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    single = [Generator(ours, 1).generate([p], params)[0].tokens for p in prompts]
    assert single == [hf_greedy(hf, p, 16) for p in prompts]
    assert all(len(set(s)) > 3 for s in single)  # varied sequences
    assert [r.tokens for r in Generator(ours, 3).generate(prompts, params)] == single


@pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_fused_kernels_equal_the_plain_path_and_stay_batch_invariant():
    """The fused path (folded 1 + w norms, the GeGLU epilogue, q/k norms in the row kernel, the windowed
    Triton attention with Gemma's scale): logits of a prefill (cuBLAS, 18 tokens) and of a decode-sized
    step (rows kernels), aux states and greedy output as the plain path; a row's logits bitwise the same
    alone and beside other rows, in a decode and a verify."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, target = gemma3_pair(max_seq_len=64)
    target = target.to(device)
    target.init_buffers(torch.device(device))
    target.set_aux_layers([1, 3])
    ids = torch.randint(0, 256, (2, 18), generator=torch.Generator().manual_seed(5)).to(device)
    prompts = random_prompts(2, seed=381)  # 5 and 9 tokens
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with torch.no_grad():
        ref = [_forward(target, ids[:, :t]) for t in (18, 6)]
        ref_tokens = [r.tokens for r in Generator(target, 2).generate(prompts, params)]
        target.attention_kernel = True
        target.use_fused_kernels()
        for want, t in zip(ref, (18, 6)):
            got = _forward(target, ids[:, :t])
            torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got.aux_hidden_states, want.aux_hidden_states, atol=1e-4, rtol=1e-4)
    assert [r.tokens for r in Generator(target, 2).generate(prompts, params)] == ref_tokens

    _assert_row_is_batch_invariant(target, device)


@pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_sliding_layers_read_only_their_window_in_decode_and_verify():
    """Past 72 tokens (a window of 4, blocks of 64 slots): the Triton attention's logits of a decode step
    and of a verify of 3 equal transformers' with the sliding layers' slots 0..63 poisoned with NaN (a
    kernel that read them would return NaN); the global layer still reads every slot."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf, ours = gemma3_pair(max_seq_len=256)
    ours = ours.to(device)
    ours.init_buffers(torch.device(device))
    ids = torch.randint(0, 256, (1, 75), generator=torch.Generator().manual_seed(8))
    sliding = [i for i, t in enumerate(ours.args.layer_types) if t == SLIDING]
    with torch.no_grad():
        ref = hf(ids).logits[0, 72:]  # [3, vocab]
        ids, cache = ids.to(device), ours.new_cache(1)
        ours(ids[:, :72], torch.arange(72, device=device)[None], cache, kv_len=72)  # the prefill on SDPA
        cache.k[sliding, :, :, :64] = float("nan")
        cache.v[sliding, :, :, :64] = float("nan")
        ours.attention_kernel = True
        decode = ours(ids[:, 72:73], torch.tensor([[72]], device=device), cache, kv_len=73).logits[0]  # [1, vocab]
        verify = ours(ids[:, 72:], torch.arange(72, 75, device=device)[None], cache, kv_len=75).logits[0]
    torch.testing.assert_close(decode.cpu(), ref[:1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(verify.cpu(), ref, rtol=1e-4, atol=1e-4)  # [3, vocab]


def _assert_row_is_batch_invariant(target: LlamaModel, device: str) -> None:
    """Row 0's logits bitwise the same in a decode step alone, in a verify of 4 tokens, and beside other
    rows (its prompt of 8 tokens past the window of 4)."""
    g = torch.Generator().manual_seed(0)
    prompt, cont = torch.randint(0, 256, (8,), generator=g), torch.randint(0, 256, (4,), generator=g)

    def first_logits(batch: int, t: int) -> torch.Tensor:
        x = torch.randint(0, 256, (batch, 8 + t), generator=g)
        x[0, :8], x[0, 8:] = prompt, cont[:t]
        x, cache = x.to(device), target.new_cache(batch)
        with torch.inference_mode():
            target(x[:, :8], torch.arange(8, device=device).expand(batch, 8), cache, kv_len=8)
            pos = torch.arange(8, 8 + t, device=device).expand(batch, t)
            return target(x[:, 8:], pos, cache, kv_len=8 + t).logits[0, 0]

    alone = first_logits(1, 1)
    for batch, t in ((1, 4), (3, 1), (3, 4)):
        assert torch.equal(first_logits(batch, t), alone), (batch, t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_fused_row_is_batch_invariant_on_gpu():
    """bf16 on the GPU (the kernels' real tiles and tensor-core dots): a row's logits do not depend on its batch."""
    _, target = gemma3_pair(max_seq_len=64)
    target = target.to("cuda", torch.bfloat16)
    target.init_buffers(torch.device("cuda"))
    target.attention_kernel = True
    target.use_fused_kernels()
    _assert_row_is_batch_invariant(target, "cuda")


def test_model_hf_loads_a_saved_gemma3_checkpoint(tmp_path, outputs):
    """A save_pretrained directory with a tokenizer: described before any weight loads, loaded, and its
    logits transformers'; a config that sets a softcapping is refused naming the key."""
    hf = save_tiny_gemma3(tmp_path)
    cfg = to_run_config(compose_cfg("model=hf", f"model.path={tmp_path}", "model.max_seq_len=64", "device=cpu")).model
    args = describe_model(cfg, outputs / "weights")
    assert args.layer_types == (SLIDING, FULL, SLIDING) and args.rope_local_theta == 100.0
    loaded = load_model(cfg, outputs / "weights", torch.device("cpu"), torch.float32)
    ids = torch.tensor([loaded.tokenizer.encode("hello, gemma")])
    with torch.no_grad():
        assert (_forward(loaded.model, ids).logits - hf(ids).logits).abs().max() < 1e-4
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "final_logit_softcapping": 30.0}))
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        describe_model(cfg, outputs / "weights")


def test_eagle3_head_on_a_gemma3_target_is_lossless():
    """A random EAGLE3 head reading three aux layers of the Gemma target: speculative greedy output is
    the target's own."""
    _, target = gemma3_pair()
    prompts = random_prompts(2, seed=12)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = [r.tokens for r in Generator(target, 2).generate(prompts, params)]
    gen = build(target, "eagle3", 2, params)
    assert target.aux_layer_ids == (1, 2, 3)
    assert [r.tokens for r in gen.generate(prompts, params)] == plain


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle", "dflash", "multi_layer_eagle"])
def test_a_draft_head_takes_the_embeddings_the_gemma3_target_takes(algorithm):
    """A head bound to a Gemma target embeds tokens as the target's first layer does (times sqrt(hidden):
    transformers' hidden_states[0]); the fused MTP input (its embedding gather) equals the plain one."""
    hf, target = gemma3_pair()
    ids = torch.randint(0, 320, (2, 5), generator=torch.Generator().manual_seed(3))
    cfg = draft_config(algorithm, num_steps=2, init="random", **({"aux_layer_ids": [1, 3]} if algorithm in AUX else {}))
    head = load_head(plan_draft(cfg, target.args), target, 0, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True).hidden_states[0]  # [2, 5, 48]
        torch.testing.assert_close(head.embed_tokens(ids), want, rtol=0, atol=0)
        if algorithm == "multi_layer_eagle" and KERNELS:
            hidden = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(4))
            mod, positions = head.layers[0], torch.arange(5).expand(2, 5)
            plain = mod.fused_in(ids, hidden, positions)  # [2, 5, 48]
            mod.fused_in.fuse()
            torch.testing.assert_close(mod.fused_in(ids, hidden, positions), plain, rtol=1e-5, atol=1e-5)


# Each recipe's own keys on the tiny Gemma 3 (k = 3; aux layers for the drafts that read them)
GEMMA_RECIPES = {
    "eagle3": ["draft.aux_layer_ids=[1,2,3]", "draft.draft_vocab_size=96"],
    "dflash": [
        "draft.aux_layer_ids=[1,2,3]",
        "draft.aux_layer_convention=input_of",
        "draft.block_size=4",
        "draft.num_layers=1",
        "draft.num_kv_heads=4",
    ],
    "mtp": ["draft.intermediate_size=null"],
}


@pytest.mark.parametrize("recipe", list(GEMMA_RECIPES))
def test_a_head_trains_on_a_gemma3_checkpoint_through_the_real_loop_and_drafts_losslessly(recipe, outputs, tmp_path):
    """Each draft recipe on a saved tiny Gemma 3 (model=hf): self-distilled data, the trainer, the held-out
    loss falls; the exported head then drafts on the same target through the graph runners (graph=debug:
    the prefill graphs take the scaled embeddings, the head the same scaled embeddings) with greedy
    output the target's and transformers'."""
    save_tiny_gemma3(tmp_path / "gemma")
    model = ["model=hf", f"model.path={tmp_path / 'gemma'}", "model.max_seq_len=640", "dtype=float32"]
    tiny = [o for o in TINY_TRAIN if not o.startswith("model")]
    ctx = run(
        compose_cfg(
            *model,
            *tiny,
            f"+experiment=train_{recipe}_smollm2",
            *GEMMA_RECIPES[recipe],
            "draft.num_steps=3",
            "train.lr=5e-3",
            "train.steps=20",
            "train.eval_every=20",
            "train.save_every=20",
            "train.ttt_steps=3",
            "train.eval_k=3",
            "train.loop_eval_prompts=0",
            "train.name=gemma3",
        )
    )
    client = MlflowClient(default_tracking_uri(outputs))
    (r,) = client.search_runs([client.get_experiment_by_name(f"train_{recipe}_smollm2").experiment_id])
    val = metric_history(client, r.info.run_id, "val_loss")
    assert r.info.status == "FINISHED" and val[-1][0] == 20 and val[-1][1] < val[0][1]
    evaluated = run(
        compose_cfg(
            *model,
            f"+experiment={recipe}",
            "draft.init=checkpoint",
            f"draft.path={ctx['draft_checkpoint']}",
            "graph=debug",
            "eval.limit=2",
            "eval.max_new_tokens=16",
            "eval.peers=[hf_generate]",
            "draft.num_steps=3",
            "tracking=off",
        )
    )
    metrics = evaluated["eval_results"]["metrics"]
    assert metrics["match_baseline"] == 1.0 and metrics["peer_match.hf_generate"] == 1.0
