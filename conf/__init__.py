"""Hydra config tree (a package so that `hydra.main(config_path="../conf")` and tests find it)."""
