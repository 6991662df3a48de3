"""StreamBP's chunk-attention kernels measured per GPU, looked up by a step, built before it is timed.

benchmarks/attention_kernels.py (runner/kernel_bench.py) measures the candidates on the calls a
step really makes and writes, per device, a table: shape class -> the fastest kernel that agrees
with the reference, each kernel's steady seconds and its build seconds per new shape beside.
The file, one JSON object under `$SBP_CACHE_DIR` (else `$XDG_CACHE_HOME/sbpbench`, else
~/.cache/sbpbench):

    {"format": 1, "tables": {DEVICE CLASS: {SHAPE CLASS: {"kernel": "split",
        "steady_s": {"lower-right": ..., "split": ...}, "build_s": {"split": ...}, "shapes": N}}}}

A device class names the device, the torch and cuDNN versions and the candidates that load here,
so a table copied to another machine or torch answers nothing. A worker measuring a point whose
chunk_attention is auto (and SDPA not narrowed) loads its device's table, if any, and its warm-up
and timed steps ask `TablePicker` per call: the class's kernel, or the lower-right reference for a
class not in the table. Its memory step keeps auto's own meaning, the reference the estimator
models. Before the timed steps, `warm_chunk_kernels` runs the picked kernel once on each distinct
(sizes, strides, dtype, grad mode, gradient layout) the memory step recorded: a cuDNN graph per
shape and stride, and a compile per grad mode, are paid there, not in a timed step.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.internal import KERNELS, LOWER_RIGHT, CallShape, ChunkCall, select

FILE_NAME = "attention-kernels.json"
FORMAT = 1


def default_table_path() -> Path:
    root = os.environ.get("SBP_CACHE_DIR")
    if root:
        return Path(root) / FILE_NAME
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sbpbench" / FILE_NAME


@functools.lru_cache(maxsize=16)  # asked once per worker
def device_class(device: torch.device) -> str:
    """The device, the versions a kernel's speed depends on, and the candidates that load here."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    present = [name for name, kernel in KERNELS.items() if kernel.unavailable(device) is None]
    return f"{name} | torch {torch.__version__} | cudnn {cudnn} | {'+'.join(present) or 'none'}"


def _bucket(n: int) -> int:
    """n rounded up to a power of two: shapes within a factor of 2 share a class."""
    return 1 << max(0, n - 1).bit_length()


def class_of(query: tuple[int, ...], key: tuple[int, ...], dtype: torch.dtype, window: int | None) -> str:
    """What a table entry holds for: batch, heads, key heads, head dim, dtype, query and prefix
    lengths to a power of two, and whether a window cuts the keys. query (B, H, c, hd), key (B, h_kv, n, hd)."""
    batch, heads, num_queries, head_dim = query
    prefix = key[2] - num_queries
    name = str(dtype).removeprefix("torch.")
    cut = "window" if window is not None else "full"
    return f"B{batch} H{heads} KV{key[1]} hd{head_dim} {name} c<={_bucket(num_queries)} prefix<={_bucket(prefix)} {cut}"


def shape_class(call: ChunkCall) -> str:
    return class_of(tuple(call.query.shape), tuple(call.key.shape), call.query.dtype, call.window)


def class_of_shape(shape: CallShape) -> str:
    return class_of(shape.query.size, shape.key.size, shape.dtype, shape.window)


def read_tables(path: Path) -> dict[str, dict]:
    """Every device's table in the file; {} when there is none, a warning when it is not one."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        warnings.warn(f"ignoring the attention-kernel table {path}: {error}", stacklevel=2)
        return {}
    tables = data.get("tables") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(tables, dict):
        warnings.warn(f"ignoring the attention-kernel table {path}: not a format-{FORMAT} table", stacklevel=2)
        return {}
    return tables


def write_table(path: Path, device: str, classes: dict[str, dict]) -> None:
    """This device's classes into the file (merged over what it held for them), replaced atomically."""
    tables = read_tables(path)
    tables[device] = {**tables.get(device, {}), **classes}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps({"format": FORMAT, "tables": tables}, indent=1, sort_keys=True) + "\n")
    partial.replace(path)


@dataclass(frozen=True)
class TablePicker:
    """A core kernel picker (chunk_attention): the kernel a table names for the call's shape class,
    the lower-right reference for a class it does not hold."""

    kernels: dict[str, str]  # shape class -> kernel name

    def __call__(self, call: ChunkCall) -> str:
        return self.kernels.get(shape_class(call), LOWER_RIGHT)

    def names(self) -> set[str]:
        return set(self.kernels.values())


def table_picker(device: torch.device, path: Path | None = None) -> TablePicker | None:
    """The picker of this device's table; None when the file holds none for it, or only the reference."""
    classes = read_tables(path or default_table_path()).get(device_class(device), {})
    kernels = {
        name: entry["kernel"] for name, entry in classes.items() if isinstance(entry, dict) and "kernel" in entry
    }
    picker = TablePicker({c: k for c, k in kernels.items() if k in KERNELS})
    return picker if picker.names() else None


def warm_chunk_kernels(shapes: Iterable[CallShape], setting) -> int:
    """Run the kernel `setting` gives each call shape, once per distinct build key, as the step runs
    it: in its grad mode, on tensors of its sizes and strides, and where its output got a gradient,
    the backward with a gradient of that layout. Returns the number of runs. The reference builds
    nothing per shape (SDPA's flash and efficient kernels) and is skipped."""
    backward = {s.build_key for s in shapes if s.grad_out is not None}
    generator = None
    runs, done = 0, set()
    for shape in shapes:
        key = (shape.build_key, shape.grad_out)
        if key in done or (shape.grad_out is None and shape.grad_enabled and shape.build_key in backward):
            continue  # a forward with grad is warmed with its backward
        done.add(key)
        if generator is None:
            generator = torch.Generator(shape.device).manual_seed(0)
        call = shape.make_call(generator)
        kernel = select(call, setting)
        if kernel is None:
            continue
        with torch.set_grad_enabled(shape.grad_enabled):
            out = kernel.run(call)
            if shape.grad_out is not None and out.requires_grad:
                inputs = [t for t in (call.query, call.key, call.value) if t.requires_grad]
                torch.autograd.grad(out, inputs, shape.grad_out.make(shape.dtype, shape.device, generator))
        runs += 1
    return runs
