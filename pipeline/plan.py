"""Resolve a RunConfig into a validated plan of stages, before any weight is read or GPU touched.

    build_plan(cfg) -> Plan           raises PlanError listing every problem (key, value, what is valid)
    plan.describe() -> str            what dry_run prints: stages, model, device, memory estimate

Resolution: `load` -> `configure_aux_capture` (when the draft reads aux layers) -> `capture_graphs`
(when a graph policy is not `none`) -> `cfg.task`. Validation, in order: the registries named by the
config (task, draft, graph policy), the device (`device=cuda`, or a policy that captures CUDA graphs, on a
host without CUDA is an error naming what chose it, never a silent downgrade; a dry run plans it for CUDA
instead, listing what only the GPU can check; under torchrun, `resolve_ranks`: data-parallel runs train a
draft, one GPU per process), the target's config files (`describe_model`), the draft's (`plan_draft`:
checkpoint config, fc width against the aux layers, aux ids in range), then each stage's own `check`, then
the requires/provides chain and the rule that aux capture is configured before any stage runs the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import stages  # noqa: F401  (registers the stages)
from engine.drafts.registry import ALGORITHMS, DraftPlan, plan_draft
from engine.errors import ConfigError, ConfigErrors, PlanError, check_values, raised
from engine.graphs.backends import NEEDS_CUDA, POLICIES
from engine.loading import describe_model
from engine.train.distributed import launch
from pipeline.paths import outputs_dir, outputs_error
from pipeline.tracking import tracking_errors
from schema import Device, DType, RunConfig
from stages.base import STAGES, Stage, StageEnv, final_stages
from stages.capture_graphs import max_batch, prefill_buckets, prefill_rows

GPU_ONLY = "that CUDA is there, the memory plan, graph capture and its memory, the Triton kernels' compilation"


def cuda_policies(cfg: RunConfig) -> dict[str, str]:
    """The sides whose graph policy captures CUDA graphs: {"target": "full", "draft": "breakable"}."""
    sides = {"target": cfg.graph.target, "draft": cfg.graph.draft if cfg.draft.k else "none"}
    return {side: p for side, p in sides.items() if p in NEEDS_CUDA}


def resolve_device(device: Device, plan_for_cuda: bool = False) -> torch.device:
    """The run's device. `plan_for_cuda` (a dry run of a run that needs CUDA): cuda for `auto` and `cuda`
    on a host without it, as on the GPU the run is meant for."""
    cuda = torch.cuda.is_available()
    if device == Device.auto:
        return torch.device("cuda" if cuda or plan_for_cuda else "cpu")
    if device == Device.cuda and not cuda and not plan_for_cuda:
        raise ConfigError("device", "cuda", "CUDA is not available on this host", "cpu, or auto; or dry_run=true")
    return torch.device(device.value)


def cuda_error(cfg: RunConfig, device: torch.device, origin: Optional[tuple[str, str]]) -> Optional[ConfigError]:
    """A graph policy that captures CUDA graphs on a device that is not CUDA: one error naming both sides
    and, when known, the choice that set them (`origin`: ("bcg", "+experiment=eagle3_bcg"))."""
    sides = cuda_policies(cfg)
    if device.type == "cuda" or not sides:
        return None
    both = f"target {cfg.graph.target}, draft {cfg.graph.draft if cfg.draft.k else '-'}"
    where = f"the run's device is {device}" + ("" if torch.cuda.is_available() else " (this host has no CUDA)")
    fix = "graph=none (eager), graph=debug (the runner logic, eagerly), or dry_run=true to print the GPU run's plan"
    if origin is not None:
        choice, source = origin
        return ConfigError("graph", choice, f"{source} chose it: {both}, which capture CUDA graphs, but {where}", fix)
    side, policy = next(iter(sides.items()))
    return ConfigError(f"graph.{side}_policy", policy, f"captures CUDA graphs ({both}) but {where}", fix)


def resolve_ranks(task: str, device: torch.device) -> torch.device:
    """The process's device under torchrun (WORLD_SIZE > 1): cuda:LOCAL_RANK on CUDA. Only train_draft runs
    data-parallel, and nccl needs a GPU per process of the node."""
    ranks = launch()
    if not ranks.distributed:
        return device
    if task != "train_draft":
        raise ConfigError(
            "task",
            task,
            f"torchrun started {ranks.world_size} processes (WORLD_SIZE), but only train_draft trains data-parallel",
            "train_draft, or one process (python -m pipeline) for this task",
        )
    if device.type != "cuda":
        return device
    gpus = torch.cuda.device_count()
    if ranks.local_world_size > gpus:
        raise ConfigError(
            "device",
            "cuda",
            f"torchrun started {ranks.local_world_size} processes on this node, which has {gpus} GPU(s); "
            f"nccl needs one GPU per process",
            f"torchrun --nproc_per_node<={gpus}, or device=cpu (gloo)",
        )
    return torch.device("cuda", ranks.local_rank)


def resolve_dtype(dtype: DType, device: torch.device) -> torch.dtype:
    if dtype == DType.auto:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype.torch()


SETUP = ("load", "configure_aux_capture", "capture_graphs")  # before the final stage, in this order


def resolve_stage_names(cfg: RunConfig, draft: DraftPlan | None) -> list[str]:
    """The setup stages the run needs (each stage says), then the task's."""
    return [n for n in SETUP if STAGES[n].needed(cfg, draft)] + [cfg.task]


