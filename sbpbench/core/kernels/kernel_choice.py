"""Which kernel runs an offset-causal chunk: forced by name, or the fastest measured on first use.

`chunk_attention` (stream_backward's argument) is "auto", `LOWER_RIGHT` (SDPA with a lower-right
causal bias, the reference every candidate is checked against) or a candidate's name
(chunk_kernels.py). Forced: the candidate runs every call it supports, and the reference the rest
(a sliding window the split cannot express). Auto, on a CUDA device: a shape class not yet chosen
is measured forward and backward: the reference and each candidate that can run it, on the
call's own tensors (in a step) or on random ones of its shape (the tuning pass). One run checks a
candidate's values and warms it up; `reps` timed runs follow. The fastest that agrees is kept, in a
`ChoiceCache`, under the device, the torch and cuDNN versions, the candidates present and the
shape class. Off a GPU, and where SDPA is narrowed to
some kernels (sdpa_kernel), auto keeps the reference.

Agreement. In fp64 and fp32 a candidate must match the reference to a few roundings. In bf16 and
fp16 both are judged against an fp32 run of the reference: the candidate may be AGREEMENT_FACTOR
times as far from it as the reference itself is, in the relative Frobenius norm and in the largest
element. The largest element is what catches a mask off by one key: its error sits in a few rows
and columns, which a norm over the whole tensor averages away.

When auto measures (the step's hooks' `kernel_mode`): MEASURE (the default, a training loop: the
first call of a class measures it), CACHED (a cached choice or the reference, never a timing) or
REFERENCE (the reference, whatever is cached). A benchmark records the calls a step makes (the
hooks' `on_chunk_call`), then measures their classes and warms every distinct shape of the chosen kernels in one untimed
pass (`tune_chunk_calls`): a cuDNN graph is built, and a compiled kernel specialised, once per new
shape, which a timed step must not pay. An out-of-memory while measuring a class is remembered for
the life of the chooser: that class runs the reference, untimed, from then on.

The process has a default `KernelChooser`, whose cache holds choices in memory; a caller passes
its own in the step's hooks (the runner's keeps them in a JSON file; core does no file I/O). The
hooks' `on_kernel` is told the name of each kernel that ran.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .chunk_kernels import ChunkCall, ChunkKernel, default_kernels

AUTO = "auto"
LOWER_RIGHT = "lower-right"
# choices of stream_backward(chunk_attention=...), in the order the settings table lists them
CHUNK_ATTENTION_CHOICES = (AUTO, LOWER_RIGHT, "split", "flex", "fa3", "fa4")

AUTO_DEVICE_TYPES = ("cuda",)  # where auto measures; elsewhere it keeps the reference
# auto_mode: the first call of a class measures it | cached choice or reference | reference only
MEASURE, CACHED, REFERENCE = "measure", "cached", "reference"
# How far from an fp32 run of the reference a bf16/fp16 candidate may be, in multiples of the
# reference's own distance from it. A kernel with the same math rounds differently but alike (1-2x
# measured on a CPU); a mask one key off is 6x and more in its largest element.
AGREEMENT_FACTOR = 4.0
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


def largest_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference|, in fp64: an error confined to a few elements."""
    difference = (ours.double() - reference.double()).abs().max()
    return float(difference / reference.double().abs().max().clamp_min(torch.finfo(torch.float64).tiny))


def agreement_tolerance(dtype: torch.dtype) -> float:
    """Largest relative (Frobenius) difference from the reference a candidate may show in fp64 or
    fp32: a few roundings of the dtype. bf16 and fp16 are judged by `Judge` against fp32 instead."""
    return {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 4 * 2.0**-8)


Outputs = tuple[torch.Tensor, ...]  # out, dQ, dK, dV of one forward and backward


