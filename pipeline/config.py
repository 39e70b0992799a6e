"""The edge between Hydra and the run: schema registration, and the one conversion to a RunConfig.

`register_configs` puts the run schema (schema/) in Hydra's ConfigStore as `run_schema`, the
base of the primary config (`conf/config.yaml` lists it first), and each draft algorithm's schema as
`schema/draft/<name>`, the base of conf/draft/<name>.yaml: a new algorithm registers through its
folder's record (engine/drafts/registry.py: SCHEMAS), not here.

Stages and the engine never see OmegaConf: `to_run_config(cfg)` turns the composed DictConfig into a
`RunConfig` instance once, and everything downstream takes plain dataclasses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from engine.errors import ConfigError
from schema import REPO, RunConfig


def register_configs() -> None:
    from engine.drafts.registry import SCHEMAS  # torch and every draft folder: not at import (--help)

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for name, schema in SCHEMAS.items():  # draft=<name> extends schema/draft/<name> (conf/draft/<name>.yaml)
        store.store(group="schema/draft", name=name, node=schema)
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
    if not isinstance(obj, RunConfig):  # composed without the schema: type it now (the draft's by its name)
        from engine.drafts.registry import SCHEMAS

        draft = SCHEMAS.get(OmegaConf.select(cfg, "draft.algorithm", default="none"), SCHEMAS["none"])
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig(draft=draft())), cfg)
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
