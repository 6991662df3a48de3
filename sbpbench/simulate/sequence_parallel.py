"""One rank of N GPUs, P of them sharing each sequence, predicted on this CPU: the step `sbp run
--nproc N --sp P` measures (runner/ranks.py: Ulysses over each P ranks, FSDP2 FULL_SHARD over all N),
on fake tensors.

No second process runs. This process joins torch's fake process group of N ranks as rank 0
(torch/testing/_internal/distributed/fake_pg.py: "You can run a single rank with a fake process
group without needing multiple processes (simulates per-rank behavior)"): its collectives move no
data and keep every shape (all_to_all_single and all-gathers copy the input into the output,
all_reduce and reduce_scatter leave it), so the core's `SequenceParallel` and FSDP2 run unchanged
and every buffer the rank allocates has the shape a GPU rank's has. The step is runner/ranks.py's:
the model sharded over the N ranks (models/sharding.py), one batch per P ranks, each rank
cutting its T_loc = ceil(T / P) positions; FSDP2's gathered parameters and gradient buffers are
counted as they are resized (measure/tensor_tracker.py `counting_fsdp_resizes`). Full fine-tuning
and LoRA are both sharded so (LoRA's frozen weights too), as `--nproc` shards them.

Rank 0 is the one predicted: with the contiguous layout it holds the first T_loc positions, all of
them real tokens (the synthetic rows' padding is at their end), so no rank runs more head chunks.

For long sequences (length.py) the samples are lengths whose T_loc ends in the same layer chunk
and whose padding to a multiple of P is the same, and the recorder learns the chunk of each op
(`SequenceChunks`) without touching the layers: a pre-hook on each layer's input_layernorm (the
layers run their hook-free forward under FSDP2) and the step's phases (core/phases.py).

Besides memory, what the time model needs (`collective_bytes`): the bytes a rank sends per step.
"""

from __future__ import annotations

import math
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from ..config import RunSpec
from ..core import SequenceParallel
from ..core.internal import resolve_parts
from ..methods.streambp import timing_phases
from ..models import load_config
from ..models.sharding import shard_model
from ..workload.build import make_spec_batch, training_step
from ..workload.rank_mesh import SEQUENCE_DIM, rank_meshes

RANK = 0  # the rank predicted (module docstring)
CHECKPOINT_PASS, HEAD, KV_CAPTURE = "checkpoint pass", "head", "K/V capture"  # core/phases.py's names
CHUNK_FORWARD, CHUNK_BACKWARD, REBUILD = "chunk forward", "chunk backward", "rebuild"
FIRST = "first"  # instants.py's name for the chunk at 0
MAIN_PHASES = (CHECKPOINT_PASS, HEAD, KV_CAPTURE, CHUNK_FORWARD, CHUNK_BACKWARD, REBUILD)


def local_len(spec: RunSpec) -> int:
    """T_loc: the positions one rank holds (core/parallel/sequence_shards.py: T padded to a multiple of P)."""
    return math.ceil(spec.seq_len / spec.sp)


