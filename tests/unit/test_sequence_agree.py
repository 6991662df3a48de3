"""SequenceParallel.agree sends its values on the step's device: nccl takes CUDA tensors only, so a
CPU tensor would fail every CUDA step before its first chunk. Checked on a stand-in device (meta)
in a one-rank gloo group, with all_gather recording what it is handed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sbpbench.core import SequenceParallel


class _Handed(Exception):
    pass


def test_the_values_go_to_the_collective_on_the_steps_device(monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = SequenceParallel()
        handed = []

        def all_gather(outputs, tensor, group=None):
            handed.append(
                (tensor.device, [t.device for t in outputs], tensor.tolist() if tensor.device.type == "cpu" else None)
            )
            if tensor.device.type != "cpu":
                raise _Handed  # a meta tensor holds no values to compare
            for out in outputs:
                out.copy_(tensor)

        monkeypatch.setattr(dist, "all_gather", all_gather)
        with pytest.raises(_Handed):
            group.agree(device="meta", batch=2, seq_len=100)
        group.agree(device="cpu", batch=2, seq_len=100)  # one rank agrees with itself
        meta, cpu = torch.device("meta"), torch.device("cpu")
        assert handed == [(meta, [meta], None), (cpu, [cpu], [2, 100])]
    finally:
        dist.destroy_process_group()
