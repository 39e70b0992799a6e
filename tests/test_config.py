"""Composing configs with the overrides a user types; typos and wrong types fail at compose time."""

from __future__ import annotations

import pytest
from helpers.runs import compose_cfg
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from engine.errors import ConfigError
from pipeline.config import compose_run_config, flatten, to_run_config
from schema import Device, DType, EvalConfig, RunConfig


def test_defaults_compose_into_dataclasses():
    cfg = to_run_config(compose_cfg())
    assert isinstance(cfg, RunConfig) and isinstance(cfg.eval, EvalConfig)
    assert cfg.model.source == "gguf" and cfg.model.path is None
    assert cfg.draft.algorithm == "none" and cfg.graph.policy == "none"
    assert cfg.eval.dataset == "humaneval" and cfg.device is Device.auto and cfg.dtype is DType.auto
    assert cfg.experiment_name == "default" and cfg.task == "eval"


def test_experiment_and_overrides():
    cfg = to_run_config(
        compose_cfg(
            "+experiment=baseline",
            "model=tiny",
            "eval.limit=2",
            "eval.batch_size=4",
            "eval.peers=[hf_generate]",
            "device=cpu",
            "dtype=bfloat16",
        )
    )
    assert cfg.experiment_name == "baseline"
    assert cfg.model.source == "random" and cfg.model.random.hidden_size == 64
    assert (cfg.eval.limit, cfg.eval.batch_size, cfg.eval.peers) == (2, 4, ["hf_generate"])
    assert cfg.device is Device.cpu and cfg.dtype is DType.bfloat16


def test_compose_run_config_outside_a_hydra_app(tmp_path, monkeypatch):
    """The benchmark scripts' way in: conf/ found from any working directory, the app's config, its checks."""
    monkeypatch.chdir(tmp_path)
    overrides = ("+experiment=train_eagle3_smollm2", "train.data.drop_cut_prompts=true")
    cfg = compose_run_config(*overrides)
    assert cfg == to_run_config(compose_cfg(*overrides))
    assert cfg.train.data.drop_cut_prompts and cfg.experiment_name == "train_eagle3_smollm2"
    with pytest.raises(ConfigError, match="lrr"):
        compose_run_config("+train.lrr=1")


def test_hf_model_group_names_model_after_its_directory(tmp_path):
    cfg = to_run_config(compose_cfg("model=hf", f"model.path={tmp_path}/Llama-3.2-1B"))
    assert cfg.model.name == "Llama-3.2-1B" and cfg.model.source == "hf"


def test_flatten_gives_dotted_params():
    flat = flatten(to_run_config(compose_cfg("model=tiny")))
    assert flat["model.random.hidden_size"] == 64 and flat["eval.dataset"] == "humaneval"
    assert flat["device"] == "auto"  # enums as their names


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.hidden=3", "hidden"),  # a key the schema does not have
        ("eval.limt=2", "limt"),
        ("+eval.limt=2", "limt"),  # even when appended with +
    ],
)
def test_unknown_key_is_rejected(override, key):
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ConfigError)) as e:
        to_run_config(compose_cfg(override))
    assert key in str(e.value) or key in str(e.value.__cause__)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("eval.limit=abc", "eval.limit"),
        ("eval.batch_size=1.5", "eval.batch_size"),
        ("device=gpu", "auto, cpu, cuda"),  # names the valid values
        ("dtype=fp8", "float32"),
    ],
)
def test_wrong_value_is_rejected(override, needle):
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose_cfg(override)
    text = f"{e.value} {e.value.__cause__}"
    assert needle in text


def test_unknown_group_option_is_rejected():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("model=gpt5")
    assert "gpt5" in str(e.value) and "smollm2" in str(e.value)  # lists the available options


def test_magpie_group_sets_the_system_messages_of_self_distillation():
    assert to_run_config(compose_cfg()).train.data.system_prompts == []  # plain: the template's default
    detailed = to_run_config(compose_cfg("+experiment=train_eagle3_smollm2")).train.data  # the recipe's
    assert len(detailed.system_prompts) == 10 and detailed.system_prompts.count("") == 1
    assert any("math" in p for p in detailed.system_prompts)
    plain = to_run_config(compose_cfg("+experiment=train_eagle3_smollm2", "magpie=plain")).train.data
    assert plain.system_prompts == [] and plain.num_samples == 98304  # the rest of the recipe stays
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("magpie=topics_wide")  # tried, no gain, removed
    assert "topics_detailed" in str(e.value)  # lists the available options


def test_every_graph_option_composes_and_piecewise_is_breakable():
    """Each conf/graph option a user types composes; `piecewise` (sglang's PCG word) is an alias that
    composes to `breakable` itself; `bcg` is the target full with the draft breakable, not breakable
    on both sides; the *_pcg and *_bcg experiments keep their names and policies."""
    from pipeline.paths import REPO

    names = sorted(p.stem for p in (REPO / "conf" / "graph").glob("*.yaml"))
    assert names == ["bcg", "breakable", "debug", "full", "none", "piecewise"]
    graphs = {n: to_run_config(compose_cfg(f"graph={n}")).graph for n in names}
    assert {n: (g.target, g.draft) for n, g in graphs.items()} == {
        "bcg": ("full", "breakable"),
        "breakable": ("breakable", "breakable"),
        "debug": ("debug", "debug"),
        "full": ("full", "full"),
        "none": ("none", "none"),
        "piecewise": ("breakable", "breakable"),
    }
    assert graphs["piecewise"] == graphs["breakable"]
    for exp, policies in [("eagle3_pcg", ("breakable", "breakable")), ("eagle3_bcg", ("full", "breakable"))]:
        cfg = to_run_config(compose_cfg(f"+experiment={exp}", "graph.capture_sizes=[1,2]"))
        assert (cfg.experiment_name, cfg.graph.target, cfg.graph.draft) == (exp, *policies)
        assert cfg.graph.capture_sizes == [1, 2]
