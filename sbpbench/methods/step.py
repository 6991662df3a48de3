"""One point's training step: model, batch, optimizer and gradient protocol.

The measured worker (runner/point.py) times it on real tensors and the estimator
(simulate/fake_mode.py) runs it on fake ones: the same object, so the two count the same
resident tensors and run the same step.

Protocols: steady = gradient buffers (and AdamW's moments for step `train`) resident before the
step and zeroed in place, as in every step after a run's first; first = gradients None before the
step, allocated inside it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from functools import partial

import torch

from ..data import Batch
from .registry import prepared_method
from .settings import MethodSettings
from .training import (
    init_optimizer_state,
    make_optimizer,
    optimizer_state_bytes,
    optimizer_state_tensors,
    trainable_parameters,
)


def storage_bytes(tensors, granularity_bytes: int = 1) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped), each rounded up to
    granularity_bytes. Keyed by storage identity, which also holds for fake tensors (whose
    storages all report data_ptr 0). A DTensor (FSDP2's sharded parameters) counts its local shard."""
    tensors = [getattr(t, "_local_tensor", t) for t in tensors if t is not None]
    sizes = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(-(-n // granularity_bytes) * granularity_bytes for n in sizes.values())


class TrainingStep:
    """What one measured point runs, and what is allocated before it runs."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: Batch,
        *,
        method: str,
        settings: MethodSettings,
        step: str,
        protocol: str,
        foreach_optimizer: bool | None = None,
        allocation: AbstractContextManager | None = None,
        sequence_parallel=None,
    ):
        """foreach_optimizer: force AdamW's multi-tensor implementation on or off (None: PyTorch's
        choice, foreach for CUDA parameters). allocation: the context resident buffers are made in
        (the estimator's fake-tensor mode). sequence_parallel: the ranks sharing each sequence (a
        core SequenceParallel; the method must take it, methods/registry.py)."""
        self.model = model.train()
        self.batch = batch
        # checked and filled once, not per step: the batch has something to predict, the knobs are
        # what the method reads (a spec's already are; a library caller's may not be)
        self.method, self.protocol = method, protocol
        self._step = prepared_method(method, batch, settings, sequence_parallel)
        self.settings = self._step.keywords["settings"]
        self.trainable = trainable_parameters(self.model)
        self.optimizer = make_optimizer(self.model) if step == "train" else None
        if self.optimizer is not None and foreach_optimizer is not None:
            for group in self.optimizer.param_groups:
                group["foreach"] = foreach_optimizer
        if protocol == "steady":
            with allocation or nullcontext():
                for p in self.trainable:
                    p.grad = torch.zeros_like(p)
                if self.optimizer is not None:
                    init_optimizer_state(self.optimizer)

    @property
    def grads_bytes(self) -> int:
        """Trainable parameters' gradients, resident or not (per protocol); this rank's shards
        under FSDP2."""
        return sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in self.trainable)

    @property
    def optimizer_state_bytes(self) -> int | None:
        return None if self.optimizer is None else optimizer_state_bytes(self.optimizer)

    def resident_tensors(self) -> list[torch.Tensor]:
        """What is allocated before a step: weights, gradients (present under the steady
        protocol), the batch's tensors and the optimizer's state."""
        model = self.model
        tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
        tensors += [t for t in vars(self.batch).values() if isinstance(t, torch.Tensor)]
        if self.optimizer is not None:
            tensors += optimizer_state_tensors(self.optimizer)
        return tensors

    def prepare(self) -> None:
        """Before each step, outside any measured region."""
        for p in self.trainable:
            if self.protocol == "steady":
                p.grad.zero_()
            else:
                p.grad = None
        if self.optimizer is not None and self.protocol == "first":
            self.optimizer.state.clear()  # the moments are allocated inside the step
        gc.collect()  # reference cycles must not carry one step's tensors into the next

    @contextmanager
    def using(self, **knobs) -> Iterator[None]:
        """The steps run inside read these knob values instead of the settings' (the runner's
        chunk kernels picked from a table of measured ones); undone on exit."""
        step, settings = self._step, self.settings
        self.settings = replace(settings, **knobs)
        self._step = partial(step.func, *step.args, **{**step.keywords, "settings": self.settings})
        try:
            yield
        finally:
            self._step, self.settings = step, settings

    def run(self) -> torch.Tensor:
        """One step: the method's forward and backward, then the optimizer's step if any."""
        loss = self._step(self.model, self.batch)
        if self.optimizer is not None:
            self.optimizer.step()
        return loss
