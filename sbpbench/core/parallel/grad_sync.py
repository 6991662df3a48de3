"""Gradient synchronisation for data-parallel engines: gather a unit's parameters once, run its
chunks hook-free, reduce its gradients once (core/README.md, "Several processes").

StreamBP runs each decoder layer many times per step (one K/V capture and one backward per chunk).
An engine that gathers parameters in a forward hook and reduces gradients in a backward hook
expects one call per layer: calling an FSDP2 layer through `__call__` once per chunk silently
reduces only the first chunk's gradient (the later chunks take FSDP's activation-checkpointing
shortcut, register no hook and are never reduced). So a `GradSync` owns the communication:

    begin_step()     before the checkpoint pass: gather the root unit (embedding, final norm, lm_head)
                     and any unit of their own those three are in (Accelerate's FSDP2 layout)
    call(layer)      what to call per chunk: the layer itself, or its hook-free `forward`
    head(module)     the same for the embedding, final norm and lm_head; gather_head() gathers
                     their units again where the checkpoint pass resharded one
    begin(layer)     before a layer's backward: gather its parameters (once)
    end(layer)       after it, the chunks' gradients summed in the unsharded `.grad`: reduce (once)
    end_step()       after the embedding's backward: reduce the root unit, finish the backward

`for_model` picks the implementation by inspecting the model: `NoSync` for one process (calls go
through `__call__` as before), `FSDP2Sync` for a model wrapped with `fully_shard` or FSDP2's
`replicate`, `DeepSpeedSync` (grad_sync_deepspeed.py) for a DeepSpeedEngine at any ZeRO stage. The communication then equals plain FSDP2 backprop's whatever the chunk count: the
checkpoint pass gathers each layer through the model's own hooks, the backward gathers each layer
once more unless it was kept unsharded (`reshard_after_forward=False`), and each unit is reduced
once (reduce-scatter, all-reduce under `replicate`/HSDP). `set_requires_gradient_sync(False)` for
gradient accumulation is honoured: FSDP2's own post-backward keeps the unsharded gradient.

FSDP2 has no public "reduce this unit now" call outside autograd hooks, so `FSDP2Sync` uses three
private names, pinned here and nowhere else; tests/distributed/test_distributed.py counts the collectives, so a
torch release that changes them fails CI instead of silently changing gradients.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from ..architecture.parts import DecoderParts
from .grad_sync_base import GradSync, NoSync
from .grad_sync_deepspeed import DeepSpeedSync, is_engine, under_zero

# FSDP2 internals used (torch 2.13; older releases have one `_fsdp_param_group`, see _param_groups):
#   FSDPModule._get_fsdp_state()                  the unit's FSDPState
#   FSDPState._lazy_init()                        root initialisation, normally run by the root's forward
#   FSDPParamGroup.post_backward()                accumulate, reshard, reduce-scatter / all-reduce the unit
#   FSDPState._root_post_backward_final_callback  end of backward: waits on reductions, resets state
# FSDP2Sync.__init__ checks they exist and raises otherwise.


def unwrap(model: nn.Module) -> nn.Module:
    """The model a DeepSpeedEngine wraps (engine.module), else `model` itself."""
    return model.module if is_engine(model) else model


def for_model(model: nn.Module, parts: DecoderParts, *, sequence_parallel: bool = False) -> GradSync:
    """The adapter for `model`: `DeepSpeedSync` for a DeepSpeedEngine, FSDP2 when any module is an
    FSDPModule, else `NoSync`. FSDP2: each decoder layer must be its own FSDP unit; embedding, final
    norm and lm_head must belong to the root unit or to units holding no decoder layer. A module
    under ZeRO given without its engine is refused, and so is sequence/context parallelism that
    StreamBP is not told of (check_no_sequence_parallel; sequence_parallel: it is, sequence_step.py)."""
    check_no_sequence_parallel(model, parts.config, told=sequence_parallel)
    if is_engine(model):
        return DeepSpeedSync(model, parts)
    if under_zero(model):
        raise ValueError(
            "this model's parameters are managed by DeepSpeed ZeRO: pass the DeepSpeedEngine that "
            "deepspeed.initialize returned, stream_backward(engine, ...), not engine.module, so that "
            "StreamBP can run the engine's backward prologue and reductions (docs/distributed.md)"
        )
    layers, head_modules = parts.layers, [parts.embed, parts.norm, parts.lm_head]
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return NoSync()
    root = next((m for m in model.modules() if isinstance(m, FSDPModule)), None)
    if root is None:
        return NoSync()
    return FSDP2Sync(root, layers, head_modules, FSDPModule)


# Sequence/context parallelism splits T over ranks and exchanges keys/values inside attention
# (Ulysses all-to-all, ring attention). StreamBP replaces the attention function with its own: not
# told of the split (`stream_backward(..., sequence_parallel=...)`), it would attend to a local slice
# only. Recognised by the attention implementation's name or a device-mesh dimension. Told, it does
# Ulysses' all-to-alls itself (parallel/sequence_layer.py), so Ulysses' attention and an "sp" mesh
# dimension pass; ring attention and torch's context parallel ("cp") stay refused: their causal path
# needs equal query and key lengths, and every StreamBP chunk attends over a longer prefix.
_ULYSSES_ATTENTION = ("ulysses", "sequence", "usp")
_RING_ATTENTION = ("ring", "context")
_ULYSSES_MESH_DIMS = {"sp", "sequence"}
_RING_MESH_DIMS = {"cp", "context"}
_RING_REASON = (
    "torch's context parallel and ring attention are refused: their causal attention needs equal query and key "
    "lengths (NotImplementedError otherwise), and each StreamBP chunk attends over a longer prefix; use "
    "Ulysses sequence parallelism, stream_backward(..., sequence_parallel=SequenceParallel(group))"
)


def check_no_sequence_parallel(model: nn.Module, config, *, told: bool = False) -> None:
    """Raise ValueError if the model looks sequence/context parallel in a way StreamBP does not run
    (see above). told: the step was given its sequence-parallel group."""
    attention = str(getattr(config, "_attn_implementation", "") or "").lower()
    if any(hint in attention for hint in _RING_ATTENTION):
        raise ValueError(f"attention implementation {attention!r} looks like ring attention: {_RING_REASON}")
    if not told and any(hint in attention for hint in _ULYSSES_ATTENTION):
        raise ValueError(
            f"attention implementation {attention!r} looks sequence parallel (Ulysses): pass the group, "
            "stream_backward(..., sequence_parallel=SequenceParallel.from_deepspeed()), so that StreamBP does "
            "the all-to-alls itself (docs/distributed.md)"
        )
    for name, param in model.named_parameters():
        mesh = getattr(param, "device_mesh", None)  # DTensor parameters (FSDP2, tensor parallel)
        dims = [] if mesh is None else (getattr(mesh, "mesh_dim_names", None) or [])
        words = {dim: set(str(dim).lower().split("_")) for dim in dims}
        ring = [dim for dim in dims if _RING_MESH_DIMS & words[dim]]
        if ring:
            raise ValueError(
                f"parameter {name} lives on a device mesh with context-parallel dimension(s) {ring}: {_RING_REASON}"
            )
        split = [dim for dim in dims if _ULYSSES_MESH_DIMS & words[dim]]
        if split and not told:
            raise ValueError(
                f"parameter {name} lives on a device mesh with sequence-parallel dimension(s) {split}: pass the group, "
                "stream_backward(..., sequence_parallel=SequenceParallel.from_mesh(mesh, 'sp')) (docs/distributed.md)"
            )
        if mesh is not None:
            break  # one DTensor parameter tells the mesh of all


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # torch <= 2.9
    return [] if group is None else [group]


class FSDP2Sync(GradSync):
    """FSDP2 (`fully_shard`, `replicate`, HSDP). The StreamBP unit must be the FSDP unit:
    `fully_shard` each decoder layer, then the whole model. Embedding, final norm and lm_head (tied
    or not) are in the root unit, or in units of their own as Accelerate's FSDP2 shards them
    (`fully_shard(embedding)`, `fully_shard([final norm, lm_head])`): such a head unit is gathered
    for the step like the root (again after the checkpoint pass where it resharded), called
    hook-free, and reduced by the root's end-of-backward callback, once, as the root is."""

    def __init__(self, root: nn.Module, layers: nn.ModuleList, head_modules: list[nn.Module], fsdp_module):
        self.root = root
        self.root_state = root._get_fsdp_state()
        unwrapped = [i for i, layer in enumerate(layers) if not isinstance(layer, fsdp_module)]
        if unwrapped:
            raise ValueError(
                f"decoder layers {unwrapped} are not FSDP units: StreamBP gathers and reduces one decoder layer "
                "at a time, so call fully_shard(layer) on every decoder layer, then fully_shard(model)"
            )
        groups = _param_groups(layers[0]._get_fsdp_state())  # the root may hold no parameter (Accelerate's layout)
        missing = [n for n in ("_lazy_init", "_root_post_backward_final_callback") if not hasattr(self.root_state, n)]
        missing += [] if groups and hasattr(groups[0], "post_backward") else ["FSDPParamGroup.post_backward"]
        if missing:
            raise RuntimeError(f"this torch's FSDP2 lacks {missing}: StreamBP's FSDP2 sync is tested on torch 2.13")
        self.fsdp_module = fsdp_module
        self.head_units: list[nn.Module] = []  # units other than the root holding head modules, one per state
        for module in head_modules:
            owner = _owning_unit(root, module, fsdp_module)
            if owner is root:
                continue
            if owner is None or any(layer is inner for inner in owner.modules() for layer in layers):
                raise ValueError(
                    f"{type(module).__name__} must be in the root FSDP unit (the one fully_shard(model) makes) or in "
                    "a unit without decoder layers (fully_shard(module) after the layers): StreamBP runs embedding, "
                    "final norm and lm_head outside the decoder layers and keeps their parameters gathered all step"
                )
            if all(owner._get_fsdp_state() is not unit._get_fsdp_state() for unit in self.head_units):
                self.head_units.append(owner)

    def sequence_parallel_scale(self, world: int) -> float:
        # FSDP2 averages over its mesh, which holds the sequence ranks (a flattened dp_shard x sp)
        return float(world)

    def begin_step(self) -> None:
        # The root's forward would initialise FSDP lazily; StreamBP never calls it (it would build
        # full logits), so initialise here, before the first layer's hook could claim to be the root.
        self.root_state._lazy_init()
        self.root.unshard()  # embedding, final norm, lm_head: gathered for the whole step
        self.gather_head()

    def call(self, layer: nn.Module):
        return layer.forward  # hook-free: no per-chunk gather, reshard or post-backward hook

    def head(self, module: nn.Module):
        # a head module in a unit of its own: hook-free, as the layers (root submodules have no hooks)
        return module.forward if isinstance(module, self.fsdp_module) else module

    def gather_head(self) -> None:
        for unit in self.head_units:
            unit.unshard()  # no collective where still gathered

    @contextmanager
    def rebuilding(self, layer: nn.Module):
        layer.unshard()
        try:
            yield
        finally:
            layer.reshard()  # gathered again when its own backward begins

    def begin(self, layer: nn.Module) -> None:
        layer.unshard()  # no collective if the checkpoint pass left it unsharded

    def end(self, layer: nn.Module) -> None:
        for group in _param_groups(layer._get_fsdp_state()):
            group.post_backward()  # reshard, then reduce the chunks' summed gradient once

    def end_step(self) -> None:
        # Runs post_backward for the root unit (its gradients: head and embedding) and resets every
        # unit's training state, as at the end of an ordinary backward.
        self.root_state._root_post_backward_final_callback()

    def abort(self) -> None:
        reset = getattr(self.root, "reset_iter_state", None)  # public FSDP2 API in torch 2.13
        if reset is not None:
            reset()


def _owning_unit(root: nn.Module, target: nn.Module, fsdp_module) -> nn.Module | None:
    """The innermost FSDP unit whose subtree holds `target` (`target` itself if it is one)."""
    owner = None

    def visit(module: nn.Module, current):
        nonlocal owner
        current = module if isinstance(module, fsdp_module) else current
        if module is target:
            owner = current
            return True
        return any(visit(child, current) for child in module.children())

    visit(root, None)
    return owner
