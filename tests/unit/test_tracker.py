"""The live-tensor tracker counts what is allocated and alive, once per storage."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

from sbpbench.measure.tensor_tracker import LiveTensorTracker, _tensors


def test_counts_new_storages_and_their_release():
    """New storages count, views do not, freed storages are uncounted, the peak stays."""
    with LiveTensorTracker() as tracker:
        a = torch.empty(1000)  # 4000 B
        view = a.view(10, 100)
        b = a * 2  # 4000 B
        assert tracker.live_bytes == 8000
        del b
        assert tracker.live_bytes == 4000
        del a, view
        assert tracker.live_bytes == 0
    assert tracker.peak_bytes == 8000
    assert tracker.largest.numel == 1000


def test_preexisting_tensors_and_inplace_ops_are_not_counted():
    """Weights made before tracking, and in-place updates of them, add nothing."""
    weight = torch.ones(256)
    with LiveTensorTracker() as tracker:
        weight.add_(1.0)
        weight.mul_(2.0)
    assert tracker.peak_bytes == 0


def test_backward_allocations_are_seen():
    """Autograd's backward runs through the tracker: a fresh .grad is counted."""
    x = torch.randn(1000, requires_grad=True)
    with LiveTensorTracker() as tracker:
        (x * x).sum().backward()
        assert tracker.live_bytes >= 4000  # x.grad stays alive


def test_granularity_rounds_each_storage_up():
    """With 512-byte granularity a 4-byte tensor counts as 512 bytes, like the CUDA allocator."""
    with LiveTensorTracker(granularity_bytes=512) as tracker:
        keep = torch.zeros(1)
        assert tracker.live_bytes == 512
    del keep
    with pytest.raises(ValueError):
        LiveTensorTracker(granularity_bytes=0)


def test_tensors_of_op_values_are_the_tree_leaves():
    """_tensors (the tracker's per-op fast path) finds the tensors tree_leaves does, in order, nested too."""
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    for values in [(a, 2, [b, None, c]), ((a, b), {"x": c}), ([a, [b, (c,)]],), (), (1.0, "s", None)]:
        expected = [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]
        assert [id(t) for t in _tensors(values)] == [id(t) for t in expected], values


def test_a_collective_holds_no_counted_storage():
    """A process group keeps a collective's tensors while its Work lives (gloo's worker thread drops
    them when it gets round to it). The tracker runs collectives on uncounted copies: a tensor the
    program lets go of is uncounted at once, and the results still arrive in the caller's tensors."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with LiveTensorTracker() as tracker:
            sent, received, gathered = torch.arange(1000.0), torch.zeros(1000), [torch.zeros(1000)]
            work = dist.all_to_all_single(received, sent, async_op=True)
            work.wait()
            dist.all_gather(gathered, received)
            assert tracker.live_bytes == 3 * 4000
            del sent  # the Work is still alive: it must not hold this storage
            assert tracker.live_bytes == 2 * 4000
        assert torch.equal(received, torch.arange(1000.0)) and torch.equal(gathered[0], received)
    finally:
        dist.destroy_process_group()
