"""Hydra's composition errors in the pipeline's own words: the key, the value, and a hint that works.

`python -m pipeline` composes the command line's config once before Hydra does: a single run's, and
each job of a sweep (`sweep_jobs`: the basic sweeper's split, Hydra's own overrides left out), so a
bad job stops the sweep before any job runs. An override that does not parse, an unknown key, a group
written without its `+`, a config that does not exist, a value of the wrong type or several values
without -m becomes one ConfigError, exit 2, instead of Hydra's traceback or its exit 1 whose
`+key=value` hint leads to a second error; `compose_problems` finds every such override, and the plan
then checks what the others compose to.
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Optional

from omegaconf import OmegaConf

from engine.errors import ConfigError
from pipeline.paths import REPO


def override_key(override: str) -> str:
    """`+draft.k=3` -> `draft.k`: the key an override sets (or adds, or deletes)."""
    return override.lstrip("+~").split("=", 1)[0]


def _value(overrides: list[str], key: str) -> str:
    return next((o.split("=", 1)[1] for o in overrides if override_key(o) == key), "")


def _keys(cfg) -> list[str]:
    """Every dotted key of a composed config."""
    out = []

    def walk(node, prefix):
        for k in node:
            v = node[k] if not OmegaConf.is_missing(node, k) else None
            path = f"{prefix}{k}"
            out.append(path)
            if OmegaConf.is_dict(v):
                walk(v, path + ".")

    walk(cfg, "")
    return out


def _without(compose, overrides: list[str], key: str):
    """The config the other overrides compose to (their group choices: draft=<name> has its own keys); where
    they do not, what their group choices alone compose to, else the defaults."""
    others = [o for o in overrides if override_key(o) != key]
    for attempt in (others, [o for o in others if "." not in o.split("=", 1)[0]], []):  # then the choices only
        try:
            return compose(config_name="config", overrides=attempt)
        except Exception:  # another bad override: that one has its own error
            continue


GRAMMAR = "key=value, +key=value or ~key (https://hydra.cc/docs/advanced/override_grammar/basic)"


@functools.cache
def _parser():
    """Hydra's override parser, with a config loader over conf/ (a glob sweep lists the groups' options)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(REPO / "conf")))
    return OverridesParser.create(config_loader=loader)


def _parse(override: str):
    """One override as Hydra parses it (raises OverrideParseException)."""
    (parsed,) = _parser().parse_overrides([override])
    return parsed


def parse_problems(overrides: list[str]) -> dict[str, ConfigError]:
    """The overrides Hydra's grammar rejects -> each one's error, naming it with its parser's message."""
    from hydra.errors import OverrideParseException

    errors = {}
    for o in overrides:
        try:
            _parse(o)
        except OverrideParseException as e:
            key, eq, value = o.lstrip("+~").partition("=")
            key, value = (key, value) if eq else ("override", o)
            said = [line for line in str(e).splitlines() if not line.startswith(("See https", "Error parsing"))]
            errors[o] = ConfigError(key, value, f"not an override: {said[0].split(' expecting ')[0]}", GRAMMAR)
    return errors


def is_hydras(override: str) -> bool:
    """Hydra's own override (hydra.<key>=, hydra/<group>=): the launcher's, not the job's."""
    return override_key(override).startswith(("hydra.", "hydra/"))


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs a sweep over `overrides` runs, each as a single run's overrides, in the basic sweeper's
    order (Hydra's own overrides left out). Interval sweeps (Optuna's) have no list of values: each job
    leaves them out and its trials check them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = [_parse(o) for o in overrides if not is_hydras(o)]
    listed = [o for o in parsed if not o.is_interval_sweep()]
    return [job for batch in BasicSweeper.split_arguments(listed, None) for job in batch]


def compose_problems(overrides: list[str]) -> tuple[list[ConfigError], Optional[list[str]]]:
    """Every composition error of `overrides` (Hydra stops at its first: each bad override found is left
    out and the rest composed again) -> (the errors, the overrides that compose together; None when an
    error names no override)."""
    if unparsed := parse_problems(overrides):
        return list(unparsed.values()), [o for o in overrides if o not in unparsed]
    errors, left = [], list(overrides)
    while (problem := compose_problem(left)) is not None:
        errors.append(problem)
        culprit = [o for o in left if override_key(o) == problem.key]
        if not culprit:  # not traceable to one override: what is left is not known to compose
            return errors, None
        left.remove(culprit[0])
    return errors, left


