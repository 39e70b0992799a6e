"""A Qwen3 target (per-head q/k RMSNorm before RoPE, head_dim from config, tied embeddings) against
transformers' Qwen3ForCausalLM with the same random weights (fp32, CPU): logits, aux hidden states in both
conventions, greedy generation; the fused path (Triton interpreter) against the plain one. Then the public
heads of a Qwen3 target, from synthetic checkpoints with the public tensor names and config keys: an
EAGLE3 head (LlamaForCausalLMEagle3) and z-lab's DFlash drafter (Qwen3 layers with q/k norms)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.models import hf_greedy, qwen3_pair, random_prompts
from helpers.runs import compose_cfg, metric_history
from helpers.train import DFLASH_TRAIN, EAGLE3_TRAIN
from mlflow.tracking import MlflowClient
from safetensors import safe_open
from safetensors.torch import save_file

from engine.aux_layers import normalise
from engine.drafts.registry import draft_config, load_head, make_draft, plan_draft
from engine.errors import ConfigError
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator
from pipeline.__main__ import run
from pipeline.tracking import default_tracking_uri

FUSED = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the fused path's: CPU under the interpreter


def _forward(model, ids: torch.Tensor):
    b, t = ids.shape
    return model(ids, torch.arange(t, device=ids.device).expand(b, t), model.new_cache(b), kv_len=t)


def test_logits_match_transformers_and_the_qk_norms_matter():
    hf, ours = qwen3_pair()
    assert ours.args.qk_norm and ours.args.head_dim == 32 and not ours.args.qkv_bias
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = _forward(ours, ids).logits
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
        for layer in ours.model.layers:  # unit q/k norm weights: the logits move (the norms are applied)
            layer.self_attn.q_norm.weight.fill_(1.0)
        assert (_forward(ours, ids).logits - ref).abs().max() > 1e-2


@pytest.mark.parametrize("convention, ids", [("input_of", [0, 2, 3]), ("output_of", [0, 1, 2])])
def test_aux_hidden_states_match_transformers_in_both_conventions(convention, ids):
    """input_of i: the stream entering layer i (3: the last layer's output, whose final norm is transformers'
    last hidden state); output_of i: layer i's output, transformers' hidden_states[i + 1]."""
    hf, ours = qwen3_pair()
    n = ours.args.num_layers
    ours.set_aux_layers(normalise(ids, convention, n))
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = _forward(ours, tokens)
        want = hf(tokens, output_hidden_states=True).hidden_states  # embeddings, each layer's output (last normed)
    for got, i in zip(out.aux_hidden_states.chunk(len(ids), dim=-1), ids):
        j = i if convention == "input_of" else i + 1  # index into transformers' hidden_states
        if j < n:
            torch.testing.assert_close(got, want[j], rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(ours.model.norm(got), want[j], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden_states, want[-1], rtol=1e-5, atol=1e-5)


def test_greedy_equals_transformers_generate():
    hf, ours = qwen3_pair()
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    for prompt in random_prompts(2):
        got = Generator(ours, 1).generate([prompt], params)[0].tokens
        ref = hf_greedy(hf, prompt, 16)
        assert len(set(got)) > 3  # a varied sequence, not one token repeated
        assert got == ref


@pytest.mark.skipif(not FUSED, reason="needs CUDA or TRITON_INTERPRET=1")
def test_fused_path_equals_plain_and_a_decode_row_is_batch_invariant():
    """The fused path (q/k norms inside the RoPE + cache-write kernel, the rows kernels, the Triton
    attention): the plain path's logits and aux states; a decode row's logits bitwise the same alone and
    beside other rows."""
    target = qwen3_pair(max_seq_len=64)[1].to(DEVICE)
    target.init_buffers(DEVICE)
    target.set_aux_layers([1, 3])
    ids = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        ref = _forward(target, ids)
        target.attention_kernel = True
        target.use_fused_kernels()
        got = _forward(target, ids)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got.aux_hidden_states, ref.aux_hidden_states, rtol=1e-5, atol=1e-4)

        def decode(rows: slice) -> torch.Tensor:  # a 6-token prefill, then one decode step of these rows
            b = rows.stop - rows.start
            cache = target.new_cache(b)
            target(ids[rows, :6], torch.arange(6, device=DEVICE).expand(b, 6), cache, kv_len=6)
            return target(ids[rows, 6:], torch.full((b, 1), 6, device=DEVICE), cache, kv_len=7).logits  # [b, 1, V]

        assert torch.equal(decode(slice(0, 3))[1], decode(slice(1, 2))[0])


# ------------------------------------------------------------------------------- public heads, Qwen3 target
def qwen3_shape(**kw) -> dict:
    """The config.json keys the public heads of a Qwen3 target share: the tiny Qwen3's shape (head_dim 32, not
    hidden / heads), its rope_theta and eps, and its vocabulary."""
    base = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 512,
        "vocab_size": 320,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
    }
    return {**base, **kw}


def write_checkpoint(path: Path, config: dict, shapes: dict[str, tuple], seed: int = 0) -> dict[str, torch.Tensor]:
    """A synthetic checkpoint: config.json and model.safetensors with these public tensor names and shapes
    (norm weights around 1, the rest N(0, 0.1); int64 / bool tensors passed in as they are)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        if isinstance(shape, torch.Tensor):
            state[name] = shape
        else:
            x = torch.randn(shape, generator=g)
            state[name] = 1 + 0.3 * x if name.endswith("norm.weight") else 0.1 * x
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return state


