"""MTP layers shipped inside a target's checkpoint (MiMo's model.mtp_layers.{i}.*, DeepSeek-V3's
model.layers.{N + i}.*) read as the multi-layer head's modules: a tiny Qwen2 target saved with two MTP
layers written under the public names and shapes (the names below are written out here, not taken from
engine/drafts/multi_layer/public.py), loaded with the same weights as the head they were written from,
saved in our layout and loaded back, drafting losslessly; the plan's checks before any weight loads; and
`model=hf model.path=DIR draft.path=DIR` on the same directory."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.models import TINY_CONFIG, pair, random_prompts, save_byte_tokenizer
from helpers.runs import compose_cfg
from safetensors.torch import save_file

from engine.drafts.multi_layer import MultiLayerEagleHead, multi_layer_config
from engine.drafts.registry import draft_config, load_head, make_draft, plan_draft
from engine.errors import ConfigError
from engine.model import init_normal_
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator
from pipeline.__main__ import run

MODULES = 2
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
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "qwen2"
    assert all(torch.equal(back.state_dict()[k], w) for k, w in state.items())

    prompts, params = random_prompts(2, seed=3), SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = [r.tokens for r in Generator(target, 2).generate(prompts, params)]
    plan = _plan(tmp_path / "ckpt", target.args)
    draft = make_draft(plan, head, target, 2, MODULES, cfg=draft_config("multi_layer_eagle", num_steps=MODULES))
    assert [r.tokens for r in Generator(target, 2, draft, MODULES).generate(prompts, params)] == plain


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