class Judge:
    """Whether a candidate's outputs agree with the reference's on one call.

    fp64 / fp32: within agreement_tolerance of the reference's outputs. bf16 / fp16: measured
    against `exact` (the reference run in fp32 on the same values), each output within
    AGREEMENT_FACTOR times the reference's own error there, by both norms."""

    def __init__(self, expected: Outputs, exact: Outputs | None = None):
        self.expected, self.exact = expected, exact
        if exact is not None:
            own = [(relative_error(e, x), largest_error(e, x)) for e, x in zip(expected, exact)]
            floor = 2.0**-10  # a reference that happens to round almost exactly still leaves rounding room
            self.bounds = [(AGREEMENT_FACTOR * max(f, floor), AGREEMENT_FACTOR * max(m, floor)) for f, m in own]

    def error(self, got: Outputs) -> float | None:
        """None when `got` agrees; else its worst error as a multiple of what was allowed."""
        if self.exact is None:
            tolerance = agreement_tolerance(self.expected[0].dtype)
            worst = max(relative_error(g, e) for g, e in zip(got, self.expected)) / tolerance
        else:
            worst = max(
                max(relative_error(g, x) / fro, largest_error(g, x) / big)
                for g, x, (fro, big) in zip(got, self.exact, self.bounds)
            )
        return None if worst <= 1 else worst


