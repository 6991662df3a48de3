"""The candidates for StreamBP's chunk attention measured on the calls a step makes, per shape class.

`step_call_shapes` runs one StreamBP step of a point on one decoder layer (every layer makes the
same calls) under the lower-right reference and keeps each call's CallShape: sizes, strides,
dtype, grad mode and the layout of its output's gradient, as the step made them. The checkpoint
pass and the rebuilds call without grad, the layer backward with it. `measure_classes` groups them
by shape class (kernel_table.py) and, per class, runs the reference and each candidate on the
class's largest call, made with those layouts, in both grad modes:
    first run   its values checked against the reference's (Judge); its seconds beyond a steady
                run are its build on a new shape (a cuDNN graph, a compile the first time);
    reps runs   the steady seconds: the forward without grad, and forward and backward with it.
The fastest candidate that agrees is the class's kernel. Timing is by CUDA events on a GPU and by
the host clock elsewhere; no StreamBP step measures a kernel.

Agreement. In fp64 and fp32 a candidate must match the reference to a few roundings. In bf16 and
fp16 both are judged against an fp32 run of the reference: the candidate may be AGREEMENT_FACTOR
times as far from it as the reference itself is, in the relative Frobenius norm and in the largest
element. The largest element is what catches a mask off by one key: its error sits in a few rows
and columns, which a norm over the whole tensor averages away.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..core.internal import LOWER_RIGHT, CallShape, ChunkCall, lower_right_attention
from .kernel_table import class_of_shape

# How far from an fp32 run of the reference a bf16/fp16 candidate may be, in multiples of the
# reference's own distance from it. A kernel with the same math rounds differently but alike (1-2x
# measured on a CPU); a mask one key off is 6x and more in its largest element.
AGREEMENT_FACTOR = 4.0
Timer = Callable[[Callable[[], object]], float]  # seconds one run of fn takes
Outputs = tuple[torch.Tensor, ...]  # out, dQ, dK, dV of one forward and backward


def cuda_event_timer(fn: Callable[[], object]) -> float:
    """Seconds of one run of fn on the current CUDA stream, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def host_timer(fn: Callable[[], object]) -> float:
    """Seconds of one run of fn by the host's clock (a CPU's kernels run as they are called)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timer_for(device: torch.device) -> Timer:
    return cuda_event_timer if device.type == "cuda" else host_timer


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

    def error(self, got: Outputs) -> float:
        """The worst error of `got` as a multiple of what is allowed: at most 1 agrees."""
        if self.exact is None:
            tolerance = agreement_tolerance(self.expected[0].dtype)
            return max(relative_error(g, e) for g, e in zip(got, self.expected)) / tolerance
        return max(
            max(relative_error(g, x) / fro, largest_error(g, x) / big)
            for g, x, (fro, big) in zip(got, self.exact, self.bounds)
        )


def forward_backward(run: Callable, call: ChunkCall, grad_out: torch.Tensor) -> Outputs:
    """out, dQ, dK, dV of one run on the call's tensors (detached leaves keeping their strides)."""
    leaves = [t.detach().requires_grad_() for t in (call.query, call.key, call.value)]
    with torch.enable_grad():
        out = run(call.with_tensors(*leaves))
        grads = torch.autograd.grad(out, leaves, grad_out)
    return (out.detach(), *grads)


def step_call_shapes(step) -> list[CallShape]:
    """The chunk calls one run of a StreamBP TrainingStep makes, in order (a forward with grad once
    as it runs and once with its gradient's layout)."""
    from ..methods.streambp import step_hooks

    shapes: list[CallShape] = []
    with step_hooks(on_chunk_call=shapes.append):
        step.run()
    return shapes


@dataclass
class ClassCalls:
    """A shape class's calls in a step: the largest of each grad mode, and the distinct ones of each."""

    name: str
    no_grad: CallShape | None = None  # the checkpoint pass's and the rebuilds' call, largest n
    with_grad: CallShape | None = None  # the layer backward's, with its gradient's layout
    keys: dict[bool, set] = field(default_factory=lambda: {False: set(), True: set()})  # grad mode -> build keys

    @property
    def num_shapes(self) -> int:
        """Distinct calls of either grad mode: how many times a step builds a kernel of this class
        anew, one call of each grad mode a time (what `build_s` measures)."""
        return max(len(keys) for keys in self.keys.values())


def classes_of(shapes: Iterable[CallShape]) -> list[ClassCalls]:
    """The step's calls grouped by shape class, in order of first appearance."""
    classes: dict[str, ClassCalls] = {}
    for shape in shapes:
        name = class_of_shape(shape)
        group = classes.setdefault(name, ClassCalls(name))
        group.keys[shape.grad_enabled].add(shape.build_key)
        slot = "with_grad" if shape.grad_enabled else "no_grad"
        if shape.grad_enabled and shape.grad_out is None:
            continue  # its backward's record carries the gradient's layout too
        best = getattr(group, slot)
        if best is None or shape.key.size[2] > best.key.size[2]:
            setattr(group, slot, shape)
    return list(classes.values())


