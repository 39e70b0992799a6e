"""Kernel plumbing: whether Triton is importable.

A CPU build may lack Triton: every kernel module then runs its plain-torch reference, and callers
(the loader choosing `model.fused`, the training stage choosing its kernels) ask here rather than a
kernel module. Under TRITON_INTERPRET=1 the kernels run on CPU through Triton's interpreter.
"""

try:
    import triton
except ImportError:  # CPU builds without triton: the reference paths only
    triton = None

__all__ = ["triton"]
