"""Which kernel runs an offset-causal chunk: forced by name, or the fastest measured on first use.

`chunk_attention` (stream_backward's argument) is "auto", `LOWER_RIGHT` (SDPA with a lower-right
causal bias, the reference every candidate is checked against) or a candidate's name
(chunk_kernels.py). Forced: the candidate runs every call it supports, and the reference the rest
(a sliding window the split cannot express). Auto, on a CUDA device: the first call of a shape
class runs the reference and each candidate that can run it, forward and backward on the call's
own tensors (no copies; one backward's dQ/dK/dV on top). One run checks a candidate's values
against the reference's and warms it up; `reps` timed runs follow. The fastest that agrees is
kept, in a `ChoiceCache`, under the device, the torch and cuDNN versions, the candidates present
and the shape class. Off a GPU, and where SDPA is narrowed to some kernels (sdpa_kernel), auto
keeps the reference.

The process has one `KernelChooser`. Its cache holds choices in memory unless a caller installs
another (`set_choice_cache`: the runner keeps them in a JSON file; core does no file I/O).
`observe_chunk_kernels()` collects the names of the kernels that ran; `kernel_timing(False)` keeps
a block from timing (a measured memory step: an uncached shape class then runs the reference).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .chunk_kernels import ChunkCall, ChunkKernel, default_kernels

AUTO = "auto"
LOWER_RIGHT = "lower-right"
# choices of stream_backward(chunk_attention=...), in the order the settings table lists them
CHUNK_ATTENTION_CHOICES = (AUTO, LOWER_RIGHT, "split", "flex", "fa3", "fa4")

AUTO_DEVICE_TYPES = ("cuda",)  # where auto measures; elsewhere it keeps the reference
Reference = Callable[[ChunkCall], torch.Tensor]  # the lower-right SDPA path (attention.py)
Timer = Callable[[Callable[[], object]], float]  # seconds one run of fn takes


class ChoiceCache(Protocol):
    def get(self, key: str) -> str | None: ...

    def put(self, key: str, name: str) -> None: ...


class MemoryCache:
    """Choices for the life of the process."""

    def __init__(self) -> None:
        self.choices: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        return self.choices.get(key)

    def put(self, key: str, name: str) -> None:
        self.choices[key] = name


def cuda_event_timer(fn: Callable[[], object]) -> float:
    """Seconds of one run of fn on the current CUDA stream, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _bucket(n: int) -> int:
    """n rounded up to a power of two: shapes within a factor of 2 share a choice."""
    return 1 << max(0, n - 1).bit_length()


def shape_class(call: ChunkCall) -> str:
    """What a choice is valid for: batch, heads, key heads, head dim, dtype, query and prefix
    lengths to a power of two, and whether a window cuts the keys."""
    batch, heads, num_queries, head_dim = call.query.shape
    prefix = call.num_keys - num_queries
    window = "window" if call.window is not None else "full"
    dtype = str(call.query.dtype).removeprefix("torch.")
    return (
        f"B{batch} H{heads} KV{call.key.shape[1]} hd{head_dim} {dtype} "
        f"c<={_bucket(num_queries)} prefix<={_bucket(prefix)} {window}"
    )


@functools.lru_cache(maxsize=16)  # asked once per chunk call
def device_class(device: torch.device, candidates: tuple[str, ...]) -> str:
    """The device, the versions a kernel's speed depends on, and the candidates installed."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return f"{name} | torch {torch.__version__} | cudnn {cudnn} | {'+'.join(candidates) or 'none'}"


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """|ours - reference| / |reference|, Frobenius norms, in fp64."""
    difference = (ours.double() - reference.double()).norm()
    return float(difference / reference.double().norm().clamp_min(torch.finfo(torch.float64).tiny))


def agreement_tolerance(dtype: torch.dtype) -> float:
    """Largest relative (Frobenius) difference from the reference a candidate may show: a few
    roundings of the dtype (bf16 has 8 mantissa bits: 2^-8 = 0.004)."""
    return {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 4 * 2.0**-8)


@dataclass
class KernelChooser:
    kernels: dict[str, ChunkKernel] = field(default_factory=default_kernels)
    cache: ChoiceCache = field(default_factory=MemoryCache)
    timer: Timer = cuda_event_timer
    reps: int = 3  # timed runs per kernel after the one that checks its values, median kept

    def runnable(self, call: ChunkCall) -> list[str]:
        device = call.query.device
        return [
            name
            for name, kernel in self.kernels.items()
            if kernel.unavailable(device) is None and kernel.unsupported(call) is None
        ]

    def choose(self, call: ChunkCall, reference: Reference, *, may_time: bool = True) -> str:
        """The kernel for this call: cached for its shape class, else measured (may_time), else the
        reference."""
        candidates = self.runnable(call)
        if not candidates:
            return LOWER_RIGHT
        key = f"{device_class(call.query.device, tuple(candidates))} | {shape_class(call)}"
        cached = self.cache.get(key)
        if cached in (LOWER_RIGHT, *candidates):
            return cached
        if not may_time:
            return LOWER_RIGHT
        try:
            best = self._measure(call, reference, candidates)
        except torch.OutOfMemoryError:  # timing holds one more backward; the step itself may still fit
            warnings.warn(
                f"no memory to time attention kernels on {shape_class(call)}; {LOWER_RIGHT} runs, untimed",
                stacklevel=2,
            )
            return LOWER_RIGHT
        self.cache.put(key, best)
        return best

    def _measure(self, call: ChunkCall, reference: Reference, candidates: list[str]) -> str:
        grad_out = torch.randn(
            call.query.shape[:3] + call.value.shape[-1:],
            generator=torch.Generator(call.query.device).manual_seed(0),
            dtype=call.query.dtype,
            device=call.query.device,
        )
        expected = _forward_backward(reference, call, grad_out)
        times = {LOWER_RIGHT: self._time(reference, call, grad_out)}
        tolerance = agreement_tolerance(call.query.dtype)
        for name in candidates:
            run = self.kernels[name].run
            try:
                got = _forward_backward(run, call, grad_out)
                errors = [relative_error(g, e) for g, e in zip(got, expected)]
                if max(errors) > tolerance:
                    warnings.warn(
                        f"attention kernel {name} differs from {LOWER_RIGHT} by {max(errors):.1e} (relative) "
                        f"on {shape_class(call)}; not used",
                        stacklevel=2,
                    )
                    continue
                times[name] = self._time(run, call, grad_out)
            except torch.OutOfMemoryError:
                raise  # not the kernel's fault: the measurement as a whole cannot run here
            except (RuntimeError, NotImplementedError, ValueError, AssertionError) as error:
                warnings.warn(f"attention kernel {name} failed on {shape_class(call)}: {error}; not used", stacklevel=2)
        return min(times, key=times.__getitem__)

    def _time(self, run: Callable, call: ChunkCall, grad_out: torch.Tensor) -> float:
        """Median of `reps` runs; the run that checked the kernel's values was its warm-up
        (compilation, cuDNN plan building)."""
        seconds = sorted(self.timer(lambda: _forward_backward(run, call, grad_out)) for _ in range(self.reps))
        return seconds[len(seconds) // 2]


def _forward_backward(run: Callable, call: ChunkCall, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """out, dQ, dK, dV of one run on the call's tensors (detached leaves, no copies)."""
    leaves = [t.detach().requires_grad_() for t in (call.query, call.key, call.value)]
    with torch.enable_grad():
        out = run(call.with_tensors(*leaves))
        grads = torch.autograd.grad(out, leaves, grad_out)
    return (out.detach(), *grads)


