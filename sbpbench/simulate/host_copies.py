"""Checkpoints offloaded to the host in a GPU prediction (methods/offload.py: ckpt-offload, tiled and
ulysses with offload_checkpoints): torch's save_on_cpu copies each saved layer input to page-locked
host memory in the forward, frees the device's, and copies it back for the layer's recompute.

On fake CPU tensors `tensor.cpu()` is the tensor itself, so save_on_cpu would keep every checkpoint
in the counted memory: the GPU peak would hold what a GPU run holds on the host. HostCopies packs
instead a fake copy made outside the count (`LiveTensorTracker.not_counted`), counted here as host
bytes while it lives, and unpacks a counted copy, the device allocation of the copy back.
"""

from __future__ import annotations

import weakref

import torch


class HostCopies:
    """pack/unpack for methods/offload.py `host_copies_by`; live, peak and moved bytes of the host copies."""

    def __init__(self, counter):
        self.counter = counter  # the simulator's LiveTensorTracker
        self.live_bytes = 0
        self.peak_bytes = 0
        self.moved_bytes = 0  # copied out and back

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()  # save_on_cpu's copy is dense
        with self.counter.not_counted():
            packed = torch.empty_like(tensor)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.moved_bytes += nbytes
        weakref.finalize(packed, self._freed, nbytes)
        return packed

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        self.moved_bytes += packed.numel() * packed.element_size()
        return packed.clone()  # the copy back to the device: counted

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes
