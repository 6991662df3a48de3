"""What sbpbench's own packages use of the core beyond its public face (core/__init__.py).

The estimator follows a step's attention state and placements (simulate/), the runner warms the
chunk kernels a table names between steps (runner/kernel_table.py), the peers reuse the chunked head and the model's
parts (methods/), and the memory timeline names the kinds of the bytes the core allocates
(memory_kinds). What a caller watches or steers of a step goes in through `StepHooks` (the
public face), never through this list. These are internals: they may change with the algorithm.
Naming them here, in one list, keeps that use explicit. tests/unit/test_layers.py refuses any other import of a core submodule
from outside core.
"""

from . import memory_kinds
from .architecture.detectors import check_streamable
from .architecture.head_call import ModelHead
from .architecture.parts import resolve_parts, trainable, unwrap_model
from .architecture.self_check import Float64Throughout, architecture_key
from .architecture.verified import VERIFIED
from .attention import ATTENTION_NAME, STATE_KWARG, ChunkState, KVBuffer, kv_heads_per_call, lower_right_attention
from .checkpoints import forwards_wrapped
from .head import counted_chunks, sequence_sums
from .hooks import SteeredHooks
from .kernels.chunk_kernels import ChunkCall
from .kernels.kernel_choice import AUTO, KERNELS, LOWER_RIGHT, CallShape, select
from .labels import count_targets, loss_dtype, shift_labels
from .objectives import GRPO_LOSS_TYPES
from .placements.placement import CheckpointStore
from .placements.rebuild_schedule import every_input_buffers, schedule
from .placements.sequences import DeviceSequence

__all__ = [
    "ATTENTION_NAME",
    "AUTO",
    "GRPO_LOSS_TYPES",
    "KERNELS",
    "LOWER_RIGHT",
    "STATE_KWARG",
    "VERIFIED",
    "CallShape",
    "CheckpointStore",
    "ChunkCall",
    "ChunkState",
    "DeviceSequence",
    "Float64Throughout",
    "KVBuffer",
    "ModelHead",
    "SteeredHooks",
    "architecture_key",
    "check_streamable",
    "count_targets",
    "counted_chunks",
    "every_input_buffers",
    "forwards_wrapped",
    "kv_heads_per_call",
    "loss_dtype",
    "lower_right_attention",
    "memory_kinds",
    "resolve_parts",
    "schedule",
    "select",
    "sequence_sums",
    "shift_labels",
    "trainable",
    "unwrap_model",
]
