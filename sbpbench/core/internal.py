"""What sbpbench's own packages use of the core beyond its public face (core/__init__.py).

The estimator follows a step's attention state and placements (simulate/), the runner tunes the
chunk kernels between steps (runner/point.py), the peers reuse the chunked head and the model's
parts (methods/), and the memory timeline names the kinds of the bytes the core allocates
(memory_kinds). What a caller watches or steers of a step goes in through `StepHooks` (the
public face), never through this list. These are internals: they may change with the algorithm.
Naming them here, in one list, keeps that use explicit. tests/unit/test_layers.py refuses any other import of a core submodule
from outside core.
"""

from . import memory_kinds
from .adapters import check_no_attention_dropout, resolve_parts, trainable, unwrap_model
from .attention import ATTENTION_NAME, STATE_KWARG, ChunkState, KVBuffer, kv_heads_per_call
from .checkpoints import forwards_wrapped
from .head import counted_chunks, sequence_sums
from .kernels.kernel_choice import CACHED, LOWER_RIGHT, REFERENCE, CallShape, KernelChooser, tune_chunk_calls
from .labels import count_targets, loss_dtype, shift_labels
from .objectives import GRPO_LOSS_TYPES
from .placements.placement import CheckpointStore
from .placements.rebuild_schedule import every_input_buffers, schedule
from .placements.sequences import DeviceSequence

__all__ = [
    "ATTENTION_NAME",
    "CACHED",
    "GRPO_LOSS_TYPES",
    "LOWER_RIGHT",
    "REFERENCE",
    "STATE_KWARG",
    "CallShape",
    "CheckpointStore",
    "ChunkState",
    "DeviceSequence",
    "KVBuffer",
    "KernelChooser",
    "check_no_attention_dropout",
    "count_targets",
    "counted_chunks",
    "every_input_buffers",
    "forwards_wrapped",
    "kv_heads_per_call",
    "loss_dtype",
    "memory_kinds",
    "resolve_parts",
    "schedule",
    "sequence_sums",
    "shift_labels",
    "trainable",
    "tune_chunk_calls",
    "unwrap_model",
]
