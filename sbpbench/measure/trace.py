"""A PyTorch profiler trace of one training step: Chrome/Perfetto JSON as
`torch.profiler.profile(...).export_chrome_trace` writes it, which ui.perfetto.dev, chrome://tracing
and Holistic Trace Analysis (HTA) read.

The caller runs the step here on its own, outside any timed region: the profiler adds its cost to
every op it records, so a profiled step's time is never a measured one (runner/traces.py profiles
one step more, after the timed steps). The step is run as a timed step is (measure/timing.py): a
garbage collection before it, none inside, the device synchronised around it.
- Activities: the CPU always (each op torch dispatches); CUDA too on a GPU (kernels, copies and
  their launches, through CUPTI).
- record_shapes on: an op's input shapes tell one matmul or attention call from another.
- with_stack off: a Python stack per op makes the file larger (2.4x for a tiny/qwen3 streambp step
  on a CPU) and each op slower, and the op names and shapes already say where in the step it is.
- One step, marked `ProfilerStep#0` (a one-step schedule): HTA and the viewers find steps by it.
- `distributedInfo` {"rank": 0}: HTA refuses a trace without a rank, and torch writes one only
  under torch.distributed; a point traced here is one process.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from pathlib import Path

from torch.profiler import ProfilerAction, ProfilerActivity, profile

RANK = {"rank": 0}  # the trace's distributedInfo: one process


def profiler_activities(device_type: str) -> list[ProfilerActivity]:
    """What the profiler records for a step on `device_type`: CPU ops, and on CUDA its kernels."""
    return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device_type == "cuda" else [])]


def _one_step(step_num: int) -> ProfilerAction:
    """Record the first step and save it; a schedule, so that the trace marks the step."""
    return ProfilerAction.RECORD_AND_SAVE if step_num == 0 else ProfilerAction.NONE


def profile_step(
    step: Callable[[], object],
    path: str | Path,
    *,
    device_type: str,
    synchronize: Callable[[], None] = lambda: None,
    profiler: Callable[..., profile] = profile,
) -> Path:
    """Run step() once under the profiler and write its trace to `path` (atomically: a killed
    worker leaves no half file). synchronize: torch.cuda.synchronize on a GPU, so that the step's
    kernels finish inside the trace; profiler: torch.profiler.profile (tests: a stand-in)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    gc.collect()
    synchronize()
    with profiler(
        activities=profiler_activities(device_type), record_shapes=True, with_stack=False, schedule=_one_step
    ) as prof:
        prof.add_metadata_json("distributedInfo", json.dumps(RANK))
        gc.disable()
        try:
            step()
            synchronize()
        finally:
            gc.enable()
    tmp = path.with_name(path.name + ".tmp")
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, path)
    return path
