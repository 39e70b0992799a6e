"""Stage `train_draft`: self-distil data from the target, then train the draft head with training-time test.

    plan:   load -> configure_aux_capture -> train_draft          (task=train_draft)
    output: <outputs>/train/data/<key>/  samples.jsonl + meta.json + stats.json, keyed by a hash of the
                                         target and the data settings: every draft trained on the same
                                         target and settings reuses one synthesis
            <outputs>/train/<train.name>/
                checkpoint/  the head in float32 + trainer_state.pt (resume)
                head/        the exported head: config.json, model.safetensors (train.save_dtype), README.md

1. Data (engine/train/selfdistill.py): the target writes user messages (Magpie) and answers them,
   batched on the run's device, under CUDA graphs when `train.data.graph=full`. Never an eval set.
2. Draft vocabulary: the `draft.draft_vocab_size` most frequent target tokens of the training split
   (d2t/t2d), EOS always in; none with `draft.lm_head=target` (the target's lm_head, every token).
3. Training (engine/train/trainer.py): a float32 copy of the loaded head; with `draft.init=random` and
   `train.init_from_target`, its lm_head rows and final norm start as the target's (the head then starts
   from the target's own output layer, restricted to the draft vocabulary).
4. Export in the public EAGLE3 format, with a model card; MLflow gets the curves, the held-out per-position
   acceptance, and the exported head as artifacts. Provides `draft_checkpoint` (the export's path).

Under torchrun (engine/train/distributed.py) every rank synthesises its share of the data (a shard under
the data folder, joined by rank 0 after a barrier; the cache key does not depend on the ranks, like the
graph policy it names how the data was made, not what was asked for) and trains on its part of each batch;
rank 0 alone prints, logs, evaluates and exports.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from engine.drafts.registry import train_spec
from engine.errors import ConfigError, check_values, raise_all, raised
from engine.graphs.backends import NEEDS_CUDA
from engine.graphs.runner import default_sizes
from engine.speculative.graph_set import GraphSet
from engine.train import distributed
from engine.train.data import DEGENERATE_SHARE, VocabMap, load_samples, save_samples, split, synth_seconds, top_token
from engine.train.selfdistill import Sample, cut_share, synthesize
from engine.train.trainer import Trainer, TrainSettings
from kernels.runtime import triton
from kernels.soft_ce import SOFT_CE_KERNELS
from pipeline.paths import REPO
from stages.base import Stage, StageEnv, device_name, register_stage

DATA_GRAPHS = ("auto", "none", "full", "debug")
TRAIN_ATTENTION = ("auto", "eager", "flex")
TRAIN_KERNELS = ("auto", *SOFT_CE_KERNELS)


def flex_trains(algorithm: str, device: torch.device) -> bool:
    """FlexAttention can run this draft's training forward here (its fused backward is CUDA only)."""
    return train_spec(algorithm).flex and device.type == "cuda"


def train_attention(cfg, device: torch.device) -> str:
    a = cfg.train.attention
    if a == "auto":
        return "flex" if flex_trains(cfg.draft.algorithm, device) else "eager"
    return a


def train_kernels(cfg, device: torch.device) -> str:
    """train.kernels with auto resolved: the training step's fused Triton kernels on CUDA, else torch."""
    k = cfg.train.kernels
    if k == "auto":
        return "triton" if device.type == "cuda" and triton is not None else "torch"
    return k


def data_graph(cfg, env: StageEnv) -> str:
    g = cfg.train.data.graph
    return ("full" if env.device.type == "cuda" else "none") if g == "auto" else g


def generation_graphs(model, batch_size: int, policy: str) -> Optional[GraphSet]:
    """The self-distillation's decode graphs (`policy` of `data_graph`; none: eager) over `batch_size` rows."""
    if policy == "none":
        return None
    return GraphSet(
        model, None, batch_size, 0, policy, "none", default_sizes(batch_size), [], False, sampled=True
    ).capture()


