"""Measure every kernel for StreamBP's chunk attention on the calls a step makes; write a CSV and the table auto reads.

    python benchmarks/attention_kernels.py                          # a GPU: Qwen3-8B's calls at T = 65,536
    python benchmarks/attention_kernels.py --seq 65536,262144 --reps 5
    python benchmarks/attention_kernels.py --tiny --out x.csv --table x.json   # a CPU: tiny shapes, seconds (tested)

For each sequence length, one StreamBP step of the model on one decoder layer (each layer makes the
same calls) records its chunk calls: sizes, strides, dtype, grad mode, as a step makes them. Per
shape class (batch, heads, dtype, chunk and prefix to a power of two), the lower-right reference
and each kernel of core/kernels/chunk_kernels.py run the class's largest call: once to check its
values against the reference and to measure its build on a new shape, then `--reps` times for its
steady time, without grad (the checkpoint pass) and with grad, forward and backward (the layer
backward). Timing is by CUDA events (the host clock on a CPU). runner/kernel_bench.py is the
measurement. A kernel that cannot run a class is a row with its status and the reason.

The table (runner/kernel_table.py: shape class -> the fastest kernel that agrees, each kernel's
steady and build seconds) goes to `--table`, by default on a GPU the cache file `sbp run` reads
(`$SBP_CACHE_DIR/attention-kernels.json`); on a CPU only where `--table` says. FLOPs are counted as
measure/flops.py counts attention (below the diagonal; a backward 2.5x its forward).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

import torch

from sbpbench.config import point_specs
from sbpbench.core.internal import KERNELS
from sbpbench.measure.environment import capture_environment
from sbpbench.measure.flops import chunk_attention_flops
from sbpbench.runner.kernel_bench import classes_of, measure_class, step_call_shapes, table_entry, timer_for
from sbpbench.runner.kernel_table import default_table_path, device_class, write_table
from sbpbench.workload.build import build_model_and_batch, training_step

GPU_MODEL, GPU_SEQ, GPU_CHUNK = "Qwen/Qwen3-8B", (65_536,), 4096  # the long points' chunks (auto's 4096)
TINY_MODEL, TINY_SEQ, TINY_CHUNK = "tiny/qwen3", (48,), 16
DTYPES = ("bf16", "fp16", "fp32", "fp64")


@dataclass
class Row:
    """One kernel on one shape class: the CSV's columns, in order."""

    kernel: str
    status: str  # ok | unavailable | unsupported | wrong | oom | error
    reason: str
    shape_class: str
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    queries: int  # of the class's largest call
    keys: int  # the chunk's own included
    dtype: str
    forward_ms_p50: float | None = None  # without grad
    forward_ms_min: float | None = None
    forward_ms_max: float | None = None
    train_ms_p50: float | None = None  # forward and backward, with grad
    train_ms_min: float | None = None
    train_ms_max: float | None = None
    forward_tflops: float | None = None  # at the medians
    train_tflops: float | None = None
    build_s: float | None = None  # its first runs' seconds beyond steady ones (a new shape's build)
    error_ratio: float | None = None  # out, dQ, dK, dV against the reference, as a multiple of what is allowed
    shapes: int = 0  # distinct call shapes (sizes, strides, grad mode) of the step in this class
    chosen: bool = False  # the class's kernel in the table
    reps: int = 0
    model: str = ""
    seq_len: str = ""
    chunk_size: int = 0
    device_name: str = ""
    torch_version: str = ""
    cudnn_version: str = ""
    git_commit: str = ""
    git_dirty: str = ""
    timestamp_utc: str = ""


def recorded_calls(model: str, seq_len: int, chunk_size: int, dtype: str, device: torch.device) -> list:
    """The chunk calls of one StreamBP step of `model` cut to one decoder layer, under the reference."""
    values = {"model": model, "seq_len": seq_len, "chunk_size": chunk_size, "num_layers": 1, "dtype": dtype}
    values |= {"device": str(device), "chunk_attention": "lower-right", "warmup": 0, "repeats": 0}
    (spec,) = point_specs(values, ["streambp"])
    built, batch = build_model_and_batch(spec)
    shapes = step_call_shapes(training_step(spec, built, batch))
    del built, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return shapes


