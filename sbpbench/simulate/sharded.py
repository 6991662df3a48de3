"""The per-GPU peak of a point on N data-parallel GPUs under FSDP2 FULL_SHARD (`--nproc N`), from
the one-GPU prediction of the same per-rank point (estimate.py) plus FSDP2's own terms.

The sharding changes what is resident and adds gathered copies; it does not change the step's
activations, which depend on the rank's batch only. So, per rank:

    baseline = weights, gradients (steady protocol) and AdamW moments, each parameter's shard
               (dim 0 padded to a multiple of N, as fully_shard pads it), plus the batch
    peak     = baseline + the one-GPU activation peak + what FSDP2 holds gathered at that phase:
      forward, HF head, embedding:  the root unit (embedding, final norm, lm_head: gathered from the
                                    first forward to the end of backward, core/parallel/grad_sync.py) and one
                                    decoder layer's unsharded parameters
      StreamBP head chunks (both     the root unit and its unsharded gradients (lm_head's)
      of DPO's passes):
      backward layer i / embedding: the root unit and its unsharded gradients, one layer's unsharded
                                    parameters and its unsharded gradients (its reduce-scatter comes
                                    after its chunks' activations are freed)
      optimizer:                    nothing gathered (the one-GPU step's full-size AdamW temporaries
                                    are kept: an over-estimate when the peak is there)

FSDP2's backward prefetch of the next layer and the reduce-scatter buffers (one layer's gradients,
flat, plus their 1/N output) are not added: on 2 gloo ranks with the tensor tracker
(tests/subprocess/test_nproc.py) the peak came before both. That test's agreement: bp exact, streambp
and ckpt over-estimated by about 1% and 3% (tiny/qwen3, fp32, T=256, --target cpu). Only the
steady protocol is modelled (under `first` one-GPU activations would include full-size gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..config import RunSpec
from ..core.internal import unwrap_model
from ..methods import MethodUnsupported, data_parallel_unsupported
from ..settings import ConfigError


def check_sharded_spec(spec: RunSpec) -> None:
    """Refuse what this model does not cover: a method without a sharded path (MethodUnsupported:
    a row with status unsupported), the `first` protocol (ConfigError)."""
    if spec.nproc == 1:
        return
    reason = data_parallel_unsupported(spec.method, spec.nproc)
    if reason is not None:
        raise MethodUnsupported(reason)
    if spec.protocol != "steady":
        raise ConfigError(
            "protocol",
            f"{spec.protocol} is not modelled with nproc {spec.nproc}: the sharded estimate assumes resident "
            "gradients (--protocol steady)",
        )


def shard_bytes(t: torch.Tensor, nproc: int, granularity: int = 1) -> int:
    """Bytes of one rank's FSDP2 shard of t (dim 0 split in N chunks of ceil(dim0 / N) rows),
    rounded up to the allocator's granularity. A 0-dim tensor (AdamW's step) is not sharded."""
    if t.dim() == 0:
        nbytes = t.element_size()
    else:
        nbytes = math.ceil(t.shape[0] / nproc) * math.prod(t.shape[1:]) * t.element_size()
    return -(-nbytes // granularity) * granularity


def _full_bytes(params, granularity: int) -> int:
    return sum(-(-p.numel() * p.element_size() // granularity) * granularity for p in params)


@dataclass(frozen=True)
class ShardedTerms:
    baseline_bytes: int  # sharded weights + gradients + moments, plus the batch
    weights_bytes: int  # this rank's shards (unrounded, as the row's column)
    grads_bytes: int
    optimizer_state_bytes: int | None
    root_bytes: int  # the root unit's parameters, gathered (embedding, final norm, lm_head)
    root_grad_bytes: int  # its trainable parameters' unsharded gradients
    layer_bytes: int  # the largest decoder layer's parameters, gathered
    layer_grad_bytes: int  # its trainable parameters' unsharded gradients

    def gathered_bytes(self, phase: str) -> int:
        """What FSDP2 holds gathered beyond the shards at a phase of the step (module docstring)."""
        if phase.startswith("backward"):
            return self.root_bytes + self.root_grad_bytes + self.layer_bytes + self.layer_grad_bytes
        if phase.startswith(("head chunk", "head sums chunk")):
            return self.root_bytes + self.root_grad_bytes
        if phase == "optimizer":
            return 0
        return self.root_bytes + self.layer_bytes


def sharded_terms(step, nproc: int, granularity: int = 1) -> ShardedTerms:
    """The FSDP2 terms of a (fake or real, unsharded) training step's model on nproc ranks."""
    model = step.model
    params = list(dict.fromkeys(model.parameters()))
    layers = unwrap_model(model).get_decoder().layers
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = [p for p in params if id(p) not in in_layers]
    weights = sum(shard_bytes(p, nproc, granularity) for p in params)
    grads = sum(shard_bytes(p, nproc, granularity) for p in step.trainable) if step.protocol == "steady" else 0
    moments = None
    if step.optimizer is not None:
        moments = sum(shard_bytes(t, nproc, granularity) for s in step.optimizer.state.values() for t in s.values())
    batch = [t for t in vars(step.batch).values() if isinstance(t, torch.Tensor)]
    batch_bytes = sum(-(-t.untyped_storage().nbytes() // granularity) * granularity for t in batch)
    per_layer = [list(layer.parameters()) for layer in layers]
    largest = max(per_layer, key=lambda ps: _full_bytes(ps, granularity))
    return ShardedTerms(
        baseline_bytes=weights + grads + (moments or 0) + batch_bytes,
        weights_bytes=sum(shard_bytes(p, nproc) for p in params),
        grads_bytes=sum(shard_bytes(p, nproc) for p in step.trainable),
        optimizer_state_bytes=None
        if moments is None
        else sum(shard_bytes(t, nproc) for s in step.optimizer.state.values() for t in s.values()),
        root_bytes=_full_bytes(root, granularity),
        root_grad_bytes=_full_bytes([p for p in root if p.requires_grad], granularity),
        layer_bytes=_full_bytes(largest, granularity),
        layer_grad_bytes=_full_bytes([p for p in largest if p.requires_grad], granularity),
    )


def per_rank(one_gpu, terms: ShardedTerms):
    """The one-GPU Estimate of a rank's point turned into that rank's under FSDP2 (module docstring)."""
    return replace(
        one_gpu,
        weights_bytes=terms.weights_bytes,
        grads_bytes=terms.grads_bytes,
        optimizer_state_bytes=terms.optimizer_state_bytes,
        baseline_bytes=terms.baseline_bytes,
        activation_peak_bytes=one_gpu.activation_peak_bytes + terms.gathered_bytes(one_gpu.peak_phase),
    )