def synthesize_data(
    loaded, d, graphs=None, phase_s: Optional[dict[str, float]] = None, shard: tuple[int, int] = (0, 1)
) -> list[Sample]:
    """`synthesize` with the settings of a `train.data` config (TrainDataConfig); a script passes a
    `dataclasses.replace` of the recipe's. `shard` (rank, ranks): that rank's share of the samples."""
    return synthesize(
        loaded,
        distributed.share(d.num_samples, *shard),
        d.batch_size,
        d.max_prompt_tokens,
        d.max_answer_tokens,
        d.prompt_temperature,
        d.prompt_top_p,
        seed=d.seed,
        min_prompt_chars=d.min_prompt_chars,
        graphs=graphs,
        sync_every=d.sync_every,
        system_prompts=list(d.system_prompts),
        drop_cut=d.drop_cut_prompts,
        phase_s=phase_s,
        shard=shard,
    )


def train_dir(cfg, env: StageEnv) -> Path:
    return env.outputs_dir / "train" / (cfg.train.name or cfg.experiment_name)


def _at_least(key: str, value, minimum: int = 1) -> tuple:
    """A check_values row: `value` is set and >= minimum."""
    return key, value, value is not None and value >= minimum, f">= {minimum}", "too small"


@register_stage
class TrainDraftStage(Stage):
    name = "train_draft"
    requires = ("target", "draft_head")
    provides = ("draft_checkpoint",)
    final = True
    runs_target = True

    def check(self, cfg, env: StageEnv) -> None:
        """Every bad value at once (the draft's own training checks among them)."""
        t, d = cfg.train, cfg.draft
        errors = raised(self._check_draft, cfg, env)
        errors += raised(
            check_values,
            [
                _at_least(f"train.{key}", getattr(t, key), 0 if key == "warmup_steps" else 1)
                for key in (
                    "steps",
                    "warmup_steps",
                    "ttt_steps",
                    "max_tokens",
                    "max_len",
                    "eval_every",
                    "save_every",
                    "eval_k",
                )
            ]
            + [
                _at_least(f"train.data.{key}", getattr(t.data, key))
                for key in ("num_samples", "batch_size", "max_prompt_tokens", "max_answer_tokens", "sync_every")
            ],
        )
        if not 0.0 < t.heldout < 1.0:
            errors.append(ConfigError("train.heldout", t.heldout, "a fraction of the samples", "0 < heldout < 1"))
        if t.data.num_samples < 2 or round(t.data.num_samples * t.heldout) >= t.data.num_samples:
            errors.append(
                ConfigError(
                    "train.data.num_samples",
                    t.data.num_samples,
                    f"too few to hold out {t.heldout:.0%} (at least one) and train on the rest",
                    ">= 2, or a smaller train.heldout",
                )
            )
        if t.attention not in TRAIN_ATTENTION:
            errors.append(
                ConfigError("train.attention", t.attention, "attention of the training forward", TRAIN_ATTENTION)
            )
        if t.attention == "flex" and not flex_trains(d.algorithm, env.device):
            errors.append(
                ConfigError(
                    "train.attention",
                    t.attention,
                    f"FlexAttention trains {d.algorithm} on CUDA only (this run: {d.algorithm} on {env.device})",
                    "eager or auto",
                )
            )
        if t.kernels not in TRAIN_KERNELS:
            errors.append(ConfigError("train.kernels", t.kernels, "the training step's fused kernels", TRAIN_KERNELS))
        if t.kernels == "triton" and (
            triton is None or (env.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1")
        ):
            errors.append(
                ConfigError(
                    "train.kernels",
                    t.kernels,
                    f"needs triton on CUDA (or TRITON_INTERPRET=1); this run: {env.device}, triton "
                    f"{'installed' if triton is not None else 'not installed'}",
                    "torch or auto",
                )
            )
        if not 0.0 <= t.ema_decay < 1.0:
            errors.append(
                ConfigError(
                    "train.ema_decay",
                    t.ema_decay,
                    "the decay of the exported weight average",
                    "0 <= ema_decay < 1 (0: off; 0.999: about the last 1000 steps)",
                )
            )
        if not t.label_temperature > 0:
            errors.append(
                ConfigError(
                    "train.label_temperature",
                    t.label_temperature,
                    "the temperature of the target distribution the head learns",
                    "> 0 (1: the target's own)",
                )
            )
        if not 0.0 <= t.min_lr_ratio <= 1.0:
            errors.append(
                ConfigError(
                    "train.min_lr_ratio",
                    t.min_lr_ratio,
                    "where the cosine schedule ends, as a share of lr",
                    "0 <= min_lr_ratio <= 1",
                )
            )
        if not 0.0 < t.data.prompt_top_p <= 1.0:
            errors.append(
                ConfigError(
                    "train.data.prompt_top_p", t.data.prompt_top_p, "the user messages' nucleus", "0 < top_p <= 1"
                )
            )
        if t.lr <= 0:
            errors.append(ConfigError("train.lr", t.lr, "must be positive", "> 0"))
        if t.max_len > cfg.model.max_seq_len:
            errors.append(
                ConfigError(
                    "train.max_len",
                    t.max_len,
                    f"longer than model.max_seq_len={cfg.model.max_seq_len}",
                    f"<= {cfg.model.max_seq_len}",
                )
            )
        if t.data.graph not in DATA_GRAPHS:
            errors.append(
                ConfigError("train.data.graph", t.data.graph, "graph policy of the data generation", DATA_GRAPHS)
            )
        if t.data.graph in NEEDS_CUDA and env.device.type != "cuda":
            errors.append(
                ConfigError(
                    "train.data.graph",
                    t.data.graph,
                    f"captures CUDA graphs but the run's device is {env.device}",
                    "none or debug",
                )
            )
        vocab, dv = env.target_args.vocab_size, d.draft_vocab_size
        if d.init == "random" and dv is not None and dv < len(env.target_args.eos_token_ids) + 1:
            errors.append(ConfigError("draft.draft_vocab_size", dv, "too small to hold the stop tokens", f"2..{vocab}"))
        raise_all(errors)

    @staticmethod
    def _check_draft(cfg, env: StageEnv) -> None:
        spec = train_spec(cfg.draft.algorithm)
        if spec.check is not None:
            spec.check(cfg, env.draft_plan)

    def describe(self, cfg, env: StageEnv) -> str:
        t = cfg.train
        budget = f", stop after {t.max_time_s:g}s" if t.max_time_s else ""
        return (
            f"self-distil {t.data.num_samples} samples (graph {data_graph(cfg, env)}"
            f"{steering(t.data.system_prompts)}), hold out {t.heldout:.0%}; "
            f"{t.steps} steps, TTT {t.ttt_steps} steps, lr {t.lr:g}, {t.max_tokens} tokens/batch{budget}, "
            f"attention {train_attention(cfg, env.device)}, kernels {train_kernels(cfg, env.device)}"
            f"{f', labels at T {t.label_temperature:g}' if t.label_temperature != 1 else ''}"
            f"{f', EMA {t.ema_decay:g}' if t.ema_decay else ''}; "
            f"-> {train_dir(cfg, env)}"
        )

    # ----------------------------------------------------------------------------------------------
    def run(self, cfg, inputs, env: StageEnv) -> dict:
        t, loaded, head = cfg.train, inputs["target"], inputs["draft_head"]
        target, out = loaded.model, train_dir(cfg, env)
        out.mkdir(parents=True, exist_ok=True)
        log = env.tracker.log_metrics if env.tracker is not None else (lambda m, step=0: None)

        samples, data_s, phase_s, reused = self._data(
            cfg, loaded, env.outputs_dir / "train" / "data", data_graph(cfg, env)
        )
        train, heldout = split(samples, t.heldout, cfg.seed)
        data = {
            "samples": len(samples),
            "answer_tokens": sum(len(s.answer_ids) for s in samples),
            "prompts_cut": cut_share(samples),
            "data_s": data_s,
        }
        log(
            {
                "data_s": data_s,
                "data_reused": float(reused),
                "data_samples": data["samples"],
                "data_prompts_cut": data["prompts_cut"],
                "data_answer_tokens": data["answer_tokens"],
                "data_train_samples": len(train),
                "data_heldout_samples": len(heldout),
                **{f"data_{k}_s": v for k, v in phase_s.items()},
            }
        )
        print(
            f"[train_draft] {data['samples']} samples ({data['answer_tokens']} answer tokens, "
            f"{data['prompts_cut']:.0%} of the user messages cut at {t.data.max_prompt_tokens} tokens) in "
            f"{data_s:.1f}s ({', '.join(f'{k} {v:.1f}s' for k, v in phase_s.items()) or 'phases unknown'}); "
            f"{len(train)} train / {len(heldout)} held out",
            flush=True,
        )
        tok, n, total = top_token(samples)
        log({"data_top_token_share": n / max(total, 1)})
        if n > DEGENERATE_SHARE * total:
            print(
                f"WARNING: degenerate data: token {tok} ({loaded.tokenizer.decode([tok])!r}) is {n} of the {total} "
                f"answer tokens ({n / total:.0%}): a target that repeats one token teaches a head nothing, and "
                "its held-out acceptance will read high. A random target needs wider weights: model=tiny_trainable",
                flush=True,
            )

        spec = train_spec(cfg.draft.algorithm)
        student = self._student(cfg, head, target, train, env, spec)
        trainer = Trainer(
            student, target, train, heldout, VocabMap.of(student), settings(cfg, env.device), out, log, spec
        )
        if trainer.graphs is not None and distributed.is_main():
            g = trainer.graphs.stats
            print(f"[train_draft] target graphs: {len(g.buckets)} batch shapes in {g.capture_s:.1f}s", flush=True)
        metrics = trainer.fit(resume=t.resume)
        if trainer.graphs is not None:
            metrics["target_graph_capture_s"] = trainer.graphs.stats.capture_s
            metrics["target_graph_fallbacks"] = trainer.graphs.stats.fallbacks
            log({k: metrics[k] for k in ("target_graph_capture_s", "target_graph_fallbacks")}, trainer.step)
        export = out / "head"
        if not distributed.is_main():  # rank 0 evaluates and exports (the other ranks print nothing: execute)
            return {"draft_checkpoint": str(export)}
        if t.loop_eval_prompts > 0:
            metrics.update(
                loop_acceptance(
                    env.draft_plan,
                    student,
                    target,
                    heldout[: t.loop_eval_prompts],
                    cfg.draft.num_steps,
                    t.loop_eval_tokens,
                    loaded.tokenizer.eos_token_ids,
                    env,
                )
            )
            log({k: v for k, v in metrics.items() if k.startswith("heldout_")}, trainer.step)

        self._export(student, export, cfg, metrics, data, env)
        if trainer.last_weights is not None:  # EMA: the last step's own weights too, for comparison
            last = student.copy(env.device, torch.float32)
            own = dict(last.named_parameters())
            torch._foreach_copy_(
                [own[n].data for n, p in student.named_parameters() if p.requires_grad], trainer.last_weights
            )
            last_metrics = {k: v for k, v in metrics.items() if not k.startswith(("val_", "heldout_", "last_"))}
            last_metrics.update({k[5:]: v for k, v in metrics.items() if k.startswith("last_")})
            self._export(last, out / "head_last", cfg, last_metrics, data, env, ema=False)
        else:  # no average: no last-step twin (an earlier run's would be stale)
            shutil.rmtree(out / "head_last", ignore_errors=True)
        if t.export_dir:
            dest = Path(t.export_dir) if Path(t.export_dir).is_absolute() else REPO / t.export_dir
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(export, dest)
        if env.tracker is not None:
            for f in sorted(export.iterdir()):
                env.tracker.client.log_artifact(env.tracker.run_id, str(f), "draft_head")
        print(self._summary(metrics, trainer.start_metrics, cfg, student, env, export), flush=True)
        return {"draft_checkpoint": str(export)}

    @staticmethod
    def _summary(metrics, start, cfg, student, env: StageEnv, export: Path) -> str:
        """The run's last line: held-out acceptance (and through the real loop) and loss beside the untrained
        head's (step 0) and a uniform guess's; a WARNING when the loss never left that floor."""
        k, loss = cfg.train.eval_k, metrics["val_loss"]
        acc, loop = f"val_accept_length_k{k}", f"heldout_loop_accept_length_k{cfg.draft.num_steps}"
        vocab = getattr(student, "draft_vocab_size", None) or env.target_args.vocab_size
        floor = math.log(vocab)
        was = lambda key, f: f" ({start[key]:{f}} at step 0)" if key in start else ""  # noqa: E731
        in_loop = (
            f", {metrics[loop]:.2f} in the real loop (k={cfg.draft.num_steps}, {metrics['heldout_loop_prompts']:.0f} "
            "prompts)"
            if loop in metrics
            else ""
        )
        line = (
            f"[train_draft] {metrics['train_steps']} steps in {metrics['train_s']:.0f}s: held-out accept_length"
            f"(k={k}) {metrics[acc]:.2f}{was(acc, '.2f')}{in_loop}; loss {loss:.3f}{was('val_loss', '.3f')}, "
            f"a uniform guess's {floor:.3f} -> {export}"
        )
        if loss >= 0.95 * floor:
            line += (
                f"\nWARNING: the held-out loss {loss:.3f} is no better than a uniform guess's ln({vocab}) = "
                f"{floor:.3f}: the target's next tokens are near uniform (nothing to learn from them), or the head "
                "learned nothing"
            )
        return line

    def _data(self, cfg, loaded, root: Path, graph: str):
        d = cfg.train.data
        # how the decoding ran (graphs, host looks) does not change the samples: not in the key
        # a random target is its architecture, seed and weight scale (its checkpoint is just "random")
        target = dataclasses.asdict(cfg.model.random) if cfg.model.source == "random" else str(loaded.checkpoint)
        meta = {"target": target, "data": {**dataclasses.asdict(d), "graph": None, "sync_every": None}}
        path = root / hashlib.sha1(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:12]
        samples = load_samples(path, meta)
        if samples is not None:
            print(f"[train_draft] reusing {len(samples)} samples from {path}", flush=True)
            return (samples, *synth_seconds(path), True)
        t0 = time.perf_counter()
        rank, ranks = distributed.rank(), distributed.world_size()
        loaded.model.set_batch_invariant(False)  # cuBLAS at generation batches: no output compared across sizes
        try:
            graphs = generation_graphs(loaded.model, d.batch_size, graph)
            phase_s = {"graphs": time.perf_counter() - t0}  # then messages, answers (synthesize)
            samples = synthesize_data(loaded, d, graphs, phase_s, shard=(rank, ranks))
            del graphs
        finally:
            loaded.model.set_batch_invariant(True)
        if torch.cuda.is_available():  # the generation's KV cache and graph pools (49.5 GiB reserved at 1024
            gc.collect()  # rows on SmolLM2) go back to the driver: other runs may share the GPU
            torch.cuda.empty_cache()
        if ranks == 1:
            synth_s = time.perf_counter() - t0
            save_samples(path, samples, meta, synth_s, phase_s)
            return samples, synth_s, phase_s, False
        # each rank's shard, then rank 0 joins them in rank order; every rank reads the whole set back
        shards = path / "shards"
        save_samples(shards / str(rank), samples, meta, time.perf_counter() - t0, phase_s)
        distributed.barrier()
        synth_s = time.perf_counter() - t0
        if rank == 0:
            joined = [x for r in range(ranks) for x in load_samples(shards / str(r), meta)]
            save_samples(path, joined, meta, synth_s, phase_s)
            shutil.rmtree(shards)
        distributed.barrier()
        return load_samples(path, meta), synth_s, phase_s, False

    def _student(self, cfg, head, target, train, env: StageEnv, spec):
        """A float32 trainable copy of the loaded head: from scratch, its draft vocabulary (EAGLE3 with an
        lm_head of its own) from the training split, then its output layer from the target's."""
        student = head.copy(env.device, torch.float32)
        if cfg.draft.init == "random":
            if spec.prepare is not None:  # EAGLE3: its draft vocabulary
                spec.prepare(student, (s.ids for s in train), sorted(set(target.args.eos_token_ids)))
            if cfg.train.init_from_target and hasattr(student, "init_from_target"):
                student.init_from_target(target)
        return student.requires_grad_(True)

    def _export(self, student, path: Path, cfg, metrics, data: dict, env, ema: bool = True) -> None:
        """data: the samples' figures (samples, answer_tokens, prompts_cut, data_s). ema=False: these are
        the last step's own weights of a run with train.ema_decay (the card and training.json say so)."""
        dtype = cfg.train.save_dtype.torch()
        export = student.copy(torch.device("cpu"), dtype)
        shutil.rmtree(path, ignore_errors=True)
        export.save(path)
        facts = {
            "experiment": cfg.experiment_name,
            "target": cfg.model.name,
            "target_checkpoint": str(env.weights_dir),
            "device": device_name(env.device),
            "samples": data["samples"],
            "answer_tokens": data["answer_tokens"],
            "prompts_cut": round(data["prompts_cut"], 4),
            "data_s": round(data["data_s"], 1),
            "data": dataclasses.asdict(cfg.train.data),
            "heldout": cfg.train.heldout,
            "train": {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in ("data",)},
            "weights": "ema" if ema and cfg.train.ema_decay else "last",
            "algorithm": cfg.draft.algorithm,
            "architecture": export.architecture,
            "draft_vocab_size": getattr(export, "draft_vocab_size", env.target_args.vocab_size),
            "lm_head": "target" if export.shares_lm_head else "own",
            "aux_layer_ids_output_of": list(env.draft_plan.aux.output_of) if env.draft_plan.aux else None,
            "metrics": {k: round(float(v), 4) for k, v in metrics.items()},
        }
        facts["summary"] = export.card_summary(facts)
        facts["objective"] = export.card_objective(facts)
        (path / "README.md").write_text(model_card(facts))
        (path / "training.json").write_text(json.dumps(facts, indent=2, default=str))


@torch.no_grad()
def loop_acceptance(
    plan, student, target, prompts, k: int, max_new_tokens: int, stop_ids: frozenset[int], env: StageEnv
) -> dict[str, float]:
    """Acceptance through the real draft-and-verify loop (engine.speculative.generate) on held-out prompts: rounds
    start where the previous one stopped, unlike the per-anchor chain estimate of the training eval."""
    from engine.drafts.registry import make_draft
    from engine.sampling import SamplingParams
    from engine.speculative.generate import Generator

    head = student.copy(env.device, target.lm_head.weight.dtype).eval()
    params = SamplingParams(max_new_tokens=max_new_tokens)
    batch = min(16, len(prompts))
    gen = Generator(target, batch, make_draft(plan, head, target, batch, k), k)
    accepts = []
    for i in range(0, len(prompts), batch):
        for r in gen.generate([p.prompt_ids for p in prompts[i : i + batch]], params, stop_ids):
            accepts += r.accepts
    return {
        f"heldout_loop_accept_length_k{k}": sum(a + 1 for a in accepts) / max(len(accepts), 1),
        "heldout_loop_prompts": float(len(prompts)),
    }


def settings(cfg, device: torch.device) -> TrainSettings:
    t = cfg.train
    return TrainSettings(
        steps=t.steps,
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        ttt_steps=t.ttt_steps,
        loss_decay=t.loss_decay,
        max_tokens=t.max_tokens,
        max_len=t.max_len,
        eval_every=t.eval_every,
        save_every=t.save_every,
        eval_k=t.eval_k,
        loop_horizon=t.loop_eval_tokens,
        label_temperature=t.label_temperature,
        min_lr_ratio=t.min_lr_ratio,
        ema_decay=t.ema_decay,
        attention=train_attention(cfg, device),
        kernels=train_kernels(cfg, device),
        max_time_s=t.max_time_s,
        seed=cfg.seed,
    )


def model_card(f: dict) -> str:
    m, k = f["metrics"], f["train"]["eval_k"]
    rates = ", ".join(f"{m[f'val_accept_rate_pos_{i}']:.2f}" for i in range(k) if f"val_accept_rate_pos_{i}" in m)
    d, t = f["data"], f["train"]
    command = f"python -m pipeline +experiment={card_experiment(f)}{lever_overrides(f)}"
    sampling = (
        f"Magpie, temperature {d['prompt_temperature']}, top-p {d.get('prompt_top_p', 0.95)}"
        f"{steering(d.get('system_prompts'))}; {cut_words(f)}"
    )
    vocab = "target's whole" if f.get("lm_head") == "target" else "draft"
    optimiser = (
        f"step weight {t['loss_decay']}^s), AdamW lr {t['lr']}{decay_words(f)}, {int(m.get('train_steps', 0))} steps"
    )
    return f"""# {f["algorithm"]} draft head for {f["target"]}

{f["summary"]}

## How it was trained

- Stage `train_draft` of this repository (`{command}`), on {f["device"]}.
- Data: {f["samples"]} samples self-distilled from the target itself ({f["data_s"]} s): user messages sampled
  from the target's chat template ({sampling}), answered by the target greedily
  (up to {d["max_answer_tokens"]} tokens; {f["answer_tokens"]} answer tokens). \
No benchmark prompt set was used.
- {f["objective"]}, loss against the target's distribution{label_words(f)} over the
  {vocab} vocabulary ({optimiser}
  of {t["max_tokens"]} tokens ({m.get("train_s", 0):.0f} s){average_words(f)}.

## Acceptance measured

On the held-out {f["heldout"]:.0%} of the self-distilled samples, greedy chain drafting of k={k} tokens from every
answer position: accept_length {m.get(f"val_accept_length_k{k}", float("nan")):.2f} (bonus token included);
accept_rate_pos_i: {rates}.{loop_line(m, f)}
"""


def label_words(f: dict) -> str:
    """The labels' temperature in the card, where it is not the target's own (1)."""
    t = f["train"].get("label_temperature", 1.0)
    return "" if t == 1 else f" at temperature {t:g} (sharpened toward its greedy token)"


# The levers the card names as overrides where the run's value is not its recipe's.
LEVERS = ("ema_decay", "weight_decay", "label_temperature", "lr", "max_time_s")


def card_experiment(f: dict) -> str:
    """The experiment the run `f` describes (a card written before training.json named it: the EAGLE3 one)."""
    return f.get("experiment", "train_eagle3_smollm2")


def recipe_train(experiment: str) -> dict:
    """train.* as the experiment's recipe sets it: conf/experiment/<experiment>.yaml over the schema's
    defaults (read as a file: a card is written inside the running Hydra app)."""
    from omegaconf import OmegaConf

    from pipeline.config import TrainConfig

    values = dataclasses.asdict(TrainConfig())
    path = REPO / "conf" / "experiment" / f"{experiment}.yaml"
    if path.is_file():
        values.update(OmegaConf.to_container(OmegaConf.load(path)).get("train") or {})
    return values


def lever_overrides(f: dict) -> str:
    """The levers whose value in the run is not the recipe's, as the overrides that set them."""
    recipe = recipe_train(card_experiment(f))
    return "".join(
        f" train.{k}={'null' if f['train'][k] is None else format(f['train'][k], 'g')}"
        for k in LEVERS
        if k in f["train"] and f["train"][k] != recipe.get(k)
    )


def decay_words(f: dict) -> str:
    """The card's words for AdamW's weight decay ("" without it)."""
    wd = f["train"].get("weight_decay")
    return f" with weight decay {wd:g} (not on norms and biases)" if wd else ""


def average_words(f: dict) -> str:
    """The card's words for the exported weights of a run with train.ema_decay ("" without it)."""
    decay = f["train"].get("ema_decay")
    if not decay:
        return ""
    if f.get("weights") == "last":
        return f"; these are the last step's own weights (the run's head is their EMA at decay {decay:g})"
    return f"; the weights are an exponential moving average of the training weights (decay {decay:g})"


def cut_words(f: dict) -> str:
    """The card's words for the user messages cut at `max_prompt_tokens` (dropped, or how many were kept)."""
    limit = f["data"]["max_prompt_tokens"]
    if f["data"].get("drop_cut_prompts"):
        return f"those cut at {limit} tokens drawn again"
    return f"{f['prompts_cut']:.0%} of them cut at {limit} tokens"


def steering(system_prompts) -> str:
    """The card's and the plan's words for `train.data.system_prompts` ("" when there are none)."""
    prompts = system_prompts or []
    n = len([p for p in prompts if p])
    default = " and the default" if "" in prompts else ""
    return f", under {n} topic system messages{default} in turn" if n else ""


def loop_line(m: dict, f: dict) -> str:
    k, n = f["train"]["eval_k"], f["train"].get("loop_eval_tokens")
    out = ""
    if f"val_loop_accept_length_k{k}" in m:
        out += (
            f"\nThe greedy loop replayed on every held-out answer (rounds start where the previous one "
            f"stopped; up to {n} new tokens): accept_length {m[f'val_loop_accept_length_k{k}']:.2f}."
        )
    keys = [key for key in m if key.startswith("heldout_loop_accept_length_k")]
    if keys:
        out += (
            f"\nThrough the real draft-and-verify loop (k={keys[0].rsplit('k', 1)[1]}, greedy, up to {n} new "
            f"tokens) on {int(m['heldout_loop_prompts'])} held-out prompts: accept_length {m[keys[0]]:.2f}."
        )
    return out