@contextmanager
def fake_ranks(world: int):
    """This process as rank 0 of `world` ranks of torch's fake process group, for the block (module
    docstring). Refused inside a real distributed job, whose default group it would replace."""
    import torch.distributed as dist

    if dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
        if type(group).__name__ == "FakeProcessGroup" or dist.get_backend() == "fake":
            if dist.get_world_size() != world:
                raise RuntimeError(f"a fake process group of {dist.get_world_size()} ranks is open, not {world}")
            yield
            return
        raise ValueError(
            "the estimator simulates the ranks in this process with a fake process group; run it outside a "
            "distributed job (this process already has a process group)"
        )
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend

    dist.init_process_group("fake", store=dist.HashStore(), rank=RANK, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_sequence_step(spec: RunSpec, model: torch.nn.Module, mode, *, foreach_optimizer: bool):
    """runner/ranks.py build_sharded_step on a fake model (inside `fake_ranks`): FSDP2 over the flat
    mesh of every rank, the core's SequenceParallel of the "sp" dimension, the same batch on every rank."""
    flat, mesh = rank_meshes(spec.nproc, spec.sp, "cpu")  # outside the fake mode (rank_meshes says why)
    with mode:
        shard_model(model, flat)
    batch = make_spec_batch(spec, model.config)
    group = SequenceParallel.from_mesh(mesh, SEQUENCE_DIM, layout=spec.settings.sp_layout or "contiguous")
    return training_step(
        spec, model, batch, foreach_optimizer=foreach_optimizer, allocation=mode, sequence_parallel=group
    )


@dataclass
class SequenceChunks:
    """Tells a recorder (instants.py) the chunk each op of a sequence-parallel step runs, as
    (kind, position): position "first" for the chunk at 0, else its distance from the end of T_loc.
    Learned from a pre-hook on every layer's input_layernorm (one call per chunk in the K/V captures,
    the checkpoint pass and rebuilds, where the keys/values come first and then the chunks' forward)
    and from the step's phases: each chunk of the backward enters "chunk forward" (queries, last to
    first), then each enters "chunk backward" alone (keys/values, first to last), then once more to
    finish (core/parallel/sequence_layer.py)."""

    bounds: list[tuple[int, int]]  # local chunks of one rank
    set_chunk: object  # set_chunk((kind, position)): the recorder's
    label: object  # () -> the recorder's phase label, which changes with the layer

    def __post_init__(self):
        self._phase: str | None = None  # the main phase open now (MAIN_PHASES), None outside them
        self._told: str | None = None  # what the timer told last
        self._entered: str | None = None  # the main phase entered last
        self._seen: tuple | None = None  # (label, phase group) the counts below are of
        self._norms = self._forwards = self._backwards = 0
        self._last_input = None  # a weak reference to the tensor input_layernorm was called on last

    def _at(self, kind: str, index: int) -> None:
        if index >= len(self.bounds):  # past the chunks (the layer's closing phase): a key of its own
            self.set_chunk((f"{kind} end", FIRST))
            return
        start = self.bounds[index][0]
        self.set_chunk((kind, FIRST if start == 0 else self.bounds[-1][1] - start))

    def _counts(self) -> None:
        """Counts start again when the layer (its label) or the group of phases changes."""
        group = self._phase if self._phase in (CHECKPOINT_PASS, REBUILD, KV_CAPTURE) else "chunks"
        now = (self.label(), group)
        if now != self._seen:
            self._seen, self._norms, self._forwards, self._backwards = now, 0, 0, 0

    def norm_called(self, module, args) -> None:
        """input_layernorm's pre-hook: a chunk of a K/V capture or of a forward pass begins. A call
        on the chunk called on last is the same chunk: the first K/V capture of a layer checks its
        projection against the whole layer on one chunk (core/architecture/key_values.py), which
        runs the norm on it twice more."""
        if self._phase not in (KV_CAPTURE, CHECKPOINT_PASS, REBUILD):
            return
        hidden = args[0] if args else None
        if hidden is not None and self._last_input is not None and self._last_input() is hidden:
            return
        self._last_input = weakref.ref(hidden) if isinstance(hidden, torch.Tensor) else None
        self._counts()
        n = len(self.bounds)
        if self._phase == KV_CAPTURE:
            self._at("capture", self._norms)
        else:  # the keys/values of every chunk first, then the chunks' forward
            self._at(f"{self._phase} {'capture' if self._norms < n else 'forward'}", self._norms % n)
        self._norms += 1

    def phase(self, name: str | None) -> None:
        """PhaseTimer's on_phase: the innermost phase open now (None: none). A main phase told right
        after None is entered; told again after a phase nested in it (host copies), it resumes."""
        entered = name in MAIN_PHASES and self._told is None
        self._told = name
        if name is None or name in MAIN_PHASES:
            self._phase = name
        if not entered:
            return
        previous, self._entered = self._entered, name
        self._counts()
        if name == CHUNK_FORWARD:  # step 2: the queries, last chunk first
            self._at("grad", len(self.bounds) - 1 - self._forwards)
            self._forwards += 1
        elif name == CHUNK_BACKWARD and previous != CHUNK_FORWARD:  # step 3: keys/values, first chunk first
            self._at("kv grad", self._backwards)
            self._backwards += 1

    @contextmanager
    def attached(self, model: torch.nn.Module):
        with ExitStack() as stack:
            for layer in resolve_parts(model).layers:
                stack.callback(layer.input_layernorm.register_forward_pre_hook(self.norm_called).remove)
            stack.enter_context(timing_phases(on_phase=self.phase))
            yield self


def local_bounds(spec: RunSpec) -> list[tuple[int, int]]:
    """One rank's local chunks (the same on every rank; core/layout.py's rule)."""
    length, size = local_len(spec), spec.settings.chunk_size
    return [(start, min(start + size, length)) for start in range(0, length, size)]


@dataclass(frozen=True)
class CollectiveBytes:
    """Bytes one rank sends in one step, by collective (a rank receives as much)."""

    all_to_all: float  # Ulysses: q, attention output and K/V to head space and back, forward and backward
    fsdp: float  # FSDP2: parameter all-gathers and gradient reduce-scatters

    @property
    def total(self) -> float:
        return self.all_to_all + self.fsdp


def collective_bytes(spec: RunSpec, model: torch.nn.Module, *, rebuilt_layers: int = 0) -> CollectiveBytes:
    """What one rank sends per step (core/parallel/sequence_layer.py, grad_sync.py), P ranks sharing
    its sequence and FSDP2 over all N ranks, counted from the shapes: an all-to-all of a (P, ...)
    tensor keeps 1/P and sends (P - 1)/P of it; an all-gather of a unit's parameters receives
    (N - 1)/N of their bytes and sends as much, a reduce-scatter of its gradients sends (N - 1)/N. model: the point's, on the meta device
    (plan.meta_model: its parameters, LoRA's trainable ones). Per layer and local chunk of c positions, B
    rows, H query heads, h = max(h_kv, P) K/V heads (each repeated up to one per rank), hd, in the
    model dtype s (the K/V gradients in fp32):
      K/V to head space   2 x B h c hd s     checkpoint pass, each rebuild, and the backward's capture
      q and attention     2 x B H c hd s     checkpoint pass and rebuilds (q there, output back)
      q and attention     4 x B H c hd s     backward: both, and their gradients
      dK/dV to positions  2 x B h c hd 4     backward
    FSDP2: each layer gathered in the checkpoint pass, in each rebuild and for its backward, its
    gradient reduce-scattered once; the root unit (embedding, final norm, lm_head) gathered once and
    reduce-scattered once. rebuilt_layers: layer forwards a placement adds (timing.rebuilt_layers)."""
    config = load_config(spec.model)
    world, batch, size = spec.sp, spec.batch_size, spec.torch_dtype.itemsize
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = spec.num_layers or config.num_hidden_layers
    positions = len(local_bounds(spec)) and local_len(spec)  # every local position once per pass
    kv = 2 * batch * max(kv_heads, world) * positions * head_dim
    q = 2 * batch * heads * positions * head_dim
    forward = (kv + q) * size  # one layer forward (the checkpoint pass's, a rebuild's)
    backward = (kv + 2 * q) * size + kv * 4
    all_to_all = (world - 1) / world * (forward * (layers + rebuilt_layers) + backward * layers)
    layer_params, root_params, layer_trainable, root_trainable = _parameter_bytes(model)
    gathers = layer_params * (2 * layers + rebuilt_layers) + root_params
    reduces = layer_trainable * layers + root_trainable
    return CollectiveBytes(all_to_all=all_to_all, fsdp=(spec.nproc - 1) / spec.nproc * (gathers + reduces))


def _parameter_bytes(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(one layer's parameter bytes, the root unit's, their trainable parts') of a (meta) model."""
    layers = resolve_parts(model).layers
    inside = {id(p) for layer in layers for p in layer.parameters()}
    layer = list(layers[0].parameters())
    root = [p for p in dict.fromkeys(model.parameters()) if id(p) not in inside]

    def nbytes(params, trainable=False):
        return sum(p.numel() * p.element_size() for p in params if p.requires_grad or not trainable)

    return nbytes(layer), nbytes(root), nbytes(layer, True), nbytes(root, True)
