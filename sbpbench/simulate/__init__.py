"""Peak-memory prediction without the memory: the real step under fake tensors.

`estimate_point(spec, target="cuda")` runs the step `sbp run` measures on fake CPU tensors and
predicts the GPU's max_memory_allocated, its breakdown and the phase of the peak;
target="cpu" reproduces the CPU tracker's measurement to the byte.
"""

from .estimate import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION_FRACTION,
    MARGIN_NOTE,
    TARGETS,
    Estimate,
    check_estimate_host_memory,
    estimate,
    estimate_point,
)

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "FRAGMENTATION_FRACTION",
    "MARGIN_NOTE",
    "TARGETS",
    "Estimate",
    "check_estimate_host_memory",
    "estimate",
    "estimate_point",
]