def benchmark(args, device: torch.device, kernels=None, timer=None) -> tuple[list[Row], dict[str, dict]]:
    """The rows of every kernel on every shape class of the step(s), and the table's entries."""
    kernels = KERNELS if kernels is None else kernels
    timer = timer or timer_for(device)
    shapes = [s for seq in args.seq for s in recorded_calls(args.model, seq, args.chunk_size, args.dtype, device)]
    env = capture_environment(str(device))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    provenance = {
        "model": args.model, "seq_len": ",".join(map(str, args.seq)), "chunk_size": args.chunk_size,
        "device_name": env.device_name, "torch_version": torch.__version__, "cudnn_version": str(cudnn or ""),
        "git_commit": env.git_commit, "git_dirty": env.git_dirty,
    }  # fmt: skip
    rows, table = [], {}
    for group in classes_of(shapes):
        results = measure_class(group, kernels, reps=args.reps, timer=timer)
        table[group.name] = entry = table_entry(results, group.num_shapes)
        largest = group.with_grad or group.no_grad
        batch, heads, queries, head_dim = largest.query.size
        for result in results:
            row = Row(
                result.kernel, result.status, result.reason, group.name, batch, heads, largest.key.size[1], head_dim,
                queries, largest.key.size[2], args.dtype, shapes=group.num_shapes, reps=args.reps,
                chosen=result.kernel == entry["kernel"], **provenance,
            )  # fmt: skip
            _fill(row, result)
            row.timestamp_utc = datetime.now(UTC).isoformat(timespec="seconds")
            rows.append(row)
            print(_line(row), file=sys.stderr, flush=True)
    return rows, table


def _fill(row: Row, result) -> None:
    row.build_s = None if result.build_s is None else _digits(result.build_s)
    row.error_ratio = None if result.error is None else _digits(result.error)
    forward = chunk_attention_flops(row.batch, row.heads, row.queries, row.keys, row.head_dim)
    work = {"forward": (result.forward_s, forward), "train": (result.train_s, 3.5 * forward)}
    for name, (seconds, flops) in work.items():
        if not seconds:
            continue
        ms = [1e3 * s for s in seconds]
        p50 = statistics.median(ms)
        setattr(row, f"{name}_ms_p50", _digits(p50))
        setattr(row, f"{name}_ms_min", _digits(min(ms)))
        setattr(row, f"{name}_ms_max", _digits(max(ms)))
        setattr(row, f"{name}_tflops", _digits(flops / (p50 * 1e-3) / 1e12) if p50 > 0 else None)


def _digits(x: float) -> float:
    """Five significant digits: more than a timing's repeatability, fewer than float noise."""
    return float(f"{x:.5g}")


def _line(row: Row) -> str:
    where = f"{row.kernel:12s} c={row.queries:<6d} n={row.keys:<7d}"
    if row.status != "ok":
        return f"{where} {row.status}: {row.reason}"
    return f"{where} fwd {row.forward_tflops} TFLOP/s  fwd+bwd {row.train_tflops} TFLOP/s  build {row.build_s} s"


def write_csv(rows: list[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(Row)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny/qwen3's calls in fp32 on a CPU: a check of the code")
    parser.add_argument("--model", help=f"the model whose calls are measured (default: {GPU_MODEL})")
    parser.add_argument("--seq", type=_ints, help="sequence lengths, comma-separated (default: 65536)")
    parser.add_argument("--chunk-size", type=int, help=f"StreamBP's chunk (default: {GPU_CHUNK})")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bf16, fp32 with --tiny")
    parser.add_argument("--reps", type=int, default=3, help="steady runs per grad mode (default: 3)")
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument("--out", type=Path, default=None, help="CSV (default: results/attention-kernels/<device>.csv)")
    parser.add_argument(
        "--table", type=Path, default=None, help=f"the table (default on a GPU: {default_table_path()})"
    )
    args = parser.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type != "cuda" and not args.tiny:
        parser.error("StreamBP's long-sequence calls need a GPU; on a CPU run --tiny")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    model, seq, chunk = (TINY_MODEL, TINY_SEQ, TINY_CHUNK) if args.tiny else (GPU_MODEL, GPU_SEQ, GPU_CHUNK)
    args.model, args.seq, args.chunk_size = args.model or model, args.seq or seq, args.chunk_size or chunk
    if args.chunk_size < 1 or any(t <= args.chunk_size for t in args.seq):
        parser.error("every --seq must exceed --chunk-size (a step with one chunk makes no call with a prefix)")
    args.dtype = args.dtype or ("fp32" if args.tiny else "bf16")
    if args.table is None and args.device.type == "cuda":
        args.table = default_table_path()
    return args


def main(argv: list[str] | None = None, kernels=None, timer=None) -> int:
    """kernels, timer: the candidates and the clock (tests pass stand-ins)."""
    args = parse(argv)
    rows, table = benchmark(args, args.device, kernels, timer)
    name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    out = args.out or Path("results") / "attention-kernels" / f"{name.replace(' ', '-').lower()}.csv"
    write_csv(rows, out)
    print(f"wrote {len(rows)} rows to {out}", file=sys.stderr)
    if args.table is not None:
        write_table(args.table, device_class(args.device), table)
        chosen = ", ".join(f"{c}: {e['kernel']}" for c, e in table.items())
        print(f"table of {device_class(args.device)} in {args.table}: {chosen}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
