"""The bench's seam into StreamBP steps (methods/streambp.step_hooks): nested contexts add callbacks
to the outer ones, replace every other field, and leave the outer hooks as they were on exit."""

from __future__ import annotations

import torch

from sbpbench.core import StepHooks
from sbpbench.methods.streambp import current_hooks, step_hooks


def test_nested_hooks_add_callbacks_and_replace_the_rest():
    """An inner on_kernel runs after the outer one; an inner None keeps the outer; an inner
    sized_for replaces the outer and is undone on exit."""
    seen = []
    with step_hooks(on_kernel=seen.append, sized_for=8):
        with step_hooks(on_kernel=None):
            current_hooks().on_kernel("a")
        with step_hooks(on_kernel=lambda name: seen.append(name.upper()), sized_for=16):
            current_hooks().on_kernel("b")
            assert current_hooks().sized_for == 16
        assert current_hooks().sized_for == 8
    assert seen == ["a", "b", "B"] and current_hooks().on_kernel is None


def test_step_hooks_hold_no_kernel_choosing():
    """What a chunk's attention runs is StreamConfig's (a name or a picker), never a hook: the hooks
    only watch the kernels (on_kernel, on_chunk_call)."""
    names = set(StepHooks.__dataclass_fields__)
    assert {"on_kernel", "on_chunk_call"} <= names and not names & {"kernel_mode", "chooser"}


def test_the_public_hooks_only_watch():
    """StepHooks' fields are what a training loop watches; the estimator's steering (shapes only, the
    CUDA branch, a step's length for grouping) lives in core.internal's SteeredHooks."""
    from sbpbench.core.internal import SteeredHooks

    watching = {"timer", "progress", "kinds", "on_store", "on_kernel", "on_chunk_call", "on_capture"}
    assert set(StepHooks.__dataclass_fields__) == watching
    assert set(SteeredHooks.__dataclass_fields__) - watching == {"shapes_only", "cuda_branch", "sized_for"}


def test_on_capture_reports_each_chunk_of_each_layers_key_value_capture():
    """A layer backward's K/V capture, by the projection alone or by the whole layer, tells
    on_capture each chunk with its start set: every layer, every chunk, first to last."""
    from sbpbench.core import StreamConfig, stream_backward
    from sbpbench.core.layout import chunk_bounds

    from ..conftest import tiny_model

    model = tiny_model("tiny/qwen3", torch.float64)
    input_ids = torch.randint(0, model.config.vocab_size, (1, 23))
    starts = []
    hooks = StepHooks(on_capture=lambda buffer: starts.append(buffer.start))
    stream_backward(model, input_ids, input_ids, config=StreamConfig(chunk_size=5), hooks=hooks)
    chunks = [start for start, _ in chunk_bounds(23, 5)]
    assert starts == chunks * model.config.num_hidden_layers
