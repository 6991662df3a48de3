"""The bench's seam into StreamBP steps (methods/streambp.step_hooks): nested contexts add callbacks
to the outer ones, replace every other field, and leave the outer hooks as they were on exit."""

from __future__ import annotations

from sbpbench.core.internal import CACHED, REFERENCE
from sbpbench.methods.streambp import current_hooks, step_hooks


def test_nested_hooks_add_callbacks_and_replace_the_rest():
    """An inner on_kernel runs after the outer one; an inner None keeps the outer; an inner
    kernel_mode replaces the outer and is undone on exit."""
    seen = []
    with step_hooks(on_kernel=seen.append, kernel_mode=REFERENCE):
        with step_hooks(on_kernel=None):
            current_hooks().on_kernel("a")
        with step_hooks(on_kernel=lambda name: seen.append(name.upper()), kernel_mode=CACHED):
            current_hooks().on_kernel("b")
            assert current_hooks().kernel_mode == CACHED
        assert current_hooks().kernel_mode == REFERENCE
    assert seen == ["a", "b", "B"] and current_hooks().on_kernel is None
