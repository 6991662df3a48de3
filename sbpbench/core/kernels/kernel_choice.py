"""Which kernel runs an offset-causal chunk: a name, or a picker that names one per call. Never a timing.

`chunk_attention` (StreamConfig's knob) is one of:
    "auto"         the fixed rule the estimator models: the lower-right SDPA path, every call
    "lower-right"  the reference every candidate is checked against (attention.py)
    a candidate    "split", "flex", "fa3", "fa4" (chunk_kernels.py): every call it supports, the
                   reference the rest (a sliding window the split cannot express)
    a picker       pick(call) -> one of the names above or a ChunkKernel, asked per call: e.g. a lookup
                   in a table of kernels measured on this GPU (the runner's, runner/kernel_table.py)
A name the device lacks is a ValueError before any work (`check_chunk_attention`). A kernel a
picker names but the device or the call cannot run gives way to the reference.

What is fast on a GPU is measured outside the step, by a benchmark that writes such a table:
choosing by timing inside a step would fight every lazy cache the step's kernels keep (a cuDNN
graph per shape and stride, a compile per grad mode).
The hooks' `on_kernel` is told the name of each kernel that ran, `on_chunk_call` each call's
`CallShape`: what a kernel builds for (sizes, strides, dtype, grad mode), so that a caller can build
those before it times steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .chunk_kernels import ChunkCall, ChunkKernel, default_kernels

AUTO = "auto"
LOWER_RIGHT = "lower-right"
# choices of stream_backward(chunk_attention=...) by name, in the order the settings table lists them
CHUNK_ATTENTION_CHOICES = (AUTO, LOWER_RIGHT, "split", "flex", "fa3", "fa4")

KernelPicker = Callable[[ChunkCall], "str | ChunkKernel"]  # a call -> the kernel to run it
Reference = Callable[[ChunkCall], torch.Tensor]  # the lower-right SDPA path (attention.py)

# The process's candidates by name: one object each, so a compiled kernel compiles once per process.
KERNELS: dict[str, ChunkKernel] = default_kernels()


@dataclass(frozen=True)
class TensorLayout:
    """What a kernel's cached graph depends on, of one tensor: sizes, strides, whether it needs a
    gradient. cuDNN keys its attention graphs on sizes and strides; a compiled kernel guards on them
    and on requires_grad."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorLayout:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.requires_grad)

    def make(self, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random values in a tensor of these sizes and strides (the smallest storage that holds
        them), without requires_grad."""
        span = 1 + sum((n - 1) * step for n, step in zip(self.size, self.stride))  # elements the layout reaches
        storage = torch.randn(span, dtype=dtype, device=device, generator=generator)
        return storage.as_strided(self.size, self.stride)  # stride 0 (an expanded gradient) included


@dataclass(frozen=True)
class CallShape:
    """A chunk call without its values: the layouts of query (B, H, c, hd), key and value
    (B, h_kv, n, hd), dtype, device and the grad mode it ran in, the positions it covers, and the
    layout of the gradient its output received (None: none yet, or none in this grad mode).
    Two calls of one CallShape make the same graph builds; `build_key` is what a forward's are keyed by."""

    query: TensorLayout
    key: TensorLayout
    value: TensorLayout
    dtype: torch.dtype
    device: torch.device
    grad_enabled: bool
    query_start: int
    key_start: int
    scale: float | None
    window: int | None
    grad_out: TensorLayout | None = None

    @classmethod
    def of(cls, call: ChunkCall) -> CallShape:
        q, k, v = call.query, call.key, call.value
        return cls(
            TensorLayout.of(q), TensorLayout.of(k), TensorLayout.of(v), q.dtype, q.device, torch.is_grad_enabled(),
            call.query_start, call.key_start, call.scale, call.window,
        )  # fmt: skip

    @property
    def build_key(self) -> tuple:
        """(layouts, dtype, device, grad mode, window): a new one is a new graph; positions are not."""
        return (self.query, self.key, self.value, self.dtype, self.device, self.grad_enabled, self.window)

    def make_call(self, generator: torch.Generator | None = None) -> ChunkCall:
        """A call of this shape on random values, each tensor with these sizes and strides (the
        smallest storage that holds them) and requires_grad as recorded."""

        def tensor(layout: TensorLayout) -> torch.Tensor:
            made = layout.make(self.dtype, self.device, generator)
            return made.requires_grad_(layout.requires_grad and self.grad_enabled)

        return ChunkCall(
            tensor(self.query), tensor(self.key), tensor(self.value), self.query_start, self.key_start, self.scale,
            self.window,
        )  # fmt: skip


def check_chunk_attention(setting, device: torch.device | None = None) -> None:
    """ValueError, before any work, for an unknown name or a named kernel the device lacks; a picker
    is checked per call (it may name any kernel)."""
    if callable(setting):
        return
    if setting not in CHUNK_ATTENTION_CHOICES:
        raise ValueError(
            f"unknown chunk_attention {setting!r}; choose from {', '.join(CHUNK_ATTENTION_CHOICES)} or pass a picker"
        )
    if device is None or setting in (AUTO, LOWER_RIGHT):
        return
    reason = KERNELS[setting].unavailable(device)
    if reason is not None:
        raise ValueError(f"chunk_attention={setting} cannot run on {device}: {reason}; use auto or {LOWER_RIGHT}")


def select(call: ChunkCall, setting) -> ChunkKernel | None:
    """The kernel `setting` gives this call; None for the reference."""
    picked = setting(call) if callable(setting) else setting
    if picked in (AUTO, LOWER_RIGHT):
        return None
    kernel = KERNELS[picked] if isinstance(picked, str) else picked
    if callable(setting) and kernel.unavailable(call.query.device) is not None:
        return None  # a named setting was checked at the step's start
    return kernel if kernel.unsupported(call) is None else None


def run_chunk(
    call: ChunkCall,
    reference: Reference,
    *,
    setting=AUTO,
    on_kernel: Callable[[str], None] | None = None,
    on_call: Callable[[CallShape], None] | None = None,
) -> torch.Tensor:
    """Attention of one offset-causal chunk by the kernel `setting` (chunk_attention) gives.
    on_kernel(name) is told the kernel that ran; on_call(shape) the call's shape as it runs, and
    again, with the gradient's layout, when its output's gradient arrives (a hook on the output)."""
    kernel = select(call, setting)
    if on_kernel is not None:
        on_kernel(LOWER_RIGHT if kernel is None else kernel.name)
    out = reference(call) if kernel is None else kernel.run(call)
    if on_call is not None:
        shape = CallShape.of(call)
        on_call(shape)
        if out.requires_grad:
            out.register_hook(lambda grad: on_call(replace(shape, grad_out=TensorLayout.of(grad))))
    return out