_chooser = KernelChooser()
_setting: ContextVar[str] = ContextVar("chunk_attention", default=AUTO)
_may_time: ContextVar[bool] = ContextVar("chunk_kernel_timing", default=True)
_observers: list[set[str]] = []


def check_chunk_attention(name: str, device: torch.device | None = None) -> None:
    """ValueError, before any work, for an unknown name or a forced kernel the device lacks."""
    if name not in CHUNK_ATTENTION_CHOICES:
        raise ValueError(f"unknown chunk_attention {name!r}; choose from {', '.join(CHUNK_ATTENTION_CHOICES)}")
    if device is None or name in (AUTO, LOWER_RIGHT):
        return
    reason = _chooser.kernels[name].unavailable(device)
    if reason is not None:
        raise ValueError(f"chunk_attention={name} cannot run on {device}: {reason}; use auto or {LOWER_RIGHT}")


@contextmanager
def chunk_attention(name: str) -> Iterator[None]:
    """Within the block, chunks run with this choice (CHUNK_ATTENTION_CHOICES)."""
    check_chunk_attention(name)
    token = _setting.set(name)
    try:
        yield
    finally:
        _setting.reset(token)


@contextmanager
def kernel_timing(allowed: bool) -> Iterator[None]:
    """allowed=False: no candidate is timed within the block; an uncached shape class runs the
    reference (a measured step's peak memory and time then hold no timing runs)."""
    token = _may_time.set(allowed)
    try:
        yield
    finally:
        _may_time.reset(token)


@contextmanager
def observe_chunk_kernels() -> Iterator[set[str]]:
    """The yielded set collects the name of each kernel that ran a chunk call in the block
    (LOWER_RIGHT included). Nests."""
    seen: set[str] = set()
    _observers.append(seen)
    try:
        yield seen
    finally:
        _observers.remove(seen)


def set_choice_cache(cache: ChoiceCache) -> ChoiceCache:
    """Keep auto's choices in `cache` from now on; returns the previous cache."""
    previous, _chooser.cache = _chooser.cache, cache
    return previous


@contextmanager
def using_chooser(chooser: KernelChooser) -> Iterator[KernelChooser]:
    """Within the block the process uses `chooser` (tests: stand-in kernels, a fake clock)."""
    global _chooser
    previous, _chooser = _chooser, chooser
    try:
        yield chooser
    finally:
        _chooser = previous


def _auto_may_leave_reference() -> bool:
    """Auto considers candidates only where SDPA may use all its CUDA kernels: a block that narrows
    them (sdpa_kernel, --sdpa-backend) asked for that kernel, not for a faster one."""
    backends = torch.backends.cuda
    return backends.flash_sdp_enabled() and backends.cudnn_sdp_enabled() and backends.mem_efficient_sdp_enabled()


def run_chunk(call: ChunkCall, reference: Reference) -> torch.Tensor:
    """Attention of one offset-causal chunk by the kernel the current setting picks."""
    name = select(call, reference)
    for seen in _observers:
        seen.add(name)
    return reference(call) if name == LOWER_RIGHT else _chooser.kernels[name].run(call)


def select(call: ChunkCall, reference: Reference) -> str:
    setting = _setting.get()
    if setting == LOWER_RIGHT:
        return LOWER_RIGHT
    if setting != AUTO:
        kernel = _chooser.kernels[setting]
        return setting if kernel.unsupported(call) is None else LOWER_RIGHT
    if call.query.device.type not in AUTO_DEVICE_TYPES or not _auto_may_leave_reference() or _is_fake(call.query):
        return LOWER_RIGHT
    return _chooser.choose(call, reference, may_time=_may_time.get())


def _is_fake(tensor: torch.Tensor) -> bool:
    """A fake tensor (the memory simulator) has no values to time."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)
