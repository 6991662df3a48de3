"""The CUDA caching allocator's setting in a point's worker: expandable segments for long points.

The per-process cap (`set_per_process_memory_fraction`) applies to the memory the allocator has
reserved, not to the tensors' bytes: a long step whose chunk-sized allocations vary (the last chunk,
the growing attention prefix, the head's logits chunks) leaves free slivers at the ends of cached
segments that no later request fits, and the point runs out of memory with allocated bytes below
the cap. With `expandable_segments:True` the allocator keeps one segment per stream and maps 20 MiB
pages onto its end as needed (c10/cuda/CUDACachingAllocator.cpp, "Expandable segments"), so
max_memory_reserved stays close to max_memory_allocated and the OOM comes where the tensors reach
the cap. max_memory_allocated (the paper's figure, our peak) does not depend on it.

So a CUDA point of T >= LONG_CONTEXT_SEQ_LEN runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True;
shorter points keep the default allocator, as the paper's runs did, so their OOM boundaries compare
with its Figure 3. A setting the user made (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF, the newer
name) is left as it is. The row records what the worker ran with (cuda_alloc_conf).
PYTORCH_CUDA_ALLOC_CONF, not the newer name: torch 2.9 ignored expandable_segments under the newer
one on CUDA (pytorch/pytorch#183387), and every version reads the older one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..config.long_context import LONG_CONTEXT_SEQ_LEN

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
LONG_POINT_ALLOC_CONF = "expandable_segments:True"


def worker_environment(device: str, seq_len: int, env: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """The environment of a point's worker (env; None: this process's), with the allocator setting
    of a long CUDA point added where the user has made none."""
    base = os.environ if env is None else env
    long_cuda = device.startswith("cuda") and seq_len >= LONG_CONTEXT_SEQ_LEN
    if not long_cuda or any(base.get(name) for name in ALLOC_CONF_VARS):
        return env
    return {**base, "PYTORCH_CUDA_ALLOC_CONF": LONG_POINT_ALLOC_CONF}


def allocator_setting(environ: Mapping[str, str] = os.environ) -> str:
    """The allocator setting this process runs with, as the row records it ("" for the default)."""
    return ";".join(f"{name}={environ[name]}" for name in ALLOC_CONF_VARS if environ.get(name))