@dataclass
class Plan:
    cfg: RunConfig
    stages: list[Stage]
    env: StageEnv

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def set_up(self, *names: str) -> dict:
        """Run only the stages named, in the plan's order (a script's load and aux capture before work
        of its own) -> their outputs."""
        ctx: dict = {}
        for stage in self.stages:
            if stage.name in names:
                ctx.update(stage.run(self.cfg, {k: ctx[k] for k in stage.requires}, self.env))
        return ctx

    def memory_estimate(self) -> dict[str, float]:
        """MB of what the run certainly allocates: the target's weights, its KV cache (every row at
        model.max_seq_len, a server's staging row too) and the draft head's, the largest step's
        activations (a verify of rows x (k + 1) tokens, or the largest prefill bucket: MLP intermediate
        and logits), with graphs that verify's buffers kept in the pool, and the prefill graphs' inputs."""
        a, dtype = self.env.target_args, self.env.dtype
        elem, rows = torch.empty((), dtype=dtype).element_size(), memory_rows(self.cfg)[1]

        def step_bytes(tokens: int, logits: int) -> int:  # [tokens, 2 x intermediate] + [logits, vocab] (fp32)
            return tokens * 2 * a.intermediate_size * elem + logits * a.vocab_size * 4

        verify = step_bytes(rows * (self.cfg.draft.k + 1), rows * (self.cfg.draft.k + 1))
        prefill = step_bytes(max(prefill_buckets(self.cfg), default=1), rows)  # the buckets that fit max_seq_len
        staging, slots = self.staging_rows(), self.cfg.model.max_seq_len + 1  # a server's prefill: one row more
        return {
            "weights_mb": a.num_params() * elem / 2**20,
            "kv_cache_mb": a.kv_bytes_per_token(dtype) * slots * (rows + staging[0]) / 2**20,
            "draft_kv_cache_mb": self.draft_cache_bytes(rows + staging[1]) / 2**20,
            "activations_mb": max(verify, prefill) / 2**20,
            "graph_pool_mb": (verify if cuda_policies(self.cfg) else 0) / 2**20,
            "prefill_buffers_mb": self.prefill_buffer_bytes(elem) / 2**20,
        }

    def prefill_sides(self) -> tuple[bool, bool]:
        """(target, draft): whether stage capture_graphs builds that side's prefill graphs."""
        cfg = self.cfg
        if "capture_graphs" not in self.names or not prefill_buckets(cfg):
            return False, False
        return cfg.graph.target != "none", self._device_draft() and cfg.graph.draft != "none"

    def staging_rows(self) -> tuple[int, int]:
        """(target, draft) rows of the staging caches the prefill graphs write (a server's; else none)."""
        rows = prefill_rows(self.cfg) or 0
        return tuple(rows * side for side in self.prefill_sides())

    def _device_draft(self) -> bool:
        """A draft with a head of its own that drafts on the device (its own KV cache and prefill)."""
        d = self.env.draft_plan
        return d is not None and d.spec.head is not None and d.head_config is not None and self.cfg.draft.k > 0

    def draft_cache_bytes(self, rows: int) -> int:
        """Bytes of the draft head's KV cache over `rows` rows: the head built on the meta device (shapes,
        no memory) and asked for its cache."""
        if not self._device_draft():
            return 0
        d = self.env.draft_plan
        with torch.device("meta"):
            head = d.spec.head(d.head_config, self.cfg.model.max_seq_len).to(self.env.dtype)
            return head.new_cache(rows).nbytes()

    def prefill_buffer_bytes(self, elem: int) -> int:
        """Bytes of the prefill graphs' static inputs (stage capture_graphs), over the prefill rows (a
        server's staging row, else the batch) x the largest bucket: the target's tokens, positions, valid,
        input embeddings [rows, T, hidden] and logits index; a device draft's tokens, positions, valid,
        features [rows, T, F] (F: n_aux x hidden, or hidden), first token and sampling."""
        cfg, a, d = self.cfg, self.env.target_args, self.env.draft_plan
        target, draft = self.prefill_sides()
        if not (target or draft):
            return 0
        rows, t = prefill_rows(cfg) or max_batch(cfg), max(prefill_buckets(cfg))
        tokens = rows * t * (8 + 8 + 1)  # tokens, positions (int64), valid (bool)
        total = tokens + rows * t * a.hidden_size * elem + rows * 8 if target else 0
        if draft:
            width = {"aux": len(d.aux.input_of) * a.hidden_size if d.aux else 0, "final": a.hidden_size}
            total += tokens + rows * t * width.get(d.features.value, 0) * elem + rows * (8 + 4 + 4 + 8)
        return total

    def describe(self) -> str:
        env = self.env
        lines = [
            f"experiment: {self.cfg.experiment_name}",
            f"device: {env.device} ({str(env.dtype).removeprefix('torch.')}), seed {self.cfg.seed}",
            f"draft: {self.cfg.draft.algorithm}   graph policy: target {self.cfg.graph.target}, "
            f"draft {self.cfg.graph.draft}",
            "stages:",
        ]
        for i, s in enumerate(self.stages, 1):
            req = ", ".join(s.requires) or "-"
            prov = ", ".join(s.provides) or "-"
            lines.append(f"  {i}. {s.name:<22} requires [{req}] provides [{prov}]")
            if d := s.describe(self.cfg, env):
                lines.append(f"     {d}")
        lines.append(f"memory estimate: {memory_sum(self)}")
        lines += [f"note: {n}" for n in env.notes]
        return "\n".join(lines)


