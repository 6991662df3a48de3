"""A memory timeline's recorder told where a step is and what its tensors are for, on any method.

`marking(recorder, step)` attaches, for the duration of one step:
- the phase labels of the model's parts (phase_labels.py) and StreamBP's own phases (its
  PhaseTimer's, through `streambp.timing_phases(on_phase=...)`), which the recorder names;
- StreamBP's kinds (core/memory_kinds.py: checkpoints, K/V buffers, dK/dV sums, gradient sums,
  logits), with the recorder as the listener;
- gradients by identity: a trainable parameter's .grad is noted as gradients when autograd has
  accumulated into it (a first-protocol step makes them inside the step);
- a checkpointed model's layer inputs (transformers' gradient checkpointing keeps each decoder
  layer's input for its recompute) noted as checkpoints;
- the host: the step's checkpoint stores' host copies and the process's RSS at each phase change.
The hooks allocate nothing, so the memory counted is the step's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial

import torch

from ..core import UnsupportedModelError
from ..core.internal import memory_kinds, resolve_parts
from .phase_labels import PhaseLabels
from .streambp import step_hooks, timing_phases


@contextmanager
def marking(recorder, step, rss_bytes=lambda: None, *, label_phases: bool = True) -> Iterator[None]:
    """recorder: a timeline recorder (measure/timeline/marks.py PhaseMarks and core's listener);
    step: the point's TrainingStep (methods/step.py); rss_bytes: () -> the process's RSS now.
    label_phases: False where the caller's own PhaseLabels already label the recorder (the estimator)."""
    model = step.model
    with ExitStack() as stack:
        if label_phases:
            labels = PhaseLabels(recorder, chunked_head=step.method == "streambp")
            stack.enter_context(labels.attached(model, step.optimizer))
        stack.enter_context(timing_phases(on_phase=recorder.on_stage))
        for parameter in step.trainable:
            hook = parameter.register_post_accumulate_grad_hook(partial(_note_gradient, recorder))
            stack.callback(hook.remove)
        for layer in _layers(model):
            hook = layer.register_forward_pre_hook(partial(_note_checkpoint, recorder), with_kwargs=True)
            stack.callback(hook.remove)
        stores = []  # StreamBP's steps tell the recorder their kinds and hand over their stores
        stack.enter_context(step_hooks(kinds=recorder, on_store=stores.append))
        recorder.host_probe = lambda: (sum(store.host_bytes for store in stores), rss_bytes())
        stack.callback(setattr, recorder, "host_probe", None)
        yield


def _note_gradient(recorder, parameter: torch.Tensor) -> None:
    memory_kinds.note(recorder, memory_kinds.GRADIENTS, parameter.grad)


def _note_checkpoint(recorder, layer, args, kwargs) -> None:
    """A decoder layer under transformers' gradient checkpointing keeps its input for the recompute."""
    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor):
            memory_kinds.note(recorder, memory_kinds.CHECKPOINTS, hidden)


def _layers(model) -> list:
    try:
        return list(resolve_parts(model).layers)
    except UnsupportedModelError:
        return []
