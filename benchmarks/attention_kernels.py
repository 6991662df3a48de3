"""Time every kernel for StreamBP's offset-causal chunk attention, forward and backward, and write a CSV.

    python benchmarks/attention_kernels.py                     # a GPU: StreamBP's shapes, a few minutes
    python benchmarks/attention_kernels.py --tiny --out x.csv  # a CPU: tiny shapes, seconds (tested)

The shapes are StreamBP's at long T: chunks of 1k-8k queries over 8k-512k keys (the chunk's own
included, keys ending where the queries end), 32 query and 8 key heads of dim 128 (Qwen3-8B), bf16,
batch 1. Each kernel of core/kernels/chunk_kernels.py (and the lower-right SDPA reference) runs each shape
once to check its values against the reference and warm up (compilation, cuDNN plans), then
`--reps` timed forwards and backwards, by CUDA events (perf_counter on a CPU); the median and the
spread are kept. FLOPs are counted as measure/flops.py counts attention (below the diagonal; a
backward 2.5x its forward), so TFLOP/s compares kernels on the same work. A kernel that cannot run
a shape is a row with its status and the reason; an out-of-memory is a row too.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

import torch

from sbpbench.core.attention import lower_right_attention
from sbpbench.core.kernels.chunk_kernels import ChunkCall, default_kernels
from sbpbench.core.kernels.kernel_choice import LOWER_RIGHT, agreement_tolerance, cuda_event_timer, relative_error
from sbpbench.measure.environment import capture_environment
from sbpbench.measure.flops import chunk_attention_flops

# (queries per chunk, keys) for a GPU; keys include the chunk's own
GPU_QUERIES = (1024, 2048, 4096, 8192)
GPU_KEYS = (8192, 32768, 131072, 524288)
GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM = 32, 8, 128  # Qwen3-8B
TINY_QUERIES, TINY_KEYS = (16, 32), (64, 128)
TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM = 4, 2, 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Row:
    """One kernel at one shape: the CSV's columns, in order."""

    kernel: str
    status: str  # ok | unavailable | unsupported | wrong | oom | error
    reason: str
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    queries: int
    keys: int
    dtype: str
    forward_ms_p50: float | None = None
    forward_ms_min: float | None = None
    forward_ms_max: float | None = None
    backward_ms_p50: float | None = None
    backward_ms_min: float | None = None
    backward_ms_max: float | None = None
    forward_tflops: float | None = None  # at the median
    backward_tflops: float | None = None
    peak_allocated_bytes: int | None = None  # CUDA: above what was allocated before the kernel ran
    max_relative_error: float | None = None  # out, dQ, dK, dV against the lower-right reference
    reps: int = 0
    device_name: str = ""
    torch_version: str = ""
    cudnn_version: str = ""
    git_commit: str = ""
    git_dirty: str = ""
    timestamp_utc: str = ""


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds of one run of fn: CUDA events on a GPU (as kernel_choice times), perf_counter on a CPU."""
    if device.type == "cuda":
        return cuda_event_timer

    def cpu(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return cpu


def make_call(batch, heads, kv_heads, head_dim, queries, keys, dtype, device) -> ChunkCall:
    """Random q (B, H, c, hd) and k/v (B, h_kv, n, hd): queries at [n - c, n), keys at [0, n)."""
    generator = torch.Generator(device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    return ChunkCall(
        rand(batch, heads, queries, head_dim),
        rand(batch, kv_heads, keys, head_dim),
        rand(batch, kv_heads, keys, head_dim),
        keys - queries,
        0,
        None,
    )


def _leaves(call: ChunkCall) -> tuple[ChunkCall, list[torch.Tensor]]:
    leaves = [t.detach().requires_grad_() for t in (call.query, call.key, call.value)]
    return call.with_tensors(*leaves), leaves


def _outputs(run, call: ChunkCall, grad_out: torch.Tensor) -> list[torch.Tensor]:
    with torch.enable_grad():
        leafy, leaves = _leaves(call)
        out = run(leafy)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def measure(run, call: ChunkCall, grad_out, reference_outputs, reps: int, timer) -> dict:
    """Check against the reference (one run, also the warm-up), then reps forwards and backwards."""
    device = call.query.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    ours = _outputs(run, call, grad_out)
    error = max(relative_error(o, r) for o, r in zip(ours, reference_outputs))
    del ours
    forward, backward = [], []
    for _ in range(reps):
        with torch.enable_grad():
            leafy, _ = _leaves(call)
            outputs = []
            forward.append(timer(lambda outputs=outputs, leafy=leafy: outputs.append(run(leafy))))
            backward.append(timer(lambda outputs=outputs: outputs.pop().backward(grad_out)))
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    return {"forward": forward, "backward": backward, "error": error, "peak": peak}


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)


def benchmark(shapes, *, heads, kv_heads, head_dim, dtype_name, device, reps, kernels=None) -> list[Row]:
    """Rows for every kernel at every (queries, keys) shape."""
    kernels = default_kernels() if kernels is None else kernels
    env = capture_environment(str(device))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    dtype, timer = DTYPES[dtype_name], _timer(device)
    provenance = {
        "device_name": env.device_name,
        "torch_version": torch.__version__,
        "cudnn_version": str(cudnn or ""),
        "git_commit": env.git_commit,
        "git_dirty": env.git_dirty,
    }
    rows = []
    for queries, keys in shapes:
        call = make_call(1, heads, kv_heads, head_dim, queries, keys, dtype, device)
        grad_out = torch.randn_like(call.query)
        reference = _outputs(lower_right_attention, call, grad_out)
        runs = {LOWER_RIGHT: (lower_right_attention, None)}
        for name, kernel in kernels.items():
            reason = kernel.unavailable(device)
            status = "unavailable"
            if reason is None:
                reason, status = kernel.unsupported(call), "unsupported"
            runs[name] = (kernel.run, (status, reason) if reason is not None else None)
        for name, (run, refused) in runs.items():
            row = Row(name, "ok", "", 1, heads, kv_heads, head_dim, queries, keys, dtype_name, reps=reps, **provenance)
            if refused is not None:
                row.status, row.reason = refused
            else:
                try:
                    result = measure(run, call, grad_out, reference, reps, timer)
                except Exception as error:
                    row.status = "oom" if _is_oom(error) else "error"
                    row.reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
                else:
                    _fill(row, result, dtype)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            row.timestamp_utc = datetime.now(UTC).isoformat(timespec="seconds")
            rows.append(row)
            print(_line(row), file=sys.stderr, flush=True)
    return rows


def _fill(row: Row, result: dict, dtype: torch.dtype) -> None:
    row.max_relative_error = result["error"]
    if result["error"] > agreement_tolerance(dtype):
        row.status, row.reason = "wrong", f"differs from {LOWER_RIGHT} by {result['error']:.1e} (relative)"
    shape = (row.batch, row.heads, row.queries, row.keys, row.head_dim)
    for phase, backward in (("forward", False), ("backward", True)):
        ms = [1e3 * s for s in result[phase]]
        p50 = statistics.median(ms)
        setattr(row, f"{phase}_ms_p50", _digits(p50))
        setattr(row, f"{phase}_ms_min", _digits(min(ms)))
        setattr(row, f"{phase}_ms_max", _digits(max(ms)))
        flops = chunk_attention_flops(*shape, backward=backward)
        setattr(row, f"{phase}_tflops", _digits(flops / (p50 * 1e-3) / 1e12))
    row.peak_allocated_bytes = result["peak"]


def _digits(x: float) -> float:
    """Five significant digits: more than a timing's repeatability, fewer than float noise."""
    return float(f"{x:.5g}")