def _check_registries(cfg: RunConfig) -> list[ConfigError]:
    errors = []
    if cfg.task not in final_stages():
        errors.append(ConfigError("task", cfg.task, "not a stage that can end a plan", final_stages()))
    if cfg.draft.algorithm not in ALGORITHMS:
        errors.append(ConfigError("draft.algorithm", cfg.draft.algorithm, "unknown draft algorithm", ALGORITHMS))
    for key, policy in (
        ("graph.policy", cfg.graph.policy),
        ("graph.target_policy", cfg.graph.target_policy),
        ("graph.draft_policy", cfg.graph.draft_policy),
    ):
        if policy is not None and policy not in POLICIES:
            errors.append(ConfigError(key, policy, "unknown graph policy", POLICIES))
    return errors


def _check_chain(stage_list: list[Stage], draft: DraftPlan | None) -> list[ConfigError]:
    """requires/provides, and: aux capture is configured before any stage that runs the target."""
    errors, available = [], set()
    needs_aux = draft is not None and draft.aux is not None
    for s in stage_list:
        missing = [k for k in s.requires if k not in available]
        if needs_aux and s.runs_target and "aux_layers" not in available:
            missing.append("aux_layers")
        if missing:
            errors.append(
                ConfigError(
                    "stages",
                    s.name,
                    f"requires {missing}, which no earlier stage provides",
                    f"a plan where a stage providing {missing} comes first",
                )
            )
        available.update(s.provides)
    return errors


def _check_values(cfg: RunConfig) -> None:
    """Top-level values the stages do not own."""
    check_values(
        [
            ("seed", cfg.seed, 0 <= cfg.seed < 2**64, "0 <= seed < 2**64 (what a torch generator takes)"),
            ("experiment_name", cfg.experiment_name, bool(cfg.experiment_name.strip()), "a name", "empty"),
            (
                "graph.prefill_buckets",
                list(cfg.graph.prefill_buckets),
                all(b >= 1 for b in cfg.graph.prefill_buckets),
                "prompt lengths >= 1 ([] for none)",
            ),
            (
                "graph.max_batch_size",
                cfg.graph.max_batch_size,
                cfg.graph.max_batch_size is None or cfg.graph.max_batch_size >= 1,
                ">= 1, or null for the run's batch",
            ),
        ]
    )


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are) a run on `device` may fill: the GPU's free memory, or the host's available RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"the free memory of {torch.cuda.get_device_name(device)} (of {total / 2**30:.1f} GiB)"
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info.get("MemTotal", 0)), "the host's available memory"


def memory_sum(plan: "Plan") -> str:
    """'weights 15.0 GiB + KV cache ... = 17.3 GiB': the estimate's parts and total, as the plan prints them."""
    mem, rows, staging = plan.memory_estimate(), memory_rows(plan.cfg)[1], plan.staging_rows()[0]
    rows_shown = f"({rows} + {staging} staging)" if staging else f"{rows}"
    parts = [
        ("weights", mem["weights_mb"]),
        (f"KV cache ({rows_shown} x {plan.cfg.model.max_seq_len + 1} slots)", mem["kv_cache_mb"]),
        ("draft KV cache", mem["draft_kv_cache_mb"]),
        ("activations", mem["activations_mb"]),
        ("graph pool", mem["graph_pool_mb"]),
        ("prefill graphs' inputs", mem["prefill_buffers_mb"]),
    ]
    shown = " + ".join(f"{name} {mb / 1024:.2f} GiB" for name, mb in parts if mb)
    return f"{shown} = {sum(mb for _, mb in parts) / 1024:.2f} GiB"


