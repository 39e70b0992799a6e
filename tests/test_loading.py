"""Weight sources: HF safetensors directories and the real SmolLM2 GGUF, end to end."""

from __future__ import annotations

import pytest
import torch
from helpers.models import spread_init, tiny_hf_config, tiny_qwen3_config
from helpers.runs import compose_cfg

from engine.loading import describe_model, load_model, publish
from pipeline.__main__ import run
from pipeline.config import to_run_config


def test_hf_directory_without_tokenizer_is_rejected_at_plan_time(tmp_path, outputs):
    from transformers import LlamaForCausalLM

    from pipeline.plan import PlanError, build_plan

    spread_init(LlamaForCausalLM(tiny_hf_config(tie_word_embeddings=False))).save_pretrained(tmp_path)
    cfg = to_run_config(compose_cfg("model=hf", f"model.path={tmp_path}", "model.max_seq_len=64", "device=cpu"))
    with pytest.raises(PlanError, match="no tokenizer in it"):
        build_plan(cfg, outputs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hf_directory_with_tokenizer(tmp_path, outputs, arch):
    """A full HF directory: weights, config and a tokenizer; logits equal transformers'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3ForCausalLM

    if arch == "qwen3":  # q/k norms (spread, so that dropping one shows), head_dim 32 from config.json
        hf = spread_init(Qwen3ForCausalLM(tiny_qwen3_config()), norms=0.3).eval()
    else:
        hf = spread_init(LlamaForCausalLM(tiny_hf_config())).eval()
    hf.save_pretrained(tmp_path)
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"<unk>": 26, "</s>": 257}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path)

    cfg = to_run_config(compose_cfg("model=hf", f"model.path={tmp_path}", "model.max_seq_len=64")).model
    args = describe_model(cfg, outputs / "weights")
    assert (args.num_layers, args.hidden_size, args.tie_word_embeddings) == (3, 64, True)
    assert (args.qk_norm, args.head_dim) == ((True, 32) if arch == "qwen3" else (False, 16))
    loaded = load_model(cfg, outputs / "weights", torch.device("cpu"), torch.float32)
    assert loaded.hf_dir == str(tmp_path) and 257 in loaded.tokenizer.eos_token_ids
    ids = torch.tensor([loaded.tokenizer.encode("hello")])
    with torch.no_grad():
        ours = loaded.model(ids, torch.arange(ids.shape[1])[None], loaded.model.new_cache(1)).logits
        assert (ours - hf(ids).logits).abs().max() < 1e-4


def test_a_sliding_window_qwen3_is_refused_at_plan_time(tmp_path):
    """Qwen3's windowed layers (use_sliding_window from max_window_layers on) would change what a layer
    attends: refused before any weight loads, not ignored."""
    from transformers import Qwen3ForCausalLM

    from engine.errors import ConfigError

    hf_cfg = tiny_qwen3_config(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    Qwen3ForCausalLM(hf_cfg).save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    cfg = to_run_config(compose_cfg("model=hf", f"model.path={tmp_path}")).model
    with pytest.raises(ConfigError, match="sliding-window layers"):
        describe_model(cfg, tmp_path / "weights")


@pytest.mark.slow
def test_smollm2_main_job_end_to_end(outputs):
    """The default job on the real SmolLM2-135M-Instruct GGUF, two HumanEval prompts, a few tokens."""
    ctx = run(
        compose_cfg(
            "+experiment=baseline", "eval.limit=2", "eval.max_new_tokens=12", "device=cpu", "eval.peers=[hf_generate]"
        )
    )
    records = ctx["eval_results"]["records"]
    assert len(records) == 2 and all(len(r.result.tokens) > 0 and r.text.strip() for r in records)
    # Our engine and transformers generate, same dequantized weights, greedy fp32: token for token.
    assert ctx["eval_results"]["metrics"]["peer_match.hf_generate"] == 1.0
    # The converted checkpoint is cached: describing the model now reads its config.json.
    cached = list((outputs / "weights").glob("SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))
    assert len(cached) == 1
    args = describe_model(to_run_config(compose_cfg()).model, outputs / "weights")
    assert (args.num_layers, args.hidden_size, args.num_kv_heads, args.rope_theta) == (30, 576, 3, 100000.0)


@pytest.mark.slow
def test_the_converted_smollm2_tokenizer_loads_directly_as_autotokenizer_would(outputs):
    """The GGUF conversion saves the tokenizers library's generic backend: `HFTokenizer.from_dir` loads it
    without AutoTokenizer's model-config imports, and it encodes, decodes, applies the chat template and
    names the stop tokens exactly as the tokenizer AutoTokenizer loads from the same directory."""
    from transformers import AutoTokenizer

    from engine.loading import convert_gguf, packaged_smollm2_gguf
    from engine.tokenizer import GENERIC_TOKENIZERS, HFTokenizer

    path = str(convert_gguf(packaged_smollm2_gguf(), outputs / "weights"))
    fast, auto = HFTokenizer.from_dir(path, (7,)), HFTokenizer(AutoTokenizer.from_pretrained(path), (7,))
    assert type(fast.tok).__name__ in GENERIC_TOKENIZERS and fast.eos_token_ids == auto.eos_token_ids
    texts = ["Hello world", " leading space", "Ünïcödé 你好 🙂", "a\n\nb  c", "def f(x):\n    return x"]
    for text in texts:
        ids = fast.encode(text)
        assert ids == auto.encode(text) and fast.decode(ids) == auto.decode(ids)
        assert fast.encode_chat(text, "Be brief.") == auto.encode_chat(text, "Be brief.")
    assert fast.user_turn() == auto.user_turn() and fast.user_turn("Ask about math.") == auto.user_turn(
        "Ask about math."
    )


@pytest.mark.slow
def test_a_first_gguf_load_parses_the_file_once(tmp_path, monkeypatch):
    """The plan's description and tokenizer and the conversion read one parse of the GGUF (transformers
    parses it afresh for each of config, tensors and tokenizer); gguf-py is left as it was, and the
    converted directory describes the same model as the file."""
    import gguf

    from engine.loading import convert_gguf, load_tokenizer, packaged_smollm2_gguf

    parses = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parses.append(path)
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    cfg = to_run_config(compose_cfg()).model
    args = describe_model(cfg, tmp_path)
    tok = load_tokenizer(cfg, tmp_path, args)
    out = convert_gguf(packaged_smollm2_gguf(), tmp_path)
    assert len(parses) == 1 and gguf.GGUFReader is Counting
    assert describe_model(cfg, tmp_path) == args  # now read from the converted config.json
    assert load_tokenizer(cfg, tmp_path, args).encode("Hello world") == tok.encode("Hello world")
    assert (out / "model.safetensors").stat().st_size > 500e6  # 134.5M parameters in float32


def test_a_conversion_that_lost_the_race_keeps_the_winner(tmp_path):
    """Two runs converting the GGUF at once: the first rename publishes its directory; the second finds
    a complete one in place and keeps it. A failed rename onto an incomplete directory still raises."""
    out = tmp_path / "model"
    first, second = tmp_path / ".first", tmp_path / ".second"
    for d, text in ((first, "first"), (second, "second")):
        d.mkdir()
        (d / "config.json").write_text(text)
        (d / "model.safetensors").write_text(text)
    publish(first, out)
    assert not first.exists() and (out / "config.json").read_text() == "first"
    publish(second, out)  # os.replace refuses a non-empty target: the winner stays
    assert (out / "config.json").read_text() == "first" and (out / "model.safetensors").read_text() == "first"
    (out / "config.json").unlink()  # not a complete conversion: the error is real
    with pytest.raises(OSError):
        publish(second, out)


def test_random_weights_drawn_on_the_run_device_are_the_cpu_draw_on_a_cpu(outputs):
    """init_on=device builds on meta and draws in place; on a CPU run that is the same draw as init_on=cpu."""
    weights = {}
    for where in ("cpu", "device"):
        cfg = to_run_config(compose_cfg("model=tiny", f"model.random.init_on={where}", "device=cpu")).model
        model = load_model(cfg, outputs / "weights", torch.device("cpu"), torch.float32).model
        weights[where] = model.state_dict()
    assert weights["cpu"].keys() == weights["device"].keys()
    for name, w in weights["cpu"].items():
        assert torch.equal(w, weights["device"][name]), name


def test_a_random_target_takes_any_supported_architecture(outputs):
    cfg = to_run_config(compose_cfg("model=tiny", "model.random.model_type=qwen2", "model.random.head_dim=32")).model
    args = describe_model(cfg, outputs / "weights")
    assert args.qkv_bias and args.head_dim == 32 and args.num_heads == 4  # Qwen2's q/k/v biases; a set head_dim
    bad = to_run_config(compose_cfg("model=tiny", "model.random.model_type=gpt2")).model
    with pytest.raises(Exception, match="model.random.model_type"):
        describe_model(bad, outputs / "weights")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_launch_rule_sizes_a_layer_by_its_largest_fused_weight(arch):
    """model.pdl's default reads a layer's largest projection from the config: it is the largest weight
    the fused layer holds (q/k/v, o, gate/up, down); off the GPU nothing launches dependently."""
    from helpers.models import pair, qwen3_pair

    from engine.loading import largest_projection, resolve_pdl
    from kernels.runtime import pdl

    _, target = pair() if arch == "llama" else qwen3_pair()
    target.use_fused_kernels()
    layer = target.model.layers[0]
    held = (layer.qkv_weight, layer.self_attn.o_proj.weight, layer.gate_up_weight, layer.mlp.down_proj.weight)
    assert largest_projection(target.args) == max(w.numel() for w in held)
    cfg = to_run_config(compose_cfg("model=tiny", "device=cpu")).model
    assert not resolve_pdl(cfg, torch.device("cpu"), target.args, torch.float32)
    assert not pdl(torch.device("cpu"))
