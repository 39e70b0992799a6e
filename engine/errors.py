"""One error type for bad input: it names the config key, the bad value and what would be valid."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional


class ConfigError(ValueError):
    """`model.path='/nope.gguf': no such file; valid: an existing .gguf file`."""

    def __init__(self, key: str, value: Any, problem: str, valid: Optional[str | Iterable[str]] = None):
        self.key, self.value, self.problem = key, value, problem
        if valid is not None and not isinstance(valid, str):
            valid = ", ".join(str(v) for v in valid)
        self.valid = valid
        msg = f"{key}={value!r}: {problem}"
        if valid:
            msg += f" (valid: {valid})"
        super().__init__(msg)


class ConfigErrors(ValueError):
    """Several bad values found by one check: the plan reports them all, not the first."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        super().__init__("; ".join(str(e) for e in self.errors))


def raised(check: Callable[..., None], *args: Any) -> list[ConfigError]:
    """The bad values `check(*args)` reports (one ConfigError, or every one of a ConfigErrors); [] when it
    returns: checks run one after another, and the plan lists what all of them found."""
    try:
        check(*args)
    except ConfigErrors as e:
        return list(e.errors)
    except ConfigError as e:
        return [e]
    return []


def raise_all(errors: list[ConfigError]) -> None:
    """Raise the one ConfigError, or ConfigErrors naming them all; return when there are none."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


def check_values(rows: Iterable[tuple]) -> None:
    """rows: (key, value, ok, valid[, problem]) with problem "out of range" by default. Raises the one
    ConfigError, or ConfigErrors naming every row that is not ok; returns when all are."""
    bad = [
        ConfigError(key, value, rest[0] if rest else "out of range", valid)
        for key, value, ok, valid, *rest in rows
        if not ok
    ]
    if len(bad) == 1:
        raise bad[0]
    if bad:
        raise ConfigErrors(bad)


class PlanError(Exception):
    """One or more ConfigErrors found while planning; the message lists them all."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = errors
        lines = [f"  - {e}" for e in errors]
        super().__init__("invalid run configuration:\n" + "\n".join(lines))
