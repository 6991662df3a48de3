"""How long a point may run: its timeout.

Unless given (--timeout, an experiment's timeout_s), a point may run for
START_S + SAFETY_FACTOR x steps x (executed FLOPs of one step / ASSUMED_RATES[device kind, dtype]),
steps = warmup + the memory step + repeats. The executed FLOPs are measure/flops.py's per-phase
count (recomputation included; a recompute:K placement adds one more forward). The rates are set
low on purpose: a timeout is a guard against a hung point, and a good point cut short wastes more
than a hung one runs on.
- cuda bf16: 150 TFLOP/s executed (an H100's StreamBP measured 187-220 model TFLOP/s);
  fp32 without TF32 15, fp64 1 (consumer cards run fp64 at a few percent of fp32).
- cpu fp32: 2 GFLOP/s, whatever the thread count: this project's 2-core machine measured 58-85
  (small/qwen3, bp, T = 2048-8192, 2 threads, idle), and a load of 6 made steps up to 9x slower;
  ranks of one point (--nproc) share the cores, so the CPU time is multiplied by nproc.
START_S covers start-up (imports, fork or a fresh interpreter) and building the model (tens of
seconds for an 8B model on a GPU, minutes for 32B initialised on the host).
"""

from __future__ import annotations

import math
from functools import cache

from ..config import RunSpec
from ..config.device import device_kind
from ..core import Placement
from ..measure.flops import phase_flops

START_S = 600.0
SAFETY_FACTOR = 2.0
ASSUMED_RATES = {  # executed FLOP/s, (device kind, dtype)
    ("cuda", "bf16"): 150e12,
    ("cuda", "fp32"): 15e12,
    ("cuda", "fp64"): 1e12,
    ("cpu", "bf16"): 1e9,
    ("cpu", "fp32"): 2e9,
    ("cpu", "fp64"): 1e9,
}
# measure/flops.py prices bp, ckpt and streambp; the peers run one of their schedules
PHASE_MODEL = {"streambp": "streambp", "official": "streambp", "bp": "bp"}  # any other method: ckpt's


@cache
def _config(model: str, num_layers: int | None):
    from ..models import load_config

    return load_config(model, **({"num_hidden_layers": num_layers} if num_layers else {}))


def executed_flops(
    config, *, method: str, batch_size: int, seq_len: int, checkpoints: Placement | None = None
) -> float:
    """FLOPs one step executes (measure/flops.py's phases of the method's schedule, plus one
    forward more for a recompute placement)."""
    phases = phase_flops(config, method=PHASE_MODEL.get(method, "ckpt"), batch_size=batch_size, seq_len=seq_len)
    total = sum(matmul + attention for matmul, attention in phases.values())
    if checkpoints and checkpoints.recompute_every > 1:
        total += sum(phases["checkpoint pass"])
    return total


def step_flops(spec: RunSpec) -> float:
    return executed_flops(
        _config(spec.model, spec.num_layers),
        method=spec.method,
        batch_size=spec.batch_size,
        seq_len=spec.seq_len,
        checkpoints=spec.settings.checkpoints,
    )


def predicted_timeout_s(spec: RunSpec) -> float:
    """The module docstring's timeout for the point."""
    kind = device_kind(spec.device)
    steps = spec.warmup + 1 + spec.repeats
    seconds = steps * step_flops(spec) / ASSUMED_RATES[kind, spec.dtype]
    if kind == "cpu":
        seconds *= spec.nproc
    return float(math.ceil(START_S + SAFETY_FACTOR * seconds))


def point_timeout_s(spec: RunSpec) -> float:
    """The timeout a point runs under: the one given, else predicted_timeout_s."""
    return spec.timeout_s if spec.timeout_s is not None else predicted_timeout_s(spec)