@functools.lru_cache(maxsize=2)
def composed(overrides: tuple[str, ...]):
    """The config `overrides` compose to, as Hydra composes it (raises its composition errors). The last
    two are kept: a check composes a job once for its composition and its plan (0.1 s each)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=list(overrides))
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        return compose(config_name="config", overrides=list(overrides))


def compose_problem(overrides: list[str]) -> Optional[ConfigError]:
    """Compose as Hydra will; a composition error as a ConfigError (None: the config composes)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, MissingConfigException

    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        try:
            composed(tuple(overrides))
            return None
        except MissingConfigException as e:
            text = str(e)
            found = re.search(r"Could not find '([^/']+)/([^']+)'", text)
            if found is None:
                return ConfigError("overrides", " ".join(overrides), text.splitlines()[0])
            group, name = found.groups()
            listed = text.split("Available options", 1)[-1].split("Config search path", 1)[0]
            return ConfigError(group, name, "no such config", re.findall(r"^\t(\S+)$", listed, re.M))
        except ConfigCompositionException as e:
            first = str(e).splitlines()[0]
            if found := re.search(r"Could not override '([^']+)'\. No match in the defaults list", str(e)):
                key = found.group(1)
                value = _value(overrides, key)
                return ConfigError(
                    key,
                    value,
                    "not in the defaults list: a group added on the command line takes a +",
                    f"+{key}={value}",
                )
            if found := re.search(r"Could not override '([^']+)'", first):
                key = found.group(1)
                keys = _keys(_without(compose, overrides, key))
                node = key.rpartition(".")[0]
                siblings = [k for k in keys if node and k.rpartition(".")[0] == node]  # e.g. draft=<name>'s keys
                close = difflib.get_close_matches(key, siblings or keys, n=3)
                return ConfigError(
                    key,
                    _value(overrides, key),
                    "no such key",
                    close or siblings or "a key of the config (python -m pipeline --cfg job lists them)",
                )
            if found := re.match(r"Multiple values for ([^ ]+)\. ", first):  # a group chosen twice
                key = found.group(1)
                given = [o for o in overrides if override_key(o) == key]
                values = ",".join(o.split("=", 1)[1] for o in given)
                if len(given) > 1:
                    plus = "+" if given[0].startswith("+") else ""
                    return ConfigError(key, values, "chosen more than once", f"one; a sweep: -m {plus}{key}={values}")
                return ConfigError(key, values, "another config chose it already", f"{key}=<name>, without the +")
            if found := re.match(r"(?:Ambiguous value for argument|Sweep parameters) '[+~]?([^=]+)=(.*)'", first):
                key, value = found.groups()  # a sweep's values in a single run
                hint = "-m to run a job per value; [a,b] for a list; 'a,b' quoted for a string"
                return ConfigError(key, value, "several values, which only a sweep (-m) takes", hint)
            if found := re.match(r"Error merging override ([^=]+)=(.*)$", first):
                key, value = found.groups()
                cause = str(e.__cause__).splitlines()[0] if e.__cause__ else first
                return ConfigError(key, value, f"wrong type: {cause}")
            return ConfigError("overrides", " ".join(overrides), first)


def group_origin(group: str) -> Optional[tuple[str, str]]:
    """Under a Hydra job: (the group's choice, what chose it: `+experiment=NAME`, `the command line` or `the
    defaults`); None outside one, or where the command line sets the group's keys themselves."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    choice, keys = hc.runtime.choices.get(group), [override_key(o) for o in hc.overrides.task]
    if choice is None or any(k.startswith(f"{group}.") for k in keys):
        return None
    if group in keys:
        return choice, "the command line"
    experiment = hc.runtime.choices.get("experiment")
    recipe = REPO / "conf" / "experiment" / f"{experiment}.yaml"
    if experiment and recipe.is_file() and re.search(rf"override /{group}\s*:", recipe.read_text()):
        return choice, f"+experiment={experiment}"
    return choice, "the defaults"
