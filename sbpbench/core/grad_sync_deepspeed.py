"""DeepSpeed ZeRO-1/2 gradient sync (ZeRO-3 refused) for `stream_backward(engine, ...)` (core/README.md, "Several
processes"), built on DeepSpeed's own mechanism for tiled compute (`param.ds_grad_is_ready`, as
ALST's TiledMLP in deepspeed/runtime/sequence_parallel/ulysses_sp.py uses it).

ZeRO-2/3 reduce a parameter's gradient from a hook that fires after each accumulation into `.grad`
and assert "already been reduced" on the second; ZeRO-1 reduces in `engine.backward`'s epilogue.
StreamBP accumulates each gradient over many chunk backwards, so per unit (a decoder layer; the
root unit: embedding, final norm, lm_head):

    begin   ds_grad_is_ready = False: the hooks leave every chunk's gradient alone
    chunks  hook-free layer.forward; gradients summed in .grad (bf16: the fp32 ChunkGradAccumulator,
            rounded once into .grad)
    end     ds_grad_is_ready = True, then one autograd backward that adds an exact zero to each
            .grad: the hooks fire once, on the whole sum, and ZeRO reduces it once

The step is bracketed like `engine.backward(loss)`: its prologue, the gradient of each chunk's loss
divided by gradient_accumulation_steps() (what engine.forward's output hook does), its epilogue
(ZeRO-1: the reduction at the accumulation boundary). The zero-add costs one pass over a unit's
gradient, no collective and no extra memory (the zero is an expanded scalar).
"""

from __future__ import annotations

import torch
from torch import nn

from .adapters import DecoderParts, trainable
from .grad_sync import GradSync

# DeepSpeed internals used (0.19), checked by DeepSpeedSync.__init__ (_check_internals):
#   DeepSpeedEngine._backward_prologue()     what engine.backward runs before loss.backward()
#   DeepSpeedEngine._backward_epilogue()     ... after it: reduce (ZeRO-1 at the boundary), exit backward
#   DeepSpeedEngine._running_engine_backward True: the optimizer's end-of-backward callback leaves the
#                                            epilogue to the caller, as during engine.backward
#   ZeROOptimizer.clear_backward_seen_flag() what engine.forward runs first (resets the hook counters)
#   param.ds_grad_is_ready                   False: ZeRO's gradient hook neither reduces nor asserts
_ENGINE_INTERNALS = ("_backward_prologue", "_backward_epilogue", "_running_engine_backward")


def is_engine(model: nn.Module) -> bool:
    return type(model).__name__ == "DeepSpeedEngine" and type(model).__module__.startswith("deepspeed")


def under_zero(model: nn.Module) -> bool:
    """Parameters partitioned by ZeRO-3 carry ds_id; ZeRO-1/2 link each one to its fp32 copy (_hp_mapping)."""
    return any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in model.parameters())


def _check_internals(engine) -> None:
    missing = [name for name in _ENGINE_INTERNALS if not hasattr(engine, name)]
    optimizer = engine.optimizer
    if engine.zero_optimization() and not hasattr(optimizer, "clear_backward_seen_flag"):
        missing.append("ZeROOptimizer.clear_backward_seen_flag")
    if missing:
        import deepspeed

        raise RuntimeError(
            f"DeepSpeed {deepspeed.__version__} lacks {missing}: StreamBP's DeepSpeed sync is tested on "
            "DeepSpeed 0.19 (sbpbench/core/grad_sync_deepspeed.py)"
        )


class _ScaledGradient:
    """The objective with each chunk loss's gradient divided by `divisor` (its value unchanged), as
    engine.forward's output hook divides the loss's gradient by gradient_accumulation_steps()."""

    def __init__(self, objective, divisor: int):
        self._objective, self._divisor = objective, divisor

    def __getattr__(self, name):
        return getattr(self._objective, name)

    def chunk_loss(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        part = self._objective.chunk_loss(logits, start, end)
        if part.requires_grad:
            part.register_hook(lambda grad: grad / self._divisor)
        return part


class DeepSpeedSync(GradSync):
    """A DeepSpeedEngine at ZeRO stage 0-2 (3 refused) (bf16 or fp32; fp16 loss scaling is refused). Use as
    engine.backward: `stream_backward(engine, ...)` per micro-batch, then `engine.step()`."""

    def __init__(self, engine, parts: DecoderParts):
        _check_internals(engine)
        if engine.optimizer is None or type(engine.optimizer).__name__ == "DummyOptim":
            raise ValueError("the DeepSpeed engine has no optimizer: give deepspeed.initialize an optimizer")
        needs_scaler = getattr(engine.optimizer, "needs_scaler", None)
        if engine.fp16_enabled() or engine.amp_enabled() or (needs_scaler is not None and needs_scaler()):
            raise ValueError(
                "StreamBP's DeepSpeed sync does not apply fp16 loss scaling: train in bf16 or fp32 "
                '(DeepSpeed config "bf16": {"enabled": true})'
            )
        self.engine = engine
        if engine.zero_optimization_stage() == 3:
            # Tried (each unit gathered once with GatheredParameters and pinned, prefetch off): exact in
            # one full test run, then in the next the untied embedding's gradient was 64-69% wrong
            # (2 gloo ranks, untied SFT at 1 and 5 chunks). Refused until that is understood.
            raise ValueError(
                "StreamBP does not support DeepSpeed ZeRO-3 yet (its embedding gradient was not reliably exact): "
                "use ZeRO stage 1 or 2, or PyTorch FSDP2 (fully_shard) to shard the parameters too"
            )
        self.root = [parts.embed, parts.norm, parts.lm_head]
        self.divisor = engine.gradient_accumulation_steps()

    def objective(self, objective):
        return objective if self.divisor == 1 else _ScaledGradient(objective, self.divisor)

    def begin_step(self) -> None:
        engine = self.engine
        if engine.zero_optimization():
            engine.optimizer.clear_backward_seen_flag()
        engine._running_engine_backward = True  # the epilogue is ours (end_step), as in engine.backward
        engine._backward_prologue()
        self._begin_unit(self.root)

    def call(self, layer: nn.Module):
        return layer.forward  # hook-free: ZeRO-3 would gather and release per chunk

    def begin(self, layer: nn.Module) -> None:
        self._begin_unit([layer])

    def end(self, layer: nn.Module) -> None:
        self._end_unit([layer])

    def end_step(self) -> None:
        self._end_unit(self.root)
        try:
            self.engine._backward_epilogue()
        finally:
            self.engine._running_engine_backward = False

    def abort(self) -> None:
        for param in self.engine.module.parameters():
            _clear_ready(param)
        self.engine._running_engine_backward = False

    def _begin_unit(self, modules: list[nn.Module]) -> None:
        params = _unique(p for m in modules for p in m.parameters())
        for param in params:
            if param.requires_grad:
                param.ds_grad_is_ready = False

    def _end_unit(self, modules: list[nn.Module]) -> None:
        params = _unique(p for m in modules for p in trainable(m))
        for param in params:
            _clear_ready(param)  # ready again (DeepSpeed's default: the attribute absent)
        if params:
            # AccumulateGrad adds an expanded zero to each summed .grad (exact), then runs ZeRO's
            # post-accumulate hook: the gradient is reduced once, whatever the chunk count.
            zeros = [torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p) for p in params]
            torch.autograd.backward(params, zeros)


def _unique(params) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


def _clear_ready(param: nn.Parameter) -> None:
    if "ds_grad_is_ready" in param.__dict__:
        del param.ds_grad_is_ready
