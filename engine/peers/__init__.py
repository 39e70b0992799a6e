"""Peers: other engines measured on the same prompts (Hugging Face generate, a compiled decoder)."""
