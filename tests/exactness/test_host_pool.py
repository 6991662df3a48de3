"""Page-locked host buffers (core/host_pool.py): registered once in the first offloading step and
reused by every later one, bounded when T changes, one page or more each never shared, released on
request; a failed registration or host allocation is a host out-of-memory, and a measured point
records its first step's registration time apart from the steady steps. Run through the recording
stand-in for the CUDA calls (tests/cuda_standin.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sbpbench.core import cuda_calls, host_pool, release_pinned_memory
from sbpbench.core.cuda_calls import CudaCalls
from sbpbench.core.host_pool import PAGE_BYTES, HostMemoryError, whole_pages
from sbpbench.core.placements.placement import CheckpointStore, Placement
from sbpbench.data import make_batch
from sbpbench.runner.point import is_out_of_memory

from ..conftest import observing_stores
from ..cuda_standin import RecordingCalls, route_stores
from .test_placement import NUM_LAYERS, _deep_model, _step


def _steps(monkeypatch, calls: RecordingCalls, seq_lens, checkpoints: str = "cpu"):
    """One StreamBP step per T, all with stores on `calls`; each step's store."""
    route_stores(monkeypatch, calls)
    model = _deep_model("tiny/qwen3")
    stores = []
    for seq_len in seq_lens:
        batch = make_batch("sft", batch_size=1, seq_len=seq_len, vocab_size=model.config.vocab_size)
        with observing_stores() as observed:
            _step(model, batch, checkpoints)
        stores += observed
    return stores


def test_steps_after_the_first_register_nothing(monkeypatch):
    """Three steps of one T: the first registers one buffer per layer input and records the time
    it took; the next two reuse the same buffers (no registration, 0 s)."""
    calls = RecordingCalls()
    first, second, third = _steps(monkeypatch, calls, [20, 20, 20])
    assert len(calls.registrations) == NUM_LAYERS
    assert first.pins_host_memory and first.host_register_s > 0
    assert second.host_register_s == third.host_register_s == 0.0
    assert calls.pool.in_use == 0 and len(calls.registered) == NUM_LAYERS


def test_the_pool_stays_bounded_when_t_changes(monkeypatch):
    """Layer inputs of 3, 8, 5 and 2 pages (T = 24, 64, 40, 16 with 4 KiB pages): a larger T
    registers anew and the old buffers go; a T within 2x below the buffers' reuses them; a T far
    below registers small ones and frees the large. After every step the pool holds that step's
    buffers only, under twice its host peak plus a page each."""
    calls = RecordingCalls()
    per_page = PAGE_BYTES // (64 * 8)  # positions per page: hidden 64, fp64
    registered = []
    for pages, new in ((3, NUM_LAYERS), (8, NUM_LAYERS), (5, 0), (2, NUM_LAYERS)):
        before = len(calls.registrations)
        (store,) = _steps(monkeypatch, calls, [pages * per_page])
        assert len(calls.registrations) - before == new, pages
        assert len(calls.registered) == NUM_LAYERS
        assert calls.pool.registered_bytes < 2 * store.max_host_bytes + NUM_LAYERS * PAGE_BYTES
        registered.append(calls.pool.registered_bytes // (NUM_LAYERS * PAGE_BYTES))
    assert registered == [3, 8, 8, 2]  # pages per buffer after each step
    calls.assert_clean()


def test_buffers_smaller_than_a_page_never_share_one():
    """Tiny layer inputs (48 bytes) each get a page-aligned registration of whole pages of their
    own, and come back with their values."""
    calls = RecordingCalls()
    store = CheckpointStore(Placement(offload=True), 3, calls=calls)
    inputs = [torch.arange(12, dtype=torch.float32).reshape(1, 3, 4) + i for i in range(3)]
    for index, layer_input in enumerate(inputs):
        store.put(index, layer_input)
    for index in reversed(range(3)):
        assert torch.equal(store.get(index, torch.device("cpu")).tensor, inputs[index])
        store.release(index)
    store.close()
    assert [nbytes for _, nbytes in calls.registrations] == [PAGE_BYTES] * 3
    assert all(address % PAGE_BYTES == 0 for address, _ in calls.registrations)
    assert len({address // PAGE_BYTES for address, _ in calls.registrations}) == 3
    calls.assert_clean()  # no overlap either


def test_a_failed_registration_is_a_host_out_of_memory(monkeypatch):
    """cudaHostRegister's cudaErrorMemoryAllocation stops the step with a HostMemoryError that names
    host memory and counts as out of memory; nothing stays registered."""
    calls = RecordingCalls(fail_register=cuda_calls.CUDA_ERROR_MEMORY_ALLOCATION)
    with pytest.raises(HostMemoryError, match="^host memory: page-locking .* failed") as caught:
        _steps(monkeypatch, calls, [20])
    assert is_out_of_memory(caught.value)
    assert calls.registered == {} and calls.pool.in_use == 0


def test_a_failed_host_allocation_is_a_host_out_of_memory(monkeypatch):
    """torch's CPU allocator failing for a new buffer is a HostMemoryError too."""

    def empty(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")

    monkeypatch.setattr(host_pool, "torch", SimpleNamespace(empty=empty, uint8=torch.uint8))
    with pytest.raises(HostMemoryError, match="^host memory: allocating .*can't allocate memory"):
        RecordingCalls().pool.take(100)


def test_the_runtime_calls_map_cuda_errors(monkeypatch):
    """CudaCalls on a stand-in cudart: cudaErrorMemoryAllocation is a HostMemoryError, any other
    error a RuntimeError naming it, and either clears the error the runtime leaves pending."""
    codes, cleared = [], []

    class Cudart:
        def cudaHostRegister(self, address, nbytes, flags):
            codes.append((address, nbytes, flags))
            return codes_to_return.pop(0)

        def cudaHostUnregister(self, address):
            return 0

    codes_to_return = [0, 2, 712]
    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    monkeypatch.setattr(CudaCalls, "clear_pending_error", lambda self: cleared.append(1))
    calls = CudaCalls()
    calls.host_register(4096, 8192)
    with pytest.raises(HostMemoryError, match="host memory"):
        calls.host_register(4096, 8192)
    with pytest.raises(RuntimeError, match="cudaError 712"):
        calls.host_register(4096, 8192)
    calls.host_unregister(4096)
    assert codes == [(4096, 8192, 0)] * 3 and cleared == [1, 1]


def test_release_pinned_memory_frees_the_process_pool(monkeypatch):
    """The public release_pinned_memory() unregisters every buffer the process keeps between steps,
    and the next step registers anew."""
    calls = RecordingCalls()
    monkeypatch.setattr(cuda_calls, "CUDA_CALLS", calls)
    _steps(monkeypatch, calls, [20])
    assert release_pinned_memory() == NUM_LAYERS * whole_pages(20 * 64 * 8)
    assert calls.registered == {} and release_pinned_memory() == 0
    (store,) = _steps(monkeypatch, calls, [20])
    assert store.host_register_s > 0 and len(calls.registered) == NUM_LAYERS
    calls.assert_clean()


@pytest.mark.parametrize("checkpoints", ["cpu", "cpu+recompute:2"])
def test_the_planner_counts_registration_in_the_first_step_only(monkeypatch, checkpoints):
    """simulate/plan.py prices the page-locking of every layer input the host holds (at the pinning
    rate, HOST_REGISTER_BYTES_S by default) apart from the steady step, for as many buffers as the
    store registers; the gpu placement pins nothing."""
    from sbpbench.config import RunSpec
    from sbpbench.simulate.plan import candidates, meta_model
    from sbpbench.simulate.timing import HOST_REGISTER_BYTES_S, Rates

    calls = RecordingCalls()
    _steps(monkeypatch, calls, [20], checkpoints)
    spec = RunSpec(model="tiny/qwen3", method="streambp", seq_len=20, num_layers=NUM_LAYERS, dtype="fp64")
    layer_bytes = 20 * 64 * 8
    found = {(c.placement, c.chunk_size): c for c in candidates(spec, meta_model(spec), Rates())}
    pinned = found[Placement.parse(checkpoints), 500].time.first_step_pinning_s * HOST_REGISTER_BYTES_S
    assert pinned == pytest.approx(len(calls.registrations) * layer_bytes)
    assert found[Placement(), 500].time.first_step_pinning_s == 0


@pytest.mark.slow  # over 3 s on 2 cores
def test_a_measured_point_records_its_first_steps_registration(monkeypatch):
    """measure_point on the stand-in: host_register_s is the first step's page-locking (one buffer
    per layer input, registered once across the point's memory, warm-up and timed steps); a failed
    registration is an oom row whose error names host memory; without pinned buffers it stays empty."""
    from sbpbench.config import RunSpec
    from sbpbench.methods import MethodSettings
    from sbpbench.runner.point import measure_point

    spec = RunSpec(model="tiny/qwen3", method="streambp", seq_len=32, warmup=1, repeats=2, device="cpu",
                   settings=MethodSettings(checkpoints="cpu"))  # fmt: skip
    calls = RecordingCalls()
    route_stores(monkeypatch, calls)
    row = measure_point(spec)
    assert row.status == "ok", row.error
    assert row.host_register_s > 0 and len(calls.registrations) == row.num_layers
    failing = RecordingCalls(fail_register=cuda_calls.CUDA_ERROR_MEMORY_ALLOCATION)
    route_stores(monkeypatch, failing)
    row = measure_point(spec)
    assert row.status == "oom" and row.error.startswith("HostMemoryError: host memory: page-locking"), row.error
    monkeypatch.undo()
    assert measure_point(spec).host_register_s is None  # the CPU's own copies: nothing page-locked
