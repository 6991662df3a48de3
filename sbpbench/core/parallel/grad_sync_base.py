"""The interface every gradient sync implements (grad_sync.py says what each call is for), and
the one-process sync that does nothing: the base both FSDP2's (grad_sync.py) and DeepSpeed's
(grad_sync_deepspeed.py) sync extend."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

from torch import nn


class GradSync:
    """One process: nothing to gather or reduce; chunks go through `__call__` (hooks run)."""

    def begin_step(self) -> None:
        pass

    def call(self, layer: nn.Module):
        return layer

    def gathered(self, layer: nn.Module):
        """A context holding `layer`'s parameters gathered while the checkpoint pass runs its chunks
        (nothing to do here; FSDP2's hooks on the layer's __call__ already gather once per call)."""
        return nullcontext()

    def rebuilding(self, layer: nn.Module):
        """A context holding `layer`'s parameters gathered while a recompute placement rebuilds its
        output chunk by chunk through `call(layer)` (placement.py): one gather per rebuild."""
        return nullcontext()

    def head(self, module: nn.Module):
        """What to call for the embedding, the final norm or the lm_head."""
        return module

    def gather_head(self) -> None:
        """Before the head and the embedding's backward: their parameters gathered (no collective
        when still gathered)."""

    def begin(self, layer: nn.Module) -> None:
        pass

    def end(self, layer: nn.Module) -> None:
        pass

    def end_step(self) -> None:
        pass

    def sequence_parallel_scale(self, world: int) -> float:
        """What each rank's loss is multiplied by under sequence parallelism over `world` ranks, so
        that the engine's reduction leaves the whole sequence's gradient: 1 where it sums over the
        sequence ranks (here the step itself sums: parallel/sequence_step.py)."""
        return 1.0

    def objective(self, objective):
        """The objective as the engine's backward would see it (DeepSpeed: gradient / accumulation steps)."""
        return objective

    def abort(self) -> None:
        """After an exception mid-step: leave the engine ready for the next step."""

    @contextmanager
    def step(self):
        """begin_step() on entry, end_step() after a body that finished, abort() after one that raised."""
        self.begin_step()
        try:
            yield self
        except BaseException:
            self.abort()
            raise
        self.end_step()


NoSync = GradSync
