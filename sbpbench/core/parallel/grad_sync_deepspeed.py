"""DeepSpeed ZeRO-1/2/3 gradient sync for `stream_backward(engine, ...)` (core/README.md, "Several
processes"), built on DeepSpeed's own mechanism for tiled compute (`param.ds_grad_is_ready`, as
ALST's TiledMLP in deepspeed/runtime/sequence_parallel/ulysses_sp.py uses it).

ZeRO-2/3 reduce a parameter's gradient from a hook that fires after each accumulation into `.grad`
and assert "already been reduced" on the second; ZeRO-1 reduces in `engine.backward`'s epilogue.
StreamBP accumulates each gradient over many chunk backwards, so per unit (a decoder layer; the
root unit: embedding, final norm, lm_head):

    begin   ZeRO-3: gather the unit's parameters once and pin them (module hooks leave them gathered);
            ds_grad_is_ready = False: the hooks leave every chunk's gradient alone
    chunks  hook-free layer.forward; gradients summed in .grad (bf16: the fp32 ChunkGradAccumulator,
            rounded once into .grad)
    end     ds_grad_is_ready = True, then one autograd backward that adds an exact zero to each
            .grad: the hooks fire once, on the whole sum, and ZeRO reduces it once; ZeRO-3: release

The checkpoint pass gathers each layer once too (`gathered`), so ZeRO-3 issues one all-gather per
parameter per pass, as engine.forward and engine.backward do, whatever the chunk count.

The step is bracketed like `engine.backward(loss)`: its prologue, the gradient of each chunk's loss
divided by gradient_accumulation_steps() (what engine.forward's output hook does), its epilogue
(ZeRO-1: the reduction at the accumulation boundary). The zero-add costs one pass over a unit's
gradient, no collective and no extra memory (the zero is an expanded scalar).
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn

from ..architecture.parts import DecoderParts, trainable
from .grad_sync_base import GradSync

# DeepSpeed internals used (0.19), checked by DeepSpeedSync.__init__ (_check_internals):
#   DeepSpeedEngine._backward_prologue()     what engine.backward runs before loss.backward()
#   DeepSpeedEngine._backward_epilogue()     ... after it: reduce (ZeRO-1 at the boundary), exit backward
#   DeepSpeedEngine._running_engine_backward True: the optimizer's end-of-backward callback leaves the
#                                            epilogue to the caller, as during engine.backward
#   ZeROOptimizer.clear_backward_seen_flag() what engine.forward runs first (resets the hook counters)
#   param.ds_grad_is_ready                   False: ZeRO's gradient hook neither reduces nor asserts
#   param.ds_active_sub_modules              ZeRO-3: the modules using a gathered parameter; while it is
#                                            not empty, module hooks do not release the parameter
_ENGINE_INTERNALS = ("_backward_prologue", "_backward_epilogue", "_running_engine_backward")
_PIN = -1  # ZeRO-3: our entry in ds_active_sub_modules (module ids are >= 0)


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
            "DeepSpeed 0.19 (sbpbench/core/parallel/grad_sync_deepspeed.py)"
        )


def scales_loss(engine) -> bool:
    """Whether the engine applies fp16 loss scaling, which this sync does not. Feature-detected, as
    DeepSpeed changes within a minor series (0.19.8 removed Apex AMP and engine.amp_enabled(),
    deepspeedai/DeepSpeed#8564): each probe counts only where the engine has it."""
    amp_enabled = getattr(engine, "amp_enabled", None)  # Apex AMP, DeepSpeed < 0.19.8
    needs_scaler = getattr(engine.optimizer, "needs_scaler", None)  # ZeRO optimizers: fp16 or a custom scaler
    return bool(
        engine.fp16_enabled()
        or (amp_enabled is not None and amp_enabled())
        or (needs_scaler is not None and needs_scaler())
        # torch.autocast in fp16 without ZeRO: the engine scales the loss with a torch GradScaler
        or getattr(engine, "torch_autocast_z0_gradscaler", None) is not None
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
    """A DeepSpeedEngine at ZeRO stage 0-3 (bf16 or fp32; fp16 loss scaling is refused). Use as
    engine.backward: `stream_backward(engine, ...)` per micro-batch, then `engine.step()`."""

    def __init__(self, engine, parts: DecoderParts):
        _check_internals(engine)
        if engine.optimizer is None or type(engine.optimizer).__name__ == "DummyOptim":
            raise ValueError("the DeepSpeed engine has no optimizer: give deepspeed.initialize an optimizer")
        if scales_loss(engine):
            raise ValueError(
                "StreamBP's DeepSpeed sync does not apply fp16 loss scaling: train in bf16 or fp32 "
                '(DeepSpeed config "bf16": {"enabled": true})'
            )
        self.engine = engine
        self.zero3 = engine.zero_optimization_stage() == 3
        self.root = [parts.embed, parts.norm, parts.lm_head]
        self.divisor = engine.gradient_accumulation_steps()
        self._gathers: dict[int, ExitStack] = {}  # ZeRO-3: id(first module of a unit) -> its gather

    def sequence_parallel_scale(self, world: int) -> float:
        """DeepSpeed 0.19 with an mpu of sequence-parallel groups: ZeRO-0/1/2 divide each gradient by
        the data-parallel size alone (world / sp, stage_1_and_2.py), so they sum over the sequence
        ranks; ZeRO-3's reduce-scatter (`reduce_scatter_coalesced`) divides by every rank, so each
        rank's loss is scaled by P. ZeRO-3 without reduce_scatter divides by one or the other per
        bucket (its contiguous path corrects for sp, the other does not): refused."""
        if not self.zero3:
            return 1.0
        if not getattr(self.engine.optimizer, "reduce_scatter", True):
            raise ValueError(
                "ZeRO-3 with reduce_scatter false averages gradients over the sequence ranks in some buckets and "
                "not in others; keep zero_optimization.reduce_scatter true (the default) with sequence parallelism"
            )
        return float(world)

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

    def gathered(self, layer: nn.Module):
        return _gather(_unique(layer.parameters())) if self.zero3 else super().gathered(layer)

    rebuilding = gathered

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
        for stack in self._gathers.values():
            stack.close()
        self._gathers.clear()
        for param in self.engine.module.parameters():
            _clear_ready(param)
        self.engine._running_engine_backward = False

    def _begin_unit(self, modules: list[nn.Module]) -> None:
        params = _unique(p for m in modules for p in m.parameters())
        if self.zero3:
            self._gathers[id(modules[0])] = _gather(params)
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
        stack = self._gathers.pop(id(modules[0]), None)
        if stack is not None:
            stack.close()


def _unique(params) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


def _clear_ready(param: nn.Parameter) -> None:
    if "ds_grad_is_ready" in param.__dict__:
        del param.ds_grad_is_ready


def _gather(params: list[nn.Parameter]) -> ExitStack:
    """ZeRO-3: all-gather `params` and keep them gathered until the stack closes: module hooks
    (fetch on __call__, release after it) find them available and, pinned, leave them. Persistent
    parameters (below stage3_param_persistence_threshold) are never partitioned: left alone.

    A parameter that ZeRO's prefetcher has in flight (it follows the module order traced from
    engine.forward calls, an evaluation say) is left to it: the submodule's hook waits for it before
    use, as in an ordinary step.

    One GatheredParameters per parameter: given a list, DeepSpeed 0.19 launches an async all-gather
    per parameter and waits on the last one only (_allgather_params_coalesced), which orders them on
    a CUDA stream but not on gloo, whose worker threads may still be writing the others (measured on
    2 CPU ranks: wrong gradients in 5 of 52 ZeRO-3 cases, none in 64 after). Same collectives."""
    import deepspeed

    params = [p for p in params if not getattr(p, "ds_persist", False)]
    stack = ExitStack()
    for param in params:
        stack.enter_context(deepspeed.zero.GatheredParameters([param], modifier_rank=None))
        param.ds_active_sub_modules.add(_PIN)
    # On close, before the release: the unit's backward is over, so no module still uses these
    # parameters, but one called with inputs that need no gradient (the embedding) never ran its
    # post-backward release and is still listed; DeepSpeed clears them the same way
    # (PartitionedParameterCoordinator.release_and_reset_all).
    stack.callback(lambda: [param.ds_active_sub_modules.clear() for param in params])
    return stack