def layer_shapes(prefix: str, d_in: int, qk_norm: bool) -> dict[str, tuple]:
    """One decoder layer's tensors (`prefix` ends with '.') of the tiny Qwen3 shape: q/k/v from d_in inputs."""
    shapes = {
        f"{prefix}input_layernorm.weight": (64,),
        f"{prefix}post_attention_layernorm.weight": (64,),
        f"{prefix}self_attn.q_proj.weight": (128, d_in),
        f"{prefix}self_attn.k_proj.weight": (64, d_in),
        f"{prefix}self_attn.v_proj.weight": (64, d_in),
        f"{prefix}self_attn.o_proj.weight": (64, 128),
        f"{prefix}mlp.gate_proj.weight": (96, 64),
        f"{prefix}mlp.up_proj.weight": (96, 64),
        f"{prefix}mlp.down_proj.weight": (64, 96),
    }
    if qk_norm:
        shapes |= {f"{prefix}self_attn.q_norm.weight": (32,), f"{prefix}self_attn.k_norm.weight": (32,)}
    return shapes


def eagle3_checkpoint(path: Path, aux_output_of=None, **kw) -> dict[str, torch.Tensor]:
    """An EAGLE3 head for a Qwen3 target as the public ones are laid out: LlamaForCausalLMEagle3, model_type
    llama (no q/k norms), head_dim given, a 96-token draft vocabulary with d2t / t2d; without
    eagle_config (aux_output_of None) and target_hidden_size, as several public Qwen3 heads ship."""
    config = qwen3_shape(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1, draft_vocab_size=96, **kw
    )
    if aux_output_of is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_output_of)}
    ids = torch.randperm(320, generator=torch.Generator().manual_seed(7))[:96].sort().values  # target ids drafted
    t2d = torch.zeros(320, dtype=torch.bool)
    t2d[ids] = True
    shapes = {
        "fc.weight": (64, 3 * 64),
        "midlayer.hidden_norm.weight": (64,),
        **layer_shapes("midlayer.", 2 * 64, qk_norm=False),
        "norm.weight": (64,),
        "lm_head.weight": (96, 64),
        "d2t": ids - torch.arange(96),
        "t2d": t2d,
    }
    return write_checkpoint(path, config, shapes)


def dflash_checkpoint(path: Path, qk_norm: bool = True, target_layer_ids=(0, 2), **kw) -> dict[str, torch.Tensor]:
    """z-lab's DFlash drafter for a Qwen3 target: DFlashDraftModel, model_type qwen3, two Qwen3 layers with
    q/k norms, dflash_config.{target_layer_ids, mask_token_id}, block_size at the top level."""
    config = qwen3_shape(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        num_hidden_layers=2,
        num_target_layers=3,
        block_size=4,
        dflash_config={"mask_token_id": 300, "target_layer_ids": list(target_layer_ids)},
        layer_types=["full_attention"] * 2,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
        **kw,
    )
    shapes = {
        "fc.weight": (64, len(target_layer_ids) * 64),
        "hidden_norm.weight": (64,),
        **{k: v for i in range(2) for k, v in layer_shapes(f"layers.{i}.", 64, qk_norm).items()},
        "norm.weight": (64,),
    }
    return write_checkpoint(path, config, shapes)


