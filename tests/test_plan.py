"""The planner's time model (simulate/plan.py): what each placement costs, and the order it tries."""

from __future__ import annotations

from sbpbench.config import RunSpec
from sbpbench.core.placement import Placement
from sbpbench.simulate.plan import PCIE_BYTES_S, candidates, predicted_time_s

SPEC = RunSpec(model="tiny/qwen3", method="streambp", seq_len=4096, dtype="bf16")


def test_recompute_costs_one_forward_of_the_rebuilt_layers():
    """recompute:4 on 36 layers rebuilds 27: 27/36 of a forward on top of gpu's 4 forwards."""
    flops = 3e15  # one forward = 1e15
    gpu = predicted_time_s(SPEC, Placement(), num_layers=36, model_flops=flops, layer_bytes=0)
    rec = predicted_time_s(SPEC, Placement(recompute_every=4), num_layers=36, model_flops=flops, layer_bytes=0)
    assert abs(rec / gpu - (4 + 27 / 36) / 4) < 1e-12


def test_offload_costs_only_what_the_compute_does_not_hide():
    """Attention-bound (much compute per byte): cpu costs one copy back; copy-bound: every copy shows."""
    layer_bytes = 2**30
    busy = predicted_time_s(SPEC, Placement(offload=True), num_layers=36, model_flops=3e18, layer_bytes=layer_bytes)
    gpu = predicted_time_s(SPEC, Placement(), num_layers=36, model_flops=3e18, layer_bytes=layer_bytes)
    assert abs(busy - gpu - layer_bytes / PCIE_BYTES_S) < 1e-9
    idle = predicted_time_s(SPEC, Placement(offload=True), num_layers=36, model_flops=0.0, layer_bytes=layer_bytes)
    assert abs(idle - 2 * 36 * layer_bytes / PCIE_BYTES_S) < 1e-9


def test_candidates_come_fastest_first_with_gpu_first():
    """gpu (no extra work) leads; a cpu+recompute candidate never precedes its recompute-only twin."""
    found = candidates(SPEC, num_layers=36, model_flops=3e18, layer_bytes=2**30)
    assert found[0].placement == Placement()
    order = [c.placement for c in found]
    for k in (2, 4):
        assert order.index(Placement(recompute_every=k)) < order.index(Placement(offload=True, recompute_every=k))


def test_spill_costs_its_extra_copies_only_where_the_compute_does_not_hide_them():
    """cpu+recompute:4+spill on 36 layers: the same compute as cpu+recompute:4; copy-bound, 45 copies
    against 18 (per segment: the kept input out and back twice, X_{s+1} out and back)."""
    layer_bytes, copy_s = 2**30, 2**30 / PCIE_BYTES_S
    plain, spill = Placement(offload=True, recompute_every=4), Placement(offload=True, recompute_every=4, spill=True)
    for flops, extra in ((3e18, 0.0), (0.0, (45 - 18) * copy_s)):
        a = predicted_time_s(SPEC, plain, num_layers=36, model_flops=flops, layer_bytes=layer_bytes)
        b = predicted_time_s(SPEC, spill, num_layers=36, model_flops=flops, layer_bytes=layer_bytes)
        assert abs(b - a - extra) < 1e-9
    order = [c.placement for c in candidates(SPEC, num_layers=36, model_flops=3e18, layer_bytes=layer_bytes)]
    assert order.index(plain) < order.index(spill)
    assert Placement(offload=True, recompute_every=3, spill=True) not in order  # nothing to spill
