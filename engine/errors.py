"""One error type for bad input: it names the config key, the bad value and what would be valid."""

from __future__ import annotations

from typing import Any, Iterable, Optional


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