@dataclass
class KernelResult:
    """One kernel on one shape class."""

    kernel: str
    status: str  # ok | unavailable | unsupported | wrong | oom | error
    reason: str = ""
    forward_s: list[float] = field(default_factory=list)  # steady forwards without grad
    train_s: list[float] = field(default_factory=list)  # steady forwards and backwards with grad
    build_s: float | None = None  # the first runs' seconds beyond steady ones, both grad modes
    error: float | None = None  # as a multiple of what agreement allows (at most 1 agrees)

    @property
    def steady_s(self) -> float | None:
        """What one call of each grad mode costs a step once built: the medians' sum."""
        if not self.forward_s and not self.train_s:
            return None
        return sum(statistics.median(s) for s in (self.forward_s, self.train_s) if s)


def measure_class(group: ClassCalls, kernels: dict, *, reps: int, timer: Timer, seed: int = 0) -> list[KernelResult]:
    """The reference and each candidate on the class's largest calls; the reference first."""
    runs = {LOWER_RIGHT: lower_right_attention, **{name: kernel.run for name, kernel in kernels.items()}}
    train = group.with_grad
    sample = train or group.no_grad
    generator = torch.Generator(sample.device).manual_seed(seed)
    calls = {
        "no_grad": group.no_grad.make_call(generator) if group.no_grad else None,
        "with_grad": train.make_call(generator) if train else None,
    }
    grad_out = train.grad_out.make(train.dtype, train.device, generator) if train and train.grad_out else None
    judge = _judge(calls["with_grad"], grad_out) if grad_out is not None else None
    results = []
    for name, run in runs.items():
        kernel = kernels.get(name)
        refusal = _refusal(kernel, calls["with_grad"] or calls["no_grad"])
        if refusal is not None:
            results.append(KernelResult(name, *refusal))
            continue
        try:
            results.append(_measure_kernel(name, run, calls, grad_out, judge, reps, timer))
        except Exception as error:  # a kernel's failure, or no memory for it here: a result
            oom = isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)
            first = str(error).splitlines()[0] if str(error) else ""
            results.append(KernelResult(name, "oom" if oom else "error", f"{type(error).__name__}: {first}"[:300]))
        if sample.device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _refusal(kernel, call: ChunkCall) -> tuple[str, str] | None:
    if kernel is None:
        return None  # the reference
    reason = kernel.unavailable(call.query.device)
    if reason is not None:
        return "unavailable", reason
    reason = kernel.unsupported(call)
    return None if reason is None else ("unsupported", reason)


def _judge(call: ChunkCall, grad_out: torch.Tensor) -> Judge:
    expected = forward_backward(lower_right_attention, call, grad_out)
    exact = None
    if call.query.dtype in (torch.bfloat16, torch.float16):
        wide = call.with_tensors(*(t.detach().float() for t in (call.query, call.key, call.value)))
        exact = forward_backward(lower_right_attention, wide, grad_out.float())
    return Judge(expected, exact)


def _measure_kernel(name, run, calls, grad_out, judge: Judge | None, reps: int, timer: Timer) -> KernelResult:
    result = KernelResult(name, "ok")
    first = 0.0
    if calls["no_grad"] is not None:
        with torch.no_grad():
            first += timer(lambda: run(calls["no_grad"]))
            result.forward_s = [timer(lambda: run(calls["no_grad"])) for _ in range(reps)]
    if calls["with_grad"] is not None and grad_out is not None:
        outputs = []
        first += timer(lambda: outputs.append(forward_backward(run, calls["with_grad"], grad_out)))
        result.error = judge.error(outputs.pop())
        result.train_s = [timer(lambda: forward_backward(run, calls["with_grad"], grad_out)) for _ in range(reps)]
        if result.error > 1:
            result.status = "wrong"
            result.reason = f"differs from {LOWER_RIGHT} by {result.error:.1f}x the error allowed"
    result.build_s = max(0.0, first - (result.steady_s or 0.0))
    return result


def table_entry(results: list[KernelResult], num_shapes: int) -> dict:
    """The class's table entry: the fastest kernel that agrees (the reference if none does), each
    one's steady and build seconds, and the distinct shapes a step makes in the class."""
    timed = [r for r in results if r.status == "ok" and r.steady_s is not None]
    best = min(timed, key=lambda r: r.steady_s).kernel if timed else LOWER_RIGHT
    return {
        "kernel": best,
        "steady_s": {r.kernel: r.steady_s for r in timed},
        "build_s": {r.kernel: r.build_s for r in timed},
        "shapes": num_shapes,
    }
