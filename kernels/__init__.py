"""Triton kernels, each with a plain-torch reference beside it (tested under TRITON_INTERPRET=1)."""
