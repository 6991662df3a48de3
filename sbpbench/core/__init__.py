"""Exact StreamBP (Luo et al., arXiv 2506.03077) for HuggingFace causal LMs.

A training loop calls `stream_backward(model, input_ids, labels, config=StreamConfig(...))`
instead of `model(..., labels=labels).loss.backward()`: same loss, same gradients, without
full-sequence logits or a whole layer's intermediates in memory. `StepHooks` is what a caller
watches of a step (a timer, progress, memory kinds); `SequenceParallel` the ranks that share
each sequence (Ulysses). Imports torch and transformers only.
core/README.md tells the algorithm as this package implements it, in its order of work.
This module is the library's face; internal.py is what sbpbench's own packages use besides.
"""

from .architecture.parts import UnsupportedModelError
from .architecture.self_check import SelfCheck
from .config import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK_SIZE, StreamConfig
from .cuda_calls import release_pinned_memory
from .hooks import LayerProgress, StepHooks
from .labels import IGNORE_INDEX
from .objectives import DPO, GRPO, SFT, Objective
from .parallel.sequence_group import SequenceParallel
from .phases import PhaseTimer, PhaseTimes
from .placements.placement import Placement
from .stream import check_model, stream_backward

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_LOGITS_CHUNK_SIZE",
    "DPO",
    "GRPO",
    "IGNORE_INDEX",
    "SFT",
    "LayerProgress",
    "Objective",
    "PhaseTimer",
    "PhaseTimes",
    "Placement",
    "SelfCheck",
    "SequenceParallel",
    "StepHooks",
    "StreamConfig",
    "UnsupportedModelError",
    "check_model",
    "release_pinned_memory",
    "stream_backward",
]