@dataclass
class KernelChooser:
    kernels: dict[str, ChunkKernel] = field(default_factory=default_kernels)
    cache: ChoiceCache = field(default_factory=MemoryCache)
    timer: Timer = cuda_event_timer
    reps: int = 3  # timed runs per kernel after the one that checks its values, median kept
    device_types: tuple[str, ...] = AUTO_DEVICE_TYPES  # where auto measures (tests: "cpu")
    out_of_memory: set[str] = field(default_factory=set)  # classes with no memory to measure: the reference
    timings: int = 0  # timed runs so far (tests count them)

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
        if not may_time or key in self.out_of_memory:
            return LOWER_RIGHT
        try:
            best = self._measure(call, reference, candidates)
        except torch.OutOfMemoryError:  # timing holds one more backward; the step itself may still fit
            self.out_of_memory.add(key)
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
        exact = None
        if call.query.dtype in (torch.bfloat16, torch.float16):
            wide = call.with_tensors(*(t.float() for t in (call.query, call.key, call.value)))
            exact = _forward_backward(reference, wide, grad_out.float())
        judge = Judge(expected, exact)
        times = {LOWER_RIGHT: self._time(reference, call, grad_out)}
        for name in candidates:
            run = self.kernels[name].run
            try:
                off = judge.error(_forward_backward(run, call, grad_out))
                if off is not None:
                    warnings.warn(
                        f"attention kernel {name} differs from {LOWER_RIGHT} by {off:.1f}x the error allowed "
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
        self.timings += self.reps
        seconds = sorted(self.timer(lambda: _forward_backward(run, call, grad_out)) for _ in range(self.reps))
        return seconds[len(seconds) // 2]


def _forward_backward(run: Callable, call: ChunkCall, grad_out: torch.Tensor) -> Outputs:
    """out, dQ, dK, dV of one run on the call's tensors (detached leaves, no copies)."""
    leaves = [t.detach().requires_grad_() for t in (call.query, call.key, call.value)]
    with torch.enable_grad():
        out = run(call.with_tensors(*leaves))
        grads = torch.autograd.grad(out, leaves, grad_out)
    return (out.detach(), *grads)


@dataclass(frozen=True)
class CallShape:
    """A chunk call without its values: what the tuning pass needs to measure its class and to
    warm its shape. `setting` is the chunk_attention it ran under; `reference` the path it had."""

    query: tuple[int, ...]  # (B, H, c, hd)
    key: tuple[int, ...]  # (B, h_kv, n, hd)
    value: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    query_start: int
    key_start: int
    scale: float | None
    window: int | None
    setting: str
    reference: Reference = field(compare=False, hash=False)

    @classmethod
    def of(cls, call: ChunkCall, setting: str, reference: Reference) -> CallShape:
        q, k, v = call.query, call.key, call.value
        return cls(
            tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, call.query_start,
            call.key_start, call.scale, call.window, setting, reference,
        )  # fmt: skip

    def random_call(self) -> ChunkCall:
        """A call of this shape on random values (seeded: the same values each time)."""
        generator = torch.Generator(self.device).manual_seed(0)

        def tensor(shape):
            return torch.randn(shape, generator=generator, dtype=self.dtype, device=self.device)

        return ChunkCall(
            tensor(self.query), tensor(self.key), tensor(self.value), self.query_start, self.key_start, self.scale,
            self.window,
        )  # fmt: skip


@dataclass
class Tuning:
    """What `tune_chunk_calls` did: the kernel per call shape, and how many shapes it warmed."""

    kernels: dict[CallShape, str] = field(default_factory=dict)
    warmed: int = 0

    def names(self) -> str:
        return "+".join(sorted(set(self.kernels.values())))


DEFAULT_CHOOSER = KernelChooser()  # the process's: its choices kept in memory across steps


def check_chunk_attention(name: str, device: torch.device | None = None, chooser: KernelChooser | None = None) -> None:
    """ValueError, before any work, for an unknown name or a forced kernel the device lacks."""
    if name not in CHUNK_ATTENTION_CHOICES:
        raise ValueError(f"unknown chunk_attention {name!r}; choose from {', '.join(CHUNK_ATTENTION_CHOICES)}")
    if device is None or name in (AUTO, LOWER_RIGHT):
        return
    reason = (chooser or DEFAULT_CHOOSER).kernels[name].unavailable(device)
    if reason is not None:
        raise ValueError(f"chunk_attention={name} cannot run on {device}: {reason}; use auto or {LOWER_RIGHT}")


def tune_chunk_calls(shapes, chooser: KernelChooser | None = None) -> Tuning:
    """Measure the shape class of each recorded call not yet chosen, then run the chosen kernel once
    on every distinct shape (forward and backward, random values) so that no later step builds a
    cuDNN graph or specialises a compiled kernel. Calls under a forced kernel are only warmed.
    Returns the kernel of each shape; the caller times the whole pass."""
    chooser = chooser or DEFAULT_CHOOSER
    tuning, warmed = Tuning(), set()
    for shape in shapes:
        call = shape.random_call()
        name = select(call, shape.reference, shape.setting, MEASURE, chooser)
        tuning.kernels[shape] = name
        dims = (shape.query, shape.key, shape.value, shape.dtype, shape.device, shape.window, name)
        # the reference builds nothing per shape (flash / efficient kernels); starts change no graph
        if name != LOWER_RIGHT and dims not in warmed:
            warmed.add(dims)
            grad_out = torch.randn_like(call.query[..., : call.value.shape[-1]])
            try:
                _forward_backward(chooser.kernels[name].run, call, grad_out)
                tuning.warmed += 1
            except torch.OutOfMemoryError:
                warnings.warn(f"no memory to warm {name} on {shape_class(call)}; a step may build it", stacklevel=2)
        del call
    return tuning


def _auto_may_leave_reference() -> bool:
    """Auto considers candidates only where SDPA may use all its CUDA kernels: a block that narrows
    them (sdpa_kernel, --sdpa-backend) asked for that kernel, not for a faster one."""
    backends = torch.backends.cuda
    return backends.flash_sdp_enabled() and backends.cudnn_sdp_enabled() and backends.mem_efficient_sdp_enabled()


def run_chunk(
    call: ChunkCall,
    reference: Reference,
    *,
    setting: str = AUTO,
    mode: str = MEASURE,
    chooser: KernelChooser | None = None,
    on_kernel: Callable[[str], None] | None = None,
    on_call: Callable[[CallShape], None] | None = None,
) -> torch.Tensor:
    """Attention of one offset-causal chunk by the kernel `setting` (chunk_attention) picks; auto
    asks `chooser` in `mode`. on_kernel(name) is told the kernel that ran, on_call(shape) the call."""
    chooser = chooser or DEFAULT_CHOOSER
    if on_call is not None:
        on_call(CallShape.of(call, setting, reference))
    name = select(call, reference, setting, mode, chooser)
    if on_kernel is not None:
        on_kernel(name)
    return reference(call) if name == LOWER_RIGHT else chooser.kernels[name].run(call)


def select(call: ChunkCall, reference: Reference, setting: str, mode: str, chooser: KernelChooser) -> str:
    if setting == LOWER_RIGHT:
        return LOWER_RIGHT
    if setting != AUTO:
        kernel = chooser.kernels[setting]
        return setting if kernel.unsupported(call) is None else LOWER_RIGHT
    if call.query.device.type not in chooser.device_types or not _auto_may_leave_reference():
        return LOWER_RIGHT
    if mode == REFERENCE or _is_fake(call.query):
        return LOWER_RIGHT
    return chooser.choose(call, reference, may_time=mode == MEASURE)


def _is_fake(tensor: torch.Tensor) -> bool:
    """A fake tensor (the memory simulator) has no values to time."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)
