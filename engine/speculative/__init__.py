"""Speculative decoding: the round, its graphs, generation, verification, sampling's policies."""
