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
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
