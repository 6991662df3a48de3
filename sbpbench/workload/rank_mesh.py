"""How `--nproc N --sp P` lays its ranks out, for the measured ranks (runner/ranks.py) and the
estimator's fake ones (simulate/sequence_parallel.py) alike, so a prediction is of the run's layout.

The N ranks form a (N / P, P) mesh ("dp_shard", "sp"), as torchtitan and ALST lay them out: the P
consecutive ranks of an "sp" row share one sequence (DeepSpeed's sequence-parallel groups are
consecutive too). FSDP2 shards over a 1-D mesh "dp_shard_sp" of every rank in the same order
(DeviceMesh's own `_flatten` is private), so it averages each gradient over all N ranks.
"""

from __future__ import annotations

SEQUENCE_DIM = "sp"  # the mesh dimension whose ranks share a sequence


def rank_meshes(nproc: int, sp: int, device_type: str):
    """(the 1-D mesh FSDP2 shards over, the 2-D ("dp_shard", "sp") mesh) of the default group's
    nproc ranks. Made outside any fake-tensor mode: a mesh reads its rank table's values."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (nproc // sp, sp), mesh_dim_names=("dp_shard", SEQUENCE_DIM))
    flat = init_device_mesh(device_type, (nproc,), mesh_dim_names=("dp_shard_sp",))
    return flat, mesh
