"""What each step of `sbp selftest` costs on a GPU: a sum of the work it counts, predicted.

A price is never a flat guess. Each step lists its work, counted from what it runs: process starts
and model builds (simulate/cost.py), steps by the planner's time model at the rates fitted to a
GPU's rows (simulate/timing.py), kernel builds per distinct chunk-call shape, compiles, copies.
The unit costs that no measured row gives yet are predictions, each with its source below. Once a
step has run ok on a device, its wall time in that device's selftest.log replaces its price
(selftest.py `with_measured_predictions`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from ..config import RunSpec
from ..config.run import BeyondContextWarning, point_specs
from ..measure.copy_rate import DEFAULT_BYTES
from ..measure.flops import chunk_attention_flops
from ..settings import SettingChanged
from ..simulate.cost import START_S, point_cost, start_s, step_s
from ..simulate.plan import meta_model
from ..simulate.timing import Rates

# Unit costs, predictions all (no GPU has measured them in this form):
PYTEST_START_S = 10.0  # pytest's start: torch, transformers and sbpbench imported, a CUDA context
# One kernel's graphs for a chunk-call shape new to the process (cuDNN: one per grad mode and
# direction): the top of the 0.04-0.55 s public reports give for a cuDNN attention graph
BUILD_S_PER_SHAPE = 0.55
# FlexAttention compiled for one grad mode (forward, or forward and backward) with cold caches; the
# same from the Inductor and Triton caches the selftest's processes share (dynamo still traces)
COMPILE_S, CACHED_COMPILE_S = 40.0, 15.0
FLEX_GRAPHS = 2  # compiled with dynamic shapes: one graph per grad mode, whatever the lengths
# fp32 and fp64 steps are priced as the bf16 step times this: dense bf16 over fp32 and fp64 peak
# (H100 SXM datasheet: 989.4 and 66.9 TFLOP/s), an upper bound (attention's kernels differ less)
WIDE_DTYPE_FACTOR = 989.4 / 66.9
LAUNCH_FLOOR_S = 0.5  # a tiny model's step: thousands of kernel launches, whatever its FLOPs
GATHER_S = 5.0  # a check's full gradients gathered from its ranks to the host and compared


@dataclass(frozen=True)
class Work:
    """`count` times `each_s` seconds of one kind of work."""

    what: str
    count: float
    each_s: float

    @property
    def seconds(self) -> float:
        return self.count * self.each_s

    def describe(self) -> str:
        return f"{self.count:g} x {self.each_s:.3g} s: {self.what}"


def total_s(work: list[Work]) -> float:
    return sum(w.seconds for w in work)


def spec_of(model: str, seq_len: int, method: str, **values) -> RunSpec:
    """A GPU point's spec made on any machine, to price it (no word on lengths past a model's
    context, nor on ranks past this host's cores)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BeyondContextWarning)
        warnings.simplefilter("ignore", SettingChanged)
        (spec,) = point_specs(dict(values, model=model, seq_len=seq_len, device="cpu"), [method], defaults_for="cuda")
    return spec


def step_seconds(spec: RunSpec, rates: Rates) -> float:
    """One step of the spec at the rates (fp32 and fp64 times WIDE_DTYPE_FACTOR), at least LAUNCH_FLOOR_S."""
    seconds, _, _ = step_s(spec, rates)
    return max(LAUNCH_FLOOR_S, seconds * (1.0 if spec.dtype in ("bf16", "fp16") else WIDE_DTYPE_FACTOR))


def steps(count: int, what: str, spec: RunSpec, rates: Rates) -> Work:
    return Work(what, count, step_seconds(spec, rates))


def build(what: str, spec: RunSpec) -> Work:
    """Building the spec's model in a process already started (simulate/cost.py, less its START_S)."""
    return Work(what, 1, start_s(spec) - START_S)


def prefix_chunks(spec: RunSpec) -> int:
    """A StreamBP step's chunks with a prefix: each a distinct call shape in each grad mode."""
    return max(0, math.ceil(spec.seq_len / spec.settings.chunk_size) - 1)


def warm_work(spec: RunSpec) -> list[Work]:
    """Before the timed steps of a streambp point whose auto reads a table of measured kernels: the
    kernel the table names built for each distinct call. The table is read on the GPU, so the price
    is the dearer candidate's: the split's builds per shape or flex's compiles from the shared caches."""
    split = Work("kernel builds before the timed steps: one per distinct chunk call (split)", prefix_chunks(spec),
                 BUILD_S_PER_SHAPE)  # fmt: skip
    flex = Work("kernel builds before the timed steps: one compile per grad mode (flex, cached)", FLEX_GRAPHS,
                CACHED_COMPILE_S)  # fmt: skip
    return [max(split, flex, key=lambda w: w.seconds)]


def run_work(specs: list[RunSpec], rates: Rates) -> list[Work]:
    """An `sbp run`: each method's process (start, warm-up, memory and timed steps, first-step
    page-locking: simulate/cost.py) and, for a streambp point under auto, the kernels' builds."""
    work = []
    for spec in specs:
        cost = point_cost(spec, rates)
        work.append(Work(f"{spec.method} process: start and {cost.steps} steps", 1, cost.device_s))
        if spec.method == "streambp" and spec.settings.chunk_attention == "auto":
            work += warm_work(spec)
    return work


