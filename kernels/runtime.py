"""Kernel plumbing: whether Triton is importable, and whether kernels launch with programmatic dependent launch.

A CPU build may lack Triton: every kernel module then runs its plain-torch reference, and callers
(the loader choosing `model.fused`, the training stage choosing its kernels) ask here rather than a
kernel module. Under TRITON_INTERPRET=1 the kernels run on CPU through Triton's interpreter.

`pdl(device)`: whether the decode-path kernels launch with programmatic dependent launch (Hopper or
later), as the loader set it (`set_pdl`, from `model.pdl`; `pdl_pays` is its default). Each kernel waits
for the one before (griddepcontrol.wait) before it reads or writes anything that kernel may touch, so its
launch, and the weight lines it prefetches into L2, overlap that kernel's tail. The arithmetic is the
same either way: outputs are bitwise equal.
"""

import functools

try:
    import triton
except ImportError:  # CPU builds without triton: the reference paths only
    triton = None

__all__ = ["triton", "pdl", "pdl_pays", "set_pdl", "await_prior"]

_PDL = False  # the loaded target's choice (set_pdl); off until a target asks for it

if triton is not None:
    import triton.language as tl

    @triton.jit
    def await_prior(USE_GDC: tl.constexpr):
        """Under programmatic dependent launch: wait until the kernel before has finished and flushed, then
        let the next kernel launch (its own wait holds it until this one ends). Call it before the first
        load or store of anything another kernel writes or reads."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


def pdl(device) -> bool:
    """Whether kernels on `device` (a torch.device) launch with programmatic dependent launch."""
    return _PDL and supports_pdl(device)


def set_pdl(on: bool) -> bool:
    """Launch this process's kernels with programmatic dependent launch (where supported) or not; the old
    setting is returned."""
    global _PDL
    old, _PDL = _PDL, bool(on)
    return old


def pdl_pays(weight_bytes: int, device) -> bool:
    """`model.pdl`'s default: on where a layer's largest projection (weight_bytes) fits in half the L2.
    Measured on an H200: SmolLM2-135M (3.4 MiB) decodes 23% faster with it, Llama-3.1-8B shapes
    (224 MiB) 6% slower; the sizes between are unmeasured."""
    if not supports_pdl(device):
        return False
    import torch

    return weight_bytes <= torch.cuda.get_device_properties(device).L2_cache_size // 2


def supports_pdl(device) -> bool:
    """Triton kernels can launch with programmatic dependent launch on `device`: Hopper or later."""
    return triton is not None and device.type == "cuda" and _capability(device.index) >= 9


@functools.cache
def _capability(index) -> int:
    """The device's major compute capability; 0 on a host without CUDA (a GPU run planned on a CPU)."""
    import torch

    return torch.cuda.get_device_capability(index)[0] if torch.cuda.is_available() else 0
