"""Data-parallel sharding of a built model with PyTorch FSDP2 (`fully_shard`), as StreamBP needs it
and as torchtitan applies it: one FSDP unit per decoder layer, then the root (embedding, final
norm and lm_head, tied or not, stay in the root unit; core/parallel/grad_sync.py). FULL_SHARD: parameters,
gradients and optimizer moments are split 1/N over the ranks; a layer's parameters are gathered
while it runs. docs/distributed.md, "FSDP2".
"""

from __future__ import annotations

import torch

from ..core.internal import unwrap_model


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (under peft's wrapper too)."""
    return unwrap_model(model).get_decoder().layers


def shard_model(model: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """`fully_shard` every decoder layer, then the whole model, over `mesh` (default: every rank of
    the default process group, on the model's device type). The model is sharded in place."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:  # FSDP2's own default is the accelerator's: on a GPU machine CUDA, whatever the model's device
        mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
