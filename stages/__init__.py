"""Pipeline stages, one module each; importing this package registers them (see stages.base)."""

from stages import eval, load  # noqa: F401
