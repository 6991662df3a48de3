"""A rank's set-up (runner/ranks.py) on CPU stand-ins: rank r of a point on cuda:i joins with nccl
on cuda:<i + local rank>, its meshes are CUDA meshes, and its ranks sharing a sequence lay it out
as --set sp_layout says (one list of layouts, the core's)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

import sbpbench.runner.ranks as ranks


def test_a_cuda_rank_joins_nccl_on_its_own_gpu(monkeypatch):
    """Rank 3 (local rank 1) of a point on cuda:2 sets cuda:3 and joins nccl bound to it (device_id);
    on the CPU it joins gloo with no device."""
    devices, joined = [], []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: joined.append((backend, kwargs)))
    monkeypatch.setenv(ranks.INIT_METHOD_ENV, "file:///tmp/store")
    spec = SimpleNamespace(device="cuda:2", nproc=4)
    device = ranks.join(spec, ranks.Rank(rank=3, local_rank=1, world_size=4))
    assert device == torch.device("cuda", 3) and devices == [device]
    assert joined == [("nccl", {"init_method": "file:///tmp/store", "rank": 3, "world_size": 4, "device_id": device})]
    on_cpu = ranks.join(SimpleNamespace(device="cpu", nproc=4), ranks.Rank(rank=3, local_rank=1, world_size=4))
    assert on_cpu == torch.device("cpu") and joined[-1][0] == "gloo" and len(devices) == 1
    assert "device_id" not in joined[-1][1]


def test_a_cuda_rank_shares_its_sequence_over_a_cuda_mesh(monkeypatch):
    made = []

    def meshes(nproc, sp, device_type):
        made.append((nproc, sp, device_type))
        return "flat", "mesh"

    monkeypatch.setattr(ranks, "rank_meshes", meshes)
    from_mesh = classmethod(lambda cls, mesh, dim, layout: (mesh, dim, layout))
    monkeypatch.setattr("sbpbench.core.SequenceParallel.from_mesh", from_mesh)
    laid = SimpleNamespace(sp_layout="interleaved")
    flat, group = ranks.sequence_mesh(SimpleNamespace(nproc=8, sp=4, settings=laid), torch.device("cuda", 5))
    assert made == [(8, 4, "cuda")] and (flat, group) == ("flat", ("mesh", "sp", "interleaved"))
    assert ranks.sequence_mesh(SimpleNamespace(nproc=8, sp=1), torch.device("cuda", 5)) == (None, None)


def test_the_layouts_a_user_gives_are_the_cores():
    from sbpbench.core.parallel.sequence_group import LAYOUTS
    from sbpbench.settings.choices import SP_LAYOUTS

    assert SP_LAYOUTS == LAYOUTS
