"""ALST's single-GPU recipe (Arctic Long Sequence Training, arXiv 2506.13996, Sec. 3): gradient
checkpointing with the checkpoints offloaded to host memory, a tiled logits + loss head
(chunked_ce.py) and a tiled MLP, all together.

TiledMLP follows DeepSpeed's `deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`: the decoder
MLP runs on sequence tiles of mlp_tile_size positions without a graph in the forward, and each tile
is recomputed with a graph in the backward, so the (B, tile, intermediate) activations exist for
one tile at a time. DeepSpeed's example picks ceil(T / hidden_size) shards (tiles of about
hidden_size positions, 2560 for Qwen3-4B); here the tile is a setting. Parameter gradients are
summed over tiles in float32 or wider and rounded once (DeepSpeed sums them in a configurable
accumulation dtype through hooks); here they are returned to autograd, which adds them to .grad.
With checkpointing on, the MLP forward runs three times per step (ALST says so too).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

from ..core.internal import loss_dtype, resolve_parts, trainable
from ..data import Batch
from .chunked_ce import chunked_head_loss
from .hf_baseline import hf_gradient_checkpointing
from .offload import offloaded_checkpointing
from .unsupported import MethodUnsupported


def _tiles(seq_len: int, tile_size: int):
    for start in range(0, seq_len, tile_size):
        yield start, min(start + tile_size, seq_len)


class TiledMLP(torch.autograd.Function):
    """forward(mlp, x (B, T, d), tile_size, *params) -> mlp(x) (B, T, d), computed tile by tile.
    `params` are the MLP's trainable parameters (LoRA adapters included), inputs so that autograd
    routes their gradients."""

    @staticmethod
    def forward(ctx, mlp, x, tile_size, *params):
        ctx.mlp, ctx.tile_size = mlp, tile_size
        ctx.save_for_backward(x)
        forward = type(mlp).forward  # the class's own forward, not the tiled one installed on the instance
        with torch.no_grad():
            return torch.cat([forward(mlp, x[:, start:end]) for start, end in _tiles(x.shape[1], tile_size)], dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        mlp, forward = ctx.mlp, type(ctx.mlp).forward
        weights = trainable(mlp)  # the forward's *params, in the same order
        sums = [torch.zeros_like(p, dtype=loss_dtype(p.dtype)) for p in weights]
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[1] else None
        for start, end in _tiles(x.shape[1], ctx.tile_size):
            tile = x[:, start:end].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                out = forward(mlp, tile)  # (B, tile, d); the (B, tile, intermediate) activations live here only
            inputs = ([tile] if grad_x is not None else []) + weights
            grads = torch.autograd.grad(out, inputs, grad_outputs=grad_out[:, start:end], allow_unused=True)
            if grad_x is not None:
                grad_x[:, start:end] = grads[0]
                grads = grads[1:]
            for acc, grad in zip(sums, grads):
                if grad is not None:
                    acc += grad
        ctx.mlp = None
        return (None, grad_x, None, *(s.to(p.dtype) for s, p in zip(sums, weights)))


@contextmanager
def tiled_mlps(model, tile_size: int):
    """Every decoder layer's MLP computed by TiledMLP for the duration of the block: an instance
    attribute `forward` over the class's, removed on exit (weights and state_dict untouched)."""
    mlps = [getattr(layer, "mlp", None) for layer in resolve_parts(model).layers]
    for index, mlp in enumerate(mlps):
        if mlp is None or any(name.endswith("experts") for name, _ in mlp.named_modules()):
            raise MethodUnsupported(
                f"TiledMLP tiles a dense MLP that returns one tensor; layer {index}'s feed-forward is "
                f"{'missing (no .mlp)' if mlp is None else 'a mixture of experts'}"
            )
    for mlp in mlps:
        assert "forward" not in vars(mlp), f"{type(mlp).__name__} already has an instance forward"
        mlp.forward = _tiled_forward(mlp, tile_size)
    try:
        yield
    finally:
        for mlp in mlps:
            del mlp.forward


def _tiled_forward(mlp, tile_size: int):
    def forward(x):
        return TiledMLP.apply(mlp, x, tile_size, *trainable(mlp))

    return forward


def tiled(model, batch: Batch, settings) -> torch.Tensor:
    with ExitStack() as stack:
        if settings.offload_checkpoints:
            stack.enter_context(offloaded_checkpointing(model))
        else:
            stack.enter_context(hf_gradient_checkpointing(model))
        stack.enter_context(tiled_mlps(model, settings.mlp_tile_size))
        loss = chunked_head_loss(model, batch, settings.logits_chunk_size)
        loss.backward()
    return loss.detach()