def _line(row: Row) -> str:
    where = f"{row.kernel:12s} c={row.queries:<6d} n={row.keys:<7d}"
    if row.status != "ok":
        return f"{where} {row.status}: {row.reason}"
    return f"{where} fwd {row.forward_tflops:9.4g} TFLOP/s  bwd {row.backward_tflops:9.4g} TFLOP/s"


def write_csv(rows: list[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(Row)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (4/2 heads of dim 16, fp32): a CPU check")
    parser.add_argument("--queries", type=_ints, help="queries per chunk, comma-separated")
    parser.add_argument("--keys", type=_ints, help="keys (the chunk's own included), comma-separated")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16, fp32 with --tiny")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per phase (default: 3)")
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument("--out", type=Path, default=None, help="CSV (default: results/attention-kernels/<device>.csv)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.tiny:
        parser.error("StreamBP's shapes need a GPU; on a CPU run --tiny")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    queries = args.queries or (TINY_QUERIES if args.tiny else GPU_QUERIES)
    keys = args.keys or (TINY_KEYS if args.tiny else GPU_KEYS)
    shapes = [(c, n) for c in queries for n in keys if n > c]
    if not shapes:
        parser.error("every --keys must exceed some --queries (the chunk's keys include its own)")
    tiny, gpu = (TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM), (GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM)
    heads, kv_heads, head_dim = tiny if args.tiny else gpu
    dtype = args.dtype or ("fp32" if args.tiny else "bf16")
    rows = benchmark(
        shapes, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_name=dtype, device=device, reps=args.reps
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = args.out or Path("results") / "attention-kernels" / f"{name.replace(' ', '-').lower()}.csv"
    write_csv(rows, out)
    print(f"wrote {len(rows)} rows to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
