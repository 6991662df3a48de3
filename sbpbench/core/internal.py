"""What sbpbench's own packages use of the core beyond its public face (core/__init__.py).

The estimator follows a step's phases and attention state (simulate/), the runner counts the
checkpoint stores and the chunk kernels that ran (runner/point.py), and the peers reuse the
chunked head and the model's parts (methods/), and the memory timeline listens to the kinds of
the bytes the core allocates (memory_kinds). Those are internals: they may change with the algorithm. Naming them here, in one
list, keeps that use explicit. tests/unit/test_layers.py refuses any other import of a core submodule
from outside core.
"""

from . import memory_kinds
from .adapters import check_no_attention_dropout, resolve_parts, trainable, unwrap_model
from .attention import (
    ATTENTION_NAME,
    STATE_KWARG,
    ChunkState,
    KVBuffer,
    force_cuda_branch,
    grouped_as_for,
    kv_heads_per_call,
)
from .checkpoints import forwards_wrapped
from .head import counted_chunks, sequence_sums
from .kernels.kernel_choice import (
    CACHED,
    LOWER_RIGHT,
    REFERENCE,
    auto_mode,
    observe_chunk_kernels,
    record_chunk_calls,
    set_choice_cache,
    tune_chunk_calls,
)
from .labels import count_targets, loss_dtype, shift_labels
from .objectives import GRPO_LOSS_TYPES
from .placements.placement import CheckpointStore, observe_stores
from .placements.rebuild_schedule import every_input_buffers, schedule
from .placements.sequences import DeviceSequence

__all__ = [
    "ATTENTION_NAME",
    "CACHED",
    "GRPO_LOSS_TYPES",
    "LOWER_RIGHT",
    "REFERENCE",
    "STATE_KWARG",
    "CheckpointStore",
    "ChunkState",
    "DeviceSequence",
    "KVBuffer",
    "auto_mode",
    "check_no_attention_dropout",
    "count_targets",
    "counted_chunks",
    "every_input_buffers",
    "force_cuda_branch",
    "forwards_wrapped",
    "grouped_as_for",
    "kv_heads_per_call",
    "loss_dtype",
    "memory_kinds",
    "observe_chunk_kernels",
    "observe_stores",
    "record_chunk_calls",
    "resolve_parts",
    "schedule",
    "sequence_sums",
    "set_choice_cache",
    "shift_labels",
    "trainable",
    "tune_chunk_calls",
    "unwrap_model",
]
