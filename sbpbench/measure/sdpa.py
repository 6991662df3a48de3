"""Which scaled-dot-product-attention kernel a step ran, and forcing one.

`RecordingSdpaBackends`: a TorchFunctionMode that, for each call of
torch.nn.functional.scaled_dot_product_attention (transformers' sdpa attention and StreamBP's own
attention function both call it), watches the ATen ops the call dispatches to with a
TorchDispatchMode and names the kernel that ran. Asking the dispatcher beforehand
(`torch._fused_sdp_choice`) would not do: StreamBP's lower-right causal bias (CausalBias) bypasses
that choice and calls the flash or efficient kernel itself, or materialises its mask when neither is
enabled. No fused op seen means the math path (composite ops: matmul, softmax).

`forcing_sdpa_backend(name)`: torch.nn.attention.sdpa_kernel with that one backend around the
block ("auto": nothing forced). A call no enabled kernel can run raises RuntimeError
(`is_no_kernel_error` recognises it).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# the fused ATen ops SDPA dispatches to, by kernel (CausalBias calls the last of flash/efficient directly)
_KERNEL_OPS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_flash_attention_forward": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_efficient_attention_forward": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
# what torch raises when every enabled kernel refuses a call (CUDA, CPU)
_NO_KERNEL = ("No available kernel", "No viable backend for scaled_dot_product_attention")


class _FusedOps(TorchDispatchMode):
    """The kernels of the fused attention ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.kernels: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kernel = _KERNEL_OPS.get(func.__name__.split(".")[0])
        if kernel is not None:
            self.kernels.add(kernel)
        return func(*args, **(kwargs or {}))


class RecordingSdpaBackends(TorchFunctionMode):
    """with RecordingSdpaBackends() as seen: step(); seen.names() -> "flash" or "efficient+flash"."""

    def __init__(self):
        super().__init__()
        self.kernels: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        with _FusedOps() as seen:
            out = func(*args, **kwargs)
        self.kernels |= seen.kernels or {"math"}
        return out

    def names(self) -> str:
        """The kernels seen, sorted and '+'-joined (the estimator's attention_kernel format)."""
        return "+".join(sorted(self.kernels))


def forcing_sdpa_backend(name: str):
    """sdpa_kernel([that backend]) for a backend name of config/sdpa.py; "auto": nothing forced."""
    return nullcontext() if name == "auto" else sdpa_kernel([BACKENDS[name]])


def is_no_kernel_error(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _NO_KERNEL)
