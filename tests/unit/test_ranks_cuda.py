"""The CUDA branch of a rank's set-up (runner/ranks.py), on a CPU stand-in: rank r of a point on
cuda:i joins with nccl on cuda:<i + local rank>, and its meshes are CUDA meshes."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

import sbpbench.runner.ranks as ranks


def test_a_cuda_rank_joins_nccl_on_its_own_gpu(monkeypatch):
    devices, joined = [], []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: joined.append((backend, kwargs)))
    monkeypatch.setenv(ranks.INIT_METHOD_ENV, "file:///tmp/store")
    spec = SimpleNamespace(device="cuda:2", nproc=4)
    device = ranks.join(spec, ranks.Rank(rank=3, local_rank=1, world_size=4))
    assert device == torch.device("cuda", 3) and devices == [device]
    assert joined == [("nccl", {"init_method": "file:///tmp/store", "rank": 3, "world_size": 4})]
    on_cpu = ranks.join(SimpleNamespace(device="cpu", nproc=4), ranks.Rank(rank=3, local_rank=1, world_size=4))
    assert on_cpu == torch.device("cpu") and joined[-1][0] == "gloo" and len(devices) == 1


def test_a_cuda_rank_shares_its_sequence_over_a_cuda_mesh(monkeypatch):
    made = []

    def meshes(nproc, sp, device_type):
        made.append((nproc, sp, device_type))
        return "flat", "mesh"

    monkeypatch.setattr(ranks, "rank_meshes", meshes)
    monkeypatch.setattr("sbpbench.core.SequenceParallel.from_mesh", classmethod(lambda cls, mesh, dim: (mesh, dim)))
    flat, group = ranks.sequence_mesh(SimpleNamespace(nproc=8, sp=4), torch.device("cuda", 5))
    assert made == [(8, 4, "cuda")] and (flat, group) == ("flat", ("mesh", "sp"))
    assert ranks.sequence_mesh(SimpleNamespace(nproc=8, sp=1), torch.device("cuda", 5)) == (None, None)