def round_trips(head, state: dict[str, torch.Tensor], path: Path, out: Path) -> None:
    """The loaded head holds every public tensor as written; saved again, the same names, shapes and values,
    and config.json keeps the keys it was read with (DFlash's window keys only where it has a window)."""
    mine = head.state_dict()
    assert set(mine) == set(state)
    for k, v in state.items():
        assert torch.equal(mine[k].cpu().to(v.dtype), v), k
    head.save(out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(state)
        for k in state:
            assert torch.equal(f.get_tensor(k).to(state[k].dtype), state[k]), k
    before, after = json.loads((path / "config.json").read_text()), json.loads((out / "config.json").read_text())
    kept = set(before) - {"layer_types", "sliding_window", "is_causal"}  # a window's keys: only where there is one
    assert {k: after[k] for k in kept if k != "dflash_config"} == {k: before[k] for k in kept if k != "dflash_config"}
    assert before.get("dflash_config", {}).items() <= after.get("dflash_config", {}).items()


def drafts_losslessly(target, plan, head, k: int = 3) -> None:
    target.set_aux_layers(plan.aux.input_of)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = random_prompts(2)
    spec = Generator(target, 2, make_draft(plan, head, target, 2, k), k).generate(prompts, params)
    assert [r.tokens for r in spec] == [r.tokens for r in Generator(target, 2).generate(prompts, params)]


@pytest.mark.parametrize("aux_output_of, input_of", [((0, 1, 2), (1, 2, 3)), (None, (2, 1, 0))])
def test_eagle3_head_in_the_public_layout_round_trips_on_a_qwen3_target(tmp_path, aux_output_of, input_of):
    """Public names and keys in; the plan takes the aux ids from eagle_config (output_of) or, without one,
    EAGLE3's default; the head loads every tensor, saves the same ones, and drafts losslessly."""
    _, target = qwen3_pair()
    state = eagle3_checkpoint(tmp_path / "in", aux_output_of)
    plan = plan_draft(draft_config("eagle3", init="checkpoint", path=str(tmp_path / "in")), target.args)
    assert plan.aux.input_of == input_of
    head = load_head(plan, target, 0, torch.device("cpu"), torch.float32)
    assert head.midlayer.self_attn.q_norm is None and head.args.head_dim == 32  # Llama's layer, Qwen3's head_dim
    round_trips(head, state, tmp_path / "in", tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in input_of]
    drafts_losslessly(target, plan, head)


def test_dflash_drafter_in_z_labs_qwen3_layout_round_trips_and_its_qk_norms_count(tmp_path):
    """z-lab's layout in: Qwen3 layers with q/k norms; target_layer_ids [0, 2] (output_of) -> input_of [1, 3];
    block and mask token from the checkpoint. The drafter loads every tensor, saves the same ones, drafts
    losslessly, proposes the same on the fused path, and its q/k norms change its proposals (they are applied)."""
    target = qwen3_pair()[1].to(DEVICE)  # on the GPU where there is one: its fused path runs there
    target.init_buffers(DEVICE)
    state = dflash_checkpoint(tmp_path / "in")
    ckpt = dict(init="checkpoint", path=str(tmp_path / "in"), num_steps=3)
    plan = plan_draft(draft_config("dflash", **ckpt), target.args)
    assert plan.aux.input_of == (1, 3) and plan.head_config["block_size"] == 4
    assert plan.head_config["mask_token_id"] == 300
    head = load_head(plan, target, 0, DEVICE, torch.float32)
    assert head.args.qk_norm and head.layers[1].self_attn.k_norm.weight.shape == (32,)
    round_trips(head, state, tmp_path / "in", tmp_path / "out")
    drafts_losslessly(target, plan, head)

    target.set_aux_layers(plan.aux.input_of)
    tokens = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    pos = torch.arange(10, device=DEVICE)[None]  # the prompt's 6 positions, then the block's 4

    def proposal(h):  # the context of a 6-token prompt, then one block: logits [1, 3, vocab]
        feats = target(tokens, pos[:, :6], target.new_cache(1), kv_len=6).aux_hidden_states
        cache = h.new_cache(1)
        h.write_context(feats, cache, h.attn_inputs(pos[:, :6], None, 6))
        block = torch.tensor([[5, 300, 300, 300]], device=DEVICE)
        return h(block, cache, h.block_inputs(pos[:, 6:], None, 6, torch.float32), 3, True).logits

    with torch.no_grad():
        ref = proposal(head)
        if FUSED:  # the fused path: q/k norms inside the RoPE + cache-write kernel, the context's k-only write too
            fused = head.copy()
            fused.use_fused_kernels()
            torch.testing.assert_close(proposal(fused), ref, rtol=1e-5, atol=1e-4)
        for layer in head.layers:
            layer.self_attn.k_norm.weight.fill_(1.0)
        assert (proposal(head) - ref).abs().max() > 1e-3


@pytest.mark.parametrize(
    "make, overrides, key, needle",
    [
        (dflash_checkpoint, {"qk_norm": False}, "draft.path", "missing layers.0.self_attn.k_norm.weight [32]"),
        (dflash_checkpoint, {"target_layer_ids": (0, 3)}, "draft checkpoint dflash_config.target_layer_ids", "[0, 2]"),
        (dflash_checkpoint, {"vocab_size": 400}, "draft.path", "vocab_size 400 differs from the target's 320"),
        (eagle3_checkpoint, {"target_hidden_size": 128}, "draft.path", "target_hidden_size 128 differs"),
    ],
    ids=["qwen3-layers-without-qk-norms", "aux-ids-past-the-target", "vocabulary", "target-width"],
)
def test_plan_checks_a_qwen3_heads_ids_widths_vocabulary_and_tensors_before_loading(
    tmp_path, make, overrides, key, needle
):
    """Each mismatch with the Qwen3 target is one error naming the key, from config.json and the safetensors
    header alone (no weight is read)."""
    _, target = qwen3_pair()
    make(tmp_path, **overrides)
    algorithm = "dflash" if make is dflash_checkpoint else "eagle3"
    with pytest.raises(ConfigError) as e:
        plan_draft(draft_config(algorithm, init="checkpoint", path=str(tmp_path), num_steps=3), target.args)
    assert e.value.key == key and needle in str(e.value), str(e.value)


# ------------------------------------------------------------------------------- training on a Qwen3 target
@pytest.mark.parametrize("recipe, overrides", [("eagle3", EAGLE3_TRAIN), ("dflash", DFLASH_TRAIN)])
def test_a_tiny_qwen3_target_trains_a_head_through_the_real_loop(outputs, recipe, overrides):
    """model.random.model_type=qwen3: the draft recipes self-distil from a Qwen3 target, train, evaluate in
    the real draft-and-verify loop and export; the held-out loss falls. The EAGLE3 head keeps the public
    Llama layer; the DFlash drafter is z-lab's Qwen3 layout, its q/k norms trained."""
    steps = ["train.steps=20", "train.eval_every=20", "train.save_every=20"]
    ctx = run(compose_cfg(*overrides, "model.random.model_type=qwen3", *steps))
    head_dir = Path(ctx["draft_checkpoint"])
    cfg = json.loads((head_dir / "config.json").read_text())
    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:
        norms = {k: f.get_tensor(k) for k in f.keys() if k.endswith(("q_norm.weight", "k_norm.weight"))}
    if recipe == "dflash":
        assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
        assert len(norms) == 2 * cfg["num_hidden_layers"] and any((w != 1).any() for w in norms.values())
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama" and not norms
    client = MlflowClient(default_tracking_uri(outputs))
    (r,) = client.search_runs([client.get_experiment_by_name(f"train_{recipe}_smollm2").experiment_id])
    assert r.info.status == "FINISHED"
    val = metric_history(client, r.info.run_id, "val_loss")
    assert val[0][0] == 0 and val[-1][0] == 20 and val[-1][1] < val[0][1]
    (loop,) = [v for k, v in r.data.metrics.items() if k.startswith("heldout_loop_accept_length_k")]
    assert 1.0 <= loop <= 6.0  # the real draft-and-verify loop on held-out prompts (k = draft.num_steps)