def quick_tier_work(rates: Rates) -> list[Work]:
    """What `pytest -m 'gpu and quick'` runs, counted from the quick tests of tests/gpu/ (each file named)."""
    timed = spec_of("Qwen/Qwen3-0.6B", 16384, "streambp", num_layers=4, chunk_size=4096, logits_chunk_size=2048,
                    checkpoints="stream:2")  # fmt: skip
    worker = spec_of("Qwen/Qwen3-0.6B", 8192, "streambp", dtype="bf16", chunk_size=2048, repeats=1)
    exact = {dtype: spec_of("Qwen/Qwen3-0.6B", 9000, "streambp", num_layers=6, dtype=dtype, chunk_size=3000,
                            logits_chunk_size=100) for dtype in ("fp64", "fp32", "bf16")}  # fmt: skip
    return [
        Work("pytest's start and imports", 1, PYTEST_START_S),
        Work("test_gpu_stream.py: fp64 steps of a 5-layer tiny model, gpu and stream:2/stream:3", 4, LAUNCH_FLOOR_S),
        build("test_gpu_stream.py: Qwen3-0.6B on 4 layers built", timed),
        steps(2, "test_gpu_stream.py: its stream:2 steps at T=16,384 (a warm-up and the timed one)", timed, rates),
        Work(
            "test_gpu_kernels.py: the split's cuDNN graphs, forward and backward (flex is not quick)",
            2,
            BUILD_S_PER_SHAPE,
        ),
        Work("test_gpu_measure.py: its streambp worker on Qwen3-0.6B at T=8192", 1, point_cost(worker, rates).device_s),
        build("test_gpu.py: Qwen3-0.6B on 6 layers built", exact["fp32"]),
        steps(1, "test_gpu.py: the fp64 streambp step at T=9000", exact["fp64"], rates),
        steps(3, "test_gpu.py: fp32 steps of bp, ckpt and streambp", exact["fp32"], rates),
        steps(2, "test_gpu.py: bf16 steps of bp and streambp", exact["bf16"], rates),
    ]


def benchmark_work(model: str, seq_len: int, chunk_size: int, reps: int, rates: Rates) -> list[Work]:
    """benchmarks/attention_kernels.py at one point: its process, one recorded step of the model on one
    layer, and per shape class the reference and three candidates (split, flex, one FlashAttention),
    each checked once and timed `reps` times in both grad modes, plus flex's compiles."""
    spec = spec_of(model, seq_len, "streambp", num_layers=1, chunk_size=chunk_size, chunk_attention="lower-right",
                   warmup=0, repeats=0)  # fmt: skip
    classes = max(1, math.ceil(math.log2(max(1, prefix_chunks(spec)))) + 1)  # prefixes c .. T - c to a power of two
    config = meta_model(spec).config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # the largest call: without grad, then forward and backward (3.5 forwards of FLOPs)
    largest_s = chunk_attention_flops(1, heads, chunk_size, seq_len, head_dim) * 4.5 / rates.attention_forward_flop_s
    return [
        Work("its process: start and the 1-layer model built", 1, start_s(spec)),
        steps(1, f"the recorded step at T={seq_len:,} on 1 layer", spec, rates),
        Work("FlexAttention compiles, one per grad mode (cold caches)", FLEX_GRAPHS, COMPILE_S),
        Work("builds on each class's calls (split and one FlashAttention)", 2 * classes, BUILD_S_PER_SHAPE),
        Work(f"runs of {classes} classes' largest call: 4 kernels x (1 + {reps}), an fp32 reference", classes * (4 * (1 + reps) + WIDE_DTYPE_FACTOR), largest_s),
    ]  # fmt: skip


def copy_rate_work(rates: Rates, repeats: int = 5) -> list[Work]:
    """measure/copy_rate.py: its process, page-locking both kinds of buffer, (1 + repeats) copies
    each way of each."""
    return [
        Work("its process: start and a CUDA context", 1, START_S),
        Work("page-locking 512 MiB, each kind of buffer", 2, DEFAULT_BYTES / rates.pinning_bytes_s),
        Work("copies of 512 MiB", 2 * 2 * (1 + repeats), DEFAULT_BYTES / rates.host_copy_bytes_s),
    ]


def sp_check_work(spec: RunSpec, rates: Rates) -> list[Work]:
    """`sbp check` of StreamBP on 2 ranks sharing each sequence, in fp32: bp's fp64 and fp32 steps in
    the parent, the ranks' start side by side, their step, the gradients gathered and compared."""
    bp64 = spec_of(spec.model, spec.seq_len, "bp", num_layers=spec.num_layers, dtype="fp64")
    return [
        Work("its process: start, the model built", 1, start_s(bp64)),
        steps(2, "bp's fp64 and fp32 steps (the reference and bp's own error)", bp64, rates),
        Work("2 ranks started side by side, nccl's rendezvous", 1, start_s(spec)),
        steps(1, "the ranks' streambp step", spec, rates),
        Work("the full gradients gathered to the host and compared", 1, GATHER_S),
    ]