def memory_errors(plan: "Plan") -> list[ConfigError]:
    """The run's memory estimate against the device's free memory (or the host's), before anything is
    allocated: it counts only what the run certainly allocates, so a refusal is certain."""
    mem = plan.memory_estimate()
    need = sum(mem.values()) * 2**20
    have, what = available_memory(plan.env.device)
    if need <= have:
        return []
    key, rows = memory_rows(plan.cfg)
    fixed = mem["weights_mb"] * 2**20
    per_row = (need - fixed) / rows  # every part but the weights grows with the rows; this errs low on what fits
    fit = int((have - fixed) // per_row) if have > fixed and rows > 0 else 0
    gpu = " (this host has no GPU)" if not torch.cuda.is_available() else ""
    return [
        ConfigError(
            key,
            rows,
            f"{memory_sum(plan)}, beyond {what}, {have / 2**30:.1f} GiB{gpu}",
            f"{key} <= {fit}" if fit >= 1 else f"a smaller model.max_seq_len (now {plan.cfg.model.max_seq_len})",
        )
    ]


def memory_rows(cfg: RunConfig) -> tuple[str, int]:
    """(key, rows) of the largest KV cache the run allocates (model.max_seq_len slots each): the final stage's."""
    return STAGES[cfg.task]().kv_rows(cfg)


def build_plan(
    cfg: RunConfig, outputs: Path | None = None, origin: Optional[tuple[str, str]] = None, check_memory: bool = True
) -> Plan:
    """Every check that can run does: a failed registry, device or draft skips only the checks that read
    it (the stages' checks run without the draft, the graph check without a known policy). `origin`: the
    graph group's choice and what chose it, for the error of a CUDA policy without CUDA. check_memory:
    the estimate against the device's free memory (off: a sweep's launcher checking jobs that run elsewhere)."""
    outputs = outputs or outputs_dir()
    if (bad := outputs_error(outputs)) is not None:
        raise PlanError([bad])
    errors = _check_registries(cfg) + raised(_check_values, cfg) + tracking_errors(cfg, outputs)
    device, dtype, target_args, draft, draft_ok = torch.device("cpu"), torch.float32, None, None, True
    gpu_plan = cfg.dry_run and not torch.cuda.is_available() and (cfg.device == Device.cuda or bool(cuda_policies(cfg)))
    try:
        device = resolve_device(cfg.device, plan_for_cuda=gpu_plan)
        dtype = resolve_dtype(cfg.dtype, device)
        device = resolve_ranks(cfg.task, device)
    except ConfigError as e:  # the rest is checked for this host's CPU
        errors.append(e)
    try:
        target_args = describe_model(cfg.model, outputs / "weights")
    except ConfigError as e:
        errors.append(e)
    except ConfigErrors as e:
        errors += e.errors
    if target_args is not None and cfg.draft.algorithm in ALGORITHMS:
        try:
            draft = plan_draft(cfg.draft, target_args)
        except ConfigError as e:
            errors.append(e)
            draft_ok = False
    if target_args is None or cfg.task not in final_stages():  # the stages' checks read the target
        raise PlanError(errors)

    env = StageEnv(device=device, dtype=dtype, outputs_dir=outputs, target_args=target_args, draft_plan=draft)
    if gpu_plan:
        env.notes.append(f"the plan of a CUDA run, made on a host without CUDA: checked on the GPU only: {GPU_ONLY}")
    if draft is not None and draft.random_weights and cfg.task != "train_draft":
        env.notes.append(draft.random_weights_warning())
    stage_list = [STAGES[n]() for n in resolve_stage_names(cfg, draft)]
    policies_ok = not any(e.key.startswith("graph.") and e.key.endswith("policy") for e in errors)
    for s in stage_list:
        if s.name == "capture_graphs" and not (policies_ok and draft_ok):
            continue
        found = raised(s.check, cfg, env)
        if not draft_ok:  # checked without the draft: what depends on it is not known yet
            found = [e for e in found if not e.key.startswith("draft.") and e.key != "eval.adaptive_k"]
        errors += found
    if policies_ok and (e := cuda_error(cfg, device, origin)) is not None:
        errors.append(e)
    errors += _check_chain(stage_list, draft)
    if errors:
        raise PlanError(errors)
    plan = Plan(cfg, stage_list, env)
    if check_memory and not gpu_plan and (errors := memory_errors(plan)):  # gpu_plan: memory unknown here
        raise PlanError(errors)
    return plan
