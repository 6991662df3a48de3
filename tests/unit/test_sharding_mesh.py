"""shard_model's default mesh (models/sharding.py) is on the model's device type. FSDP2's own default
is the accelerator's: on a GPU machine a CUDA mesh, to which fully_shard moves a CPU model's
parameters, so `--device cpu --nproc N` ranks (gloo) would step on GPUs, or fail. Checked in a
one-rank gloo group with torch told its accelerator is CUDA, as a CUDA build on a GPU machine says."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sbpbench.models import build_model
from sbpbench.models.sharding import shard_model


def test_a_cpu_model_is_sharded_over_a_cpu_mesh_where_the_accelerator_is_cuda(monkeypatch):
    """Every parameter stays on the CPU, on a CPU mesh."""
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    model = build_model("tiny/qwen3", dtype=torch.float32, device="cpu", seed=0, num_hidden_layers=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        shard_model(model)
        placed = {(p.device.type, p.device_mesh.device_type) for p in model.parameters()}
    finally:
        dist.destroy_process_group()
    assert placed == {("cpu", "cpu")}
