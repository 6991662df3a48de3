"""A point on several data-parallel ranks (`sbp run --nproc N`): each rank is one worker process
(runner/worker.py) that joins a process group, builds the same seeded model, shards it with FSDP2
(models/sharding.py: FULL_SHARD, one unit per decoder layer plus the root) and measures the step on
its own batch (seed + rank) as one-process points are measured (runner/point.py); the parent
(runner/isolated.py) merges the ranks' rows into one (`merge_rank_rows`).

With --sp P the N ranks form a (N / P, P) mesh (workload/rank_mesh.py): the P ranks of an "sp"
row share one sequence, each holding the same batch (seed + data rank, rank // P), and the step
gets them as a core SequenceParallel (`SequenceParallel.from_mesh(mesh, "sp")`). FSDP2 shards over
all N ranks, so it averages each gradient over them and the step scales each rank's part by P
(core/parallel/sequence_step.py).

Ranks are found as torchrun sets them (RANK, LOCAL_RANK, WORLD_SIZE), the rendezvous is
SBP_INIT_METHOD (the parent passes a file:// store in the point's directory: no port to race for)
or torchrun's env://. gloo on the CPU; nccl on CUDA with rank r on cuda:<index + local rank>.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from ..config import RunSpec
from ..methods.step import TrainingStep
from ..records import ResultRow
from ..workload.build import build_model_and_batch, training_step
from ..workload.rank_mesh import SEQUENCE_DIM, rank_meshes

INIT_METHOD_ENV = "SBP_INIT_METHOD"


@dataclass(frozen=True)
class Rank:
    rank: int
    local_rank: int
    world_size: int


def rank_from_env() -> Rank:
    """This process's rank, as torchrun (or runner/isolated.py) sets it."""
    return Rank(
        int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"])), int(os.environ["WORLD_SIZE"])
    )


def rank_device(spec: RunSpec, rank: Rank) -> torch.device:
    """This rank's device: cuda:<the spec's index + local rank> on CUDA, else the CPU."""
    if spec.device.startswith("cuda"):
        return torch.device("cuda", int(spec.device.split(":")[1]) + rank.local_rank)
    return torch.device("cpu")


def join(spec: RunSpec, rank: Rank) -> torch.device:
    """Join the process group of spec.nproc ranks; this rank's device (`rank_device`), made current."""
    import torch.distributed as dist

    if rank.world_size != spec.nproc:
        raise RuntimeError(f"WORLD_SIZE {rank.world_size} differs from the spec's nproc {spec.nproc}")
    device = rank_device(spec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    init = os.environ.get(INIT_METHOD_ENV, "env://")
    # device_id binds nccl's communicator to this rank's GPU at once (no guess from the current device)
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init, rank=rank.rank, world_size=rank.world_size, **bound)
    return device


def leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def build_sharded_step(
    spec: RunSpec, device: torch.device, rank: Rank, *, same_batch: bool = False, **build
) -> tuple[TrainingStep, torch.nn.Module]:
    """The same seeded model on every rank, sharded with FSDP2 before the step allocates its
    gradients and moments (so they are sharded too); this data rank's own batch (seed + data rank;
    same_batch: spec.seed's on every rank, as `sbp check` compares one batch). build: what
    build_model_and_batch takes besides (a check's LoRA options)."""
    from ..models.sharding import shard_model

    data_rank = 0 if same_batch else rank.rank // spec.sp
    model, batch = build_model_and_batch(spec, device=str(device), batch_seed=spec.seed + data_rank, **build)
    flat, sequence_parallel = sequence_mesh(spec, device)
    shard_model(model, flat)
    return training_step(spec, model, batch, sequence_parallel=sequence_parallel), model


def sequence_mesh(spec: RunSpec, device: torch.device):
    """(the mesh FSDP2 shards over, the SequenceParallel of this rank's "sp" row): (None, None)
    without --sp, FSDP2 then sharding over the default group (workload/rank_mesh.py: the layout)."""
    if spec.sp == 1:
        return None, None
    from ..core import SequenceParallel

    flat, mesh = rank_meshes(spec.nproc, spec.sp, device.type)
    return flat, SequenceParallel.from_mesh(mesh, SEQUENCE_DIM, layout=spec.settings.sp_layout or "contiguous")


# Memory columns a several-rank row takes as the max over ranks (the per-GPU figure a user sizes a
# GPU by); time columns likewise (the slowest rank sets the step's pace). The rest: rank 0's.
_MAX_COLUMNS = tuple(f.name for f in fields(ResultRow) if f.name.endswith("_bytes") and f.name != "rank_peak_bytes") + (
    "time_median_s",
    "time_min_s",
    "time_max_s",
    "host_register_s",  # each rank page-locks its own buffers in its first step
)
# the row's status is its worst rank's; an OOM first, as the other ranks then fail in a collective
_STATUS_ORDER = ("oom", "error", "timeout", "unsupported", "ok")


def merge_rank_rows(rows: list[ResultRow]) -> ResultRow:
    """One row for a point measured on len(rows) ranks (rank order): memory and time columns the
    max over ranks, rank_peak_bytes each rank's peak, status and error of the worst rank."""
    merged = ResultRow(**rows[0].as_dict())
    for column in _MAX_COLUMNS:
        values = [getattr(r, column) for r in rows if getattr(r, column) is not None]
        setattr(merged, column, max(values) if values else None)
    merged.rank_peak_bytes = ";".join(
        "" if r.peak_allocated_bytes is None else str(r.peak_allocated_bytes) for r in rows
    )
    worst = min(
        range(len(rows)), key=lambda i: _STATUS_ORDER.index(rows[i].status) if rows[i].status in _STATUS_ORDER else 0
    )
    merged.status = rows[worst].status
    merged.error = f"rank {worst}: {rows[worst].error}" if rows[worst].error else ""
    if merged.time_median_s:
        merged.tokens_per_s = merged.batch_size * merged.seq_len / merged.time_median_s
        merged.tflops_per_s = merged.model_flops / merged.time_median_s / 1e12 if merged.model_flops else None
    return merged
