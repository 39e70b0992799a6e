"""Pipeline stages, one module each; importing this package registers them (see stages.base)."""

from stages import capture_graphs, configure_aux_capture, eval, load, serve, train_draft  # noqa: F401
