"""The sequence-parallel group a StreamBP step runs in (Ulysses, arXiv 2309.14509; ALST, arXiv
2506.13996): which ranks share one sequence, how a tensor moves between the sequence split and
the head split, and the agreement that keeps the ranks in lockstep.

In Ulysses each of P ranks holds T/P positions of every layer's input. Attention needs every
position, so the queries, keys and values of a rank's positions go to the ranks by head: rank p
gets heads [p H/P, (p + 1) H/P) of all T positions (`to_heads`), attends, and sends each rank's
positions back (`to_positions`). Both are one `all_to_all_single` (gloo has no `all_to_all`), and
each is the other's inverse, so each one's backward is the other.

`SequenceParallel` is built from a process group, a torch `DeviceMesh` dimension
(`from_mesh`) or DeepSpeed's sequence-parallel group (`from_deepspeed`). `layout` says which
positions a rank holds (sequence_shards.py): "contiguous" (T/P consecutive positions, as
DeepSpeed's `UlyssesSPDataLoaderAdapter` shards) or "interleaved" (FPDT's: chunk j of every rank
side by side, so one chunk step is one contiguous range and one attention call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "interleaved")


@dataclass(frozen=True, eq=False)
class SequenceParallel:
    """P ranks sharing one sequence. group: a torch.distributed process group (None: the world);
    layout: "contiguous" or "interleaved" (module docstring)."""

    group: object = None
    layout: str = "contiguous"

    def __post_init__(self):
        if self.group is not None and not (dist.is_available() and isinstance(self.group, dist.ProcessGroup)):
            raise TypeError(
                f"SequenceParallel's group must be a torch.distributed ProcessGroup or None (the world), "
                f"got {type(self.group).__name__}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"sequence_parallel layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "sequence parallelism needs torch.distributed initialised (torch.distributed.init_process_group, "
                "or torchrun) before SequenceParallel(...) is made"
            )

    @classmethod
    def from_mesh(cls, mesh, dim: str, layout: str = "contiguous") -> SequenceParallel:
        """The group of one dimension of a torch DeviceMesh, e.g. the "sp" of a ("dp_shard", "sp") mesh."""
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if dim not in names:
            raise ValueError(
                f"the device mesh has no dimension {dim!r}; its dimensions: {', '.join(names) or 'unnamed'}"
            )
        return cls(group=mesh.get_group(dim), layout=layout)

    @classmethod
    def from_deepspeed(cls, layout: str = "contiguous") -> SequenceParallel:
        """DeepSpeed's sequence-parallel group, as `deepspeed.runtime.sequence_parallel.parallel_state_sp`
        (ALST's `UlyssesSPAttentionHF.register_with_transformers`) or `deepspeed.utils.groups` made it."""
        group = None
        try:  # ALST's groups (register_with_transformers, or initialize_sequence_parallel itself)
            from deepspeed.runtime.sequence_parallel import parallel_state_sp

            group = getattr(parallel_state_sp, "_SEQUENCE_PARALLEL_GROUP", None)
        except ImportError:
            pass
        if group is None:
            try:  # the engine's: an mpu given to deepspeed.initialize, or its device mesh
                from deepspeed.utils import groups

                group = groups._get_sequence_parallel_group()
            except (ImportError, AttributeError, AssertionError, KeyError):
                group = None
        if group is None:
            raise ValueError(
                "no DeepSpeed sequence-parallel group: initialise it first (UlyssesSPAttentionHF.register_with_transformers, "
                "or deepspeed.initialize with sequence_parallel_size), or pass SequenceParallel(group=...)"
            )
        return cls(group=group, layout=layout)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def to_heads(self, local: torch.Tensor) -> torch.Tensor:
        """(B, H, c, hd), this rank's c positions of every head -> (B, H/P, P c, hd): this rank's
        heads of every rank's c positions, rank 0's first. Differentiable (its backward is `to_positions`)."""
        batch, heads, length, dim = local.shape
        world = self.world
        send = local.view(batch, world, heads // world, length, dim).transpose(
            0, 1
        )  # (P, B, H/P, c, hd): group p to rank p
        received = _AllToAll.apply(send, self.group)  # (P, B, H/P, c, hd): received[r] from rank r
        return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world, world * length, dim)

    def to_positions(self, heads: torch.Tensor) -> torch.Tensor:
        """(B, H/P, P c, hd) -> (B, H, c, hd): the inverse of `to_heads`. Differentiable."""
        batch, num_heads, length, dim = heads.shape
        world = self.world
        send = heads.view(batch, num_heads, world, length // world, dim).permute(2, 0, 1, 3, 4)  # block r to rank r
        received = _AllToAll.apply(send, self.group)  # (P, B, H/P, c, hd): received[p] = heads of group p
        return received.transpose(0, 1).reshape(batch, world * num_heads, length // world, dim)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the group, in place (and returned)."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def agree(self, *, device: torch.device | str, **values: int) -> None:
        """Raise ValueError on every rank unless all ranks give the same values (the sequence
        length, the chunk size, the batch): a rank that ran a different number of chunks would wait
        forever on a collective the others never make. device: the step's, where the group's
        backend takes tensors (nccl: CUDA tensors only; gloo: CPU ones)."""
        mine = torch.tensor([int(v) for v in values.values()], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        differ = [name for i, name in enumerate(values) if len({int(t[i]) for t in every}) > 1]
        if differ:
            seen = {name: [int(t[i]) for t in every] for i, name in enumerate(values) if name in differ}
            raise ValueError(
                f"the ranks of a sequence-parallel group disagree on {', '.join(differ)} (by rank: {seen}); "
                "give every rank the same batch and StreamConfig"
            )


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (size P, equal splits): index p goes to rank p, index r of the
    result came from rank r. It is its own inverse, so its backward is itself."""

    @staticmethod
    def forward(ctx, send: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(send, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    send = send.contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received
