"""MTP layers shipped inside a target's checkpoint (MiMo's model.mtp_layers.{i}.*, DeepSeek-V3's
model.layers.{N + i}.*) read as the multi-layer head's modules: a tiny Qwen2 target saved with two MTP
layers written under the public names and shapes (the names below are written out here, not taken from
engine/drafts/multi_layer/public.py), loaded with the same weights as the head they were written from,
saved in our layout and loaded back, drafting losslessly; every module reading a zero token embedding
at position 0 (as vLLM and sglang run these layers), in begin, propose, extend and training, plain and
fused, while our own heads keep theirs; the plan's checks before any weight loads; and
`model=hf model.path=DIR draft.path=DIR` on the same directory."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.models import TINY_CONFIG, pair, random_prompts, save_byte_tokenizer
from helpers.runs import compose_cfg
from helpers.spec import mtp_training_proposal, tap
from safetensors.torch import save_file

from engine.drafts.multi_layer import MultiLayerEagleHead, multi_layer_config
from engine.drafts.multi_layer.head import ZERO_EMBED_AT_0
from engine.drafts.registry import draft_config, load_head, make_draft, plan_draft
from engine.errors import ConfigError
from engine.model import init_normal_
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator
from pipeline.__main__ import run

MODULES = 2
KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
SHIPPED_MTP = Path(__file__).parents[1] / "engine/drafts/checkpoints/smollm2-135m-instruct-mtp"
MIMO_NAMES = {  # ours (after layers.{i}.) -> MiMo's (after model.mtp_layers.{i}.); the rest: the same name
    "enorm.weight": "token_layernorm.weight",
    "hnorm.weight": "hidden_layernorm.weight",
    "eh_proj.weight": "input_proj.weight",  # MiMo reads cat(hidden, token): the column halves swap
    "shared_head.norm.weight": "final_layernorm.weight",
}


def _public_tensors(head, layout: str, n_layers: int) -> dict[str, torch.Tensor]:
    """The head's modules under `layout`'s public names; DeepSeek-V3's also carry copies of the target's
    embedding (embed_tokens, shared_head.head), which a loader must not read."""
    out = {}
    for name, w in head.state_dict().items():
        _, i, rest = name.split(".", 2)
        if layout == "mimo":
            if rest == "eh_proj.weight":
                h = w.shape[0]
                w = torch.cat([w[:, h:], w[:, :h]], 1)
            out[f"model.mtp_layers.{i}.{MIMO_NAMES.get(rest, rest)}"] = w
        else:
            out[f"model.layers.{n_layers + int(i)}.{rest}"] = w
    if layout == "deepseek":
        emb = head.embed.weight
        for i in range(MODULES):
            out[f"model.layers.{n_layers + i}.embed_tokens.weight"] = emb
            out[f"model.layers.{n_layers + i}.shared_head.head.weight"] = emb
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def _save_target_with_mtp(path, layout: str, modules: int = MODULES):
    """A tiny Qwen2 target (save_pretrained, byte tokenizer) whose directory also carries MTP layers in
    `layout` (config: MiMo's model_type mimo and architectures, num_nextn_predict_layers) in a second
    safetensors file, as shards are. Returns (our target, the head the layers were written from)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf, target = pair(Qwen2ForCausalLM, Qwen2Config(**TINY_CONFIG))
    hf.save_pretrained(path)
    save_byte_tokenizer(path)
    cfg = {**multi_layer_config(target.args, MODULES), "model_type": "qwen2"}  # Qwen2 layers: q/k/v biases
    head = init_normal_(MultiLayerEagleHead(cfg, target.max_seq_len), 7).bind(target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    save_file(_public_tensors(head, layout, 3), str(path / "model-mtp.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    if layout == "mimo":
        cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"])
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": modules}))
    return target, head


def _plan(path, target_args, k=MODULES):
    return plan_draft(draft_config("multi_layer_eagle", init="checkpoint", path=str(path), num_steps=k), target_args)


@pytest.mark.parametrize("layout", ["mimo", "deepseek"])
def test_mtp_layers_of_a_target_checkpoint_load_round_trip_and_draft_losslessly(tmp_path, layout):
    target, written = _save_target_with_mtp(tmp_path / "ckpt", layout)
    head = load_head(_plan(tmp_path / "ckpt", target.args), target, 0, torch.device("cpu"), torch.float32)
    state = head.state_dict()
    assert state.keys() == written.state_dict().keys()
    for name, w in written.state_dict().items():
        assert torch.equal(state[name], w), name
    head.save(tmp_path / "ours")  # our layout (LlamaForCausalLMMultiLayerEagle), then back
    back = load_head(_plan(tmp_path / "ours", target.args), target, 1, torch.device("cpu"), torch.float32)
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["model_type"] == "qwen2" and saved[ZERO_EMBED_AT_0] is True
    assert head.zero_embed_at_0 and back.zero_embed_at_0  # public layers: a zero embedding at position 0
    assert all(torch.equal(back.state_dict()[k], w) for k, w in state.items())

    prompts, params = random_prompts(2, seed=3), SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = [r.tokens for r in Generator(target, 2).generate(prompts, params)]
    plan = _plan(tmp_path / "ckpt", target.args)
    draft = make_draft(plan, head, target, 2, MODULES, cfg=draft_config("multi_layer_eagle", num_steps=MODULES))
    assert [r.tokens for r in Generator(target, 2, draft, MODULES).generate(prompts, params)] == plain


def _rms(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight


def _module_at_position_0(mod, embed, hidden):
    """Module `mod` at position 0 in plain torch from embed [H] and hidden [H] -> (k, v [kv_heads, head_dim],
    out [H]): its one key is its own (softmax over one key is 1; RoPE at position 0 is the identity)."""
    att, mlp = mod.self_attn, mod.mlp
    x = mod.eh_proj(torch.cat([_rms(embed, mod.enorm), _rms(hidden, mod.hnorm)]))  # [H]
    n = _rms(x, mod.input_layernorm)
    k, v = att.k_proj(n).view(att.n_kv, att.head_dim), att.v_proj(n).view(att.n_kv, att.head_dim)
    h = x + att.o_proj(v.repeat_interleave(att.n_heads // att.n_kv, 0).flatten())  # [H]
    m = _rms(h, mod.post_attention_layernorm)
    return k, v, h + mlp.down_proj(F.silu(mlp.gate_proj(m)) * mlp.up_proj(m))


def test_a_public_head_reads_a_zero_embedding_at_position_0_in_every_phase(tmp_path):
    """k = 2 modules over a 1-token prompt (module 1 meets position 0 in propose and extend, not begin) and
    a 6-token one (both modules in begin): every proposal is the training forward's (which zeroes there
    too), greedy output is plain decoding's, and each module's draft K / V at position 0 are those of a
    plain torch forward on a zero embedding (module 1's read module 0's hidden state there), not those of
    the token's embedding."""
    target, _ = _save_target_with_mtp(tmp_path, "mimo")
    plan = _plan(tmp_path, target.args)
    head = load_head(plan, target, 0, torch.device("cpu"), torch.float32)
    prompts, params = [[65], random_prompts(1, seed=5)[0][:6]], SamplingParams(max_new_tokens=10, ignore_eos=True)
    plain = [r.tokens for r in Generator(target, 2).generate(prompts, params)]
    draft = make_draft(plan, head, target, 2, MODULES, cfg=draft_config("multi_layer_eagle", num_steps=MODULES))
    checked = []

    def check(s, k, logits):
        for r in (r for r in range(2) if s.state.value.live[r]):
            drafts = s.draft[r, :k].tolist()
            assert drafts == mtp_training_proposal(target, head, s.state.value.history[r] + drafts[:-1], k)
            checked.append(len(s.state.value.history[r]) - 1)  # L: the history holds x_0..x_L

    tap(draft, "propose", check)
    assert [r.tokens for r in Generator(target, 2, draft, MODULES).generate(prompts, params)] == plain
    assert 1 in checked  # the 1-token prompt's first proposal: module 1's window at position 0

    with torch.no_grad():
        for r, (prompt, out) in enumerate(zip(prompts, plain)):
            seq = torch.tensor([prompt + out])
            feats = target(seq, torch.arange(seq.shape[1])[None], target.new_cache(1), kv_len=seq.shape[1])
            h_in = feats.hidden_states[0, 0]  # the target's final hidden state at position 0
            for i, mod in enumerate(head.layers):
                k, v, h_out = _module_at_position_0(mod, torch.zeros(TINY_CONFIG["hidden_size"]), h_in)
                _, v_tok, _ = _module_at_position_0(mod, head.embed_tokens(seq[0, i + 1]), h_in)  # x_{i+1}'s
                cache = draft.caches[i]  # [layers, batch, kv_heads, slots, head_dim]: slot p holds position p
                torch.testing.assert_close(cache.k[0, r, :, 0], k, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(cache.v[0, r, :, 0], v, rtol=1e-5, atol=1e-5)
                assert not torch.allclose(cache.v[0, r, :, 0], v_tok, atol=1e-3), (r, i)
                h_in = h_out  # module i + 1 reads module i's output at position 0


@pytest.mark.skipif(not KERNELS, reason="the fused kernels need a GPU or TRITON_INTERPRET=1")
def test_the_fused_input_zeroes_position_0_as_the_plain_input_does(tmp_path):
    """The fused input (embedding gather, both norms and eh_proj in one kernel, zero1 from the positions)
    equals the plain one on rows at position 0 and past it; at position 0 it is not the unzeroed input."""
    target, _ = _save_target_with_mtp(tmp_path, "deepseek")
    head = load_head(_plan(tmp_path, target.args), target, 0, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 320, (2, 5), generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])  # a prompt's start; a later window
    mod = head.layers[1]
    with torch.no_grad():
        plain = mod.fused_in(ids, hidden, positions)  # [2, 5, 64]
        unzeroed = mod.fuse_input(head.embed_tokens(ids), hidden)
        mod.fused_in.fuse()
        fused = mod.fused_in(ids, hidden, positions)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain[1], unzeroed[1], rtol=0, atol=0)
    torch.testing.assert_close(plain[0, 1:], unzeroed[0, 1:], rtol=0, atol=0)
    assert not torch.allclose(fused[0, 0], unzeroed[0, 0], atol=1e-3)


def test_our_own_mtp_heads_keep_the_embedding_at_position_0(tmp_path):
    """The shipped head's config and a head of ours (random init, saved and loaded back) carry no zeroing:
    its input at position 0 is eh_proj of the token's embedding, as it was trained."""
    assert ZERO_EMBED_AT_0 not in json.loads((SHIPPED_MTP / "config.json").read_text())
    target = pair()[1]
    cfg = draft_config("multi_layer_eagle", init="random", num_steps=MODULES)
    head = load_head(plan_draft(cfg, target.args), target, 0, torch.device("cpu"), torch.float32)
    head.save(tmp_path)
    back = load_head(_plan(tmp_path, target.args), target, 0, torch.device("cpu"), torch.float32)
    assert not head.zero_embed_at_0 and not back.zero_embed_at_0
    ids, hidden = torch.tensor([[5, 6, 7]]), torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = back.layers[0].fused_in(ids, hidden, torch.arange(3)[None])
        want = back.layers[0].fuse_input(back.embed_tokens(ids), hidden)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _with_config(path, **kw):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **kw}))


@pytest.mark.parametrize(
    "change, key, needle",
    [
        (lambda p, a: (_with_config(p, num_nextn_predict_layers=3), a), "draft.path", "hold modules [0, 1]"),
        (lambda p, a: (p, a), "draft.num_steps", "the checkpoint has 2 modules"),
        (lambda p, a: (p, dataclasses.replace(a, hidden_size=32)), "draft.path", "hidden_size 64 differs"),
        (lambda p, a: (p, dataclasses.replace(a, vocab_size=400)), "draft.path", "vocab_size 320 differs"),
        (lambda p, a: (_with_config(p, model_type="deepseek_v3"), a), "draft.path", "'deepseek_v3' decoder layers"),
        (lambda p, a: ((p / "model-mtp.safetensors").unlink(), a), "draft.path", "layouts []"),
    ],
    ids=["module-count", "num-steps", "width", "vocabulary", "layer-kind", "no-mtp-tensors"],
)
def test_the_plan_checks_a_targets_mtp_layers_before_any_weight_loads(tmp_path, change, key, needle):
    """Each mismatch is one error naming the key, read from config.json and the safetensors headers."""
    target, _ = _save_target_with_mtp(tmp_path, "mimo")
    _, args = change(tmp_path, target.args)
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, args, k=3 if key == "draft.num_steps" else MODULES)
    assert e.value.key == key and needle in str(e.value), str(e.value)


def test_a_mimo_directory_is_the_target_and_its_own_draft(tmp_path, outputs):
    """model=hf and draft.path on one MiMo-layout directory: the target loads its layers (skipping the MTP
    ones), the head its MTP layers, and greedy output is the target's."""
    _save_target_with_mtp(tmp_path, "mimo")
    ctx = run(
        compose_cfg(
            "model=hf",
            f"model.path={tmp_path}",
            "model.max_seq_len=640",
            "dtype=float32",
            "+experiment=mtp",
            f"draft.path={tmp_path}",
            f"draft.num_steps={MODULES}",
            "graph=debug",
            "eval.limit=2",
            "eval.max_new_tokens=16",
            "tracking=off",
        )
    )
    assert ctx["eval_results"]["metrics"]["match_baseline"] == 1.0


def test_a_target_without_declared_mtp_layers_refuses_extra_layer_tensors(tmp_path, outputs):
    """The target skips layers past num_hidden_layers only when config.json declares MTP layers: otherwise
    they are tensors it does not know, and the load names them."""
    from engine.loading import load_model
    from pipeline.config import to_run_config

    _save_target_with_mtp(tmp_path, "deepseek")
    cfg = to_run_config(compose_cfg("model=hf", f"model.path={tmp_path}", "model.max_seq_len=64", "device=cpu")).model
    load_model(cfg, outputs / "weights", torch.device("cpu"), torch.float32)  # declared: skipped
    _with_config(tmp_path, num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match=r"unexpected \['model\.layers\.3\."):
        load_model(cfg, outputs / "weights", torch.device("cpu"), torch.float32)
