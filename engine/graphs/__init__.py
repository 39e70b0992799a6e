"""A graph library that knows nothing of speculation: capture a program split at its eager marks
(breakable.py), the backends (backends.py), and a runner over buckets, padding and counters (runner.py)."""
