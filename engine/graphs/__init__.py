"""CUDA graph policies: a runner per phase (runner.py) over interchangeable backends (backends.py),
assembled per run in one memory pool (graph_set.py)."""
