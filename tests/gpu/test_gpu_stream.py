"""On a CUDA GPU: the stream placements and the phase timer, whose CUDA branches (a side stream,
page-locked host buffers, CUDA events) the CPU tests reach only through stand-ins.

Stream placements: in fp64 on a 5-layer tiny model, `stream:2` at batch 2 and `stream:3` at batch 1
(layer inputs rebuilt, rebuild_schedule.py) give the gpu placement's loss and gradients, as
tests/exactness/test_stream_placement.py checks on the CPU. The bound is 1e-12 of each gradient's
largest value, not bit equality: cuBLAS may pick another kernel for a copied chunk than for a slice
of the whole tensor. A chunk copied from the wrong buffer or read before its copy landed is off by
the values themselves.

Phase timer (core/phases.py): a CUDA step's phases are timed by events on their streams. Each phase
that does work has positive seconds, the compute stream's phases never count a second twice, they
cover most of the step, and the step's event time is its wall time less the host's set-up.

Attention runs the lower-right reference here: these tests are about placement and timing
(test_gpu_kernels.py checks the other kernels).
"""

from __future__ import annotations

import time

import pytest
import torch

from sbpbench.core.kernels.kernel_choice import LOWER_RIGHT
from sbpbench.core.phases import (
    CHECKPOINT_PASS,
    CHUNK_BACKWARD,
    CHUNK_FORWARD,
    HEAD,
    HOST_COPIES,
    KV_CAPTURE,
    REBUILD,
    PhaseTimer,
)
from sbpbench.core.placements.rebuild_schedule import rebuilt_layers
from sbpbench.data import make_batch
from sbpbench.models import build_model

from ..conftest import observing_stores, streamed
from ..exactness.test_placement import NUM_LAYERS, _deep_model

pytestmark = [pytest.mark.gpu, pytest.mark.quick]

DEVICE = "cuda"  # test_gpu_tier.py runs these tests on the CPU (tiny shapes)
# (placement, batch size): each rebuilds layers on 5 layers (stream:2 six, stream:3 two)
STREAMS = [("stream:2", 2), ("stream:3", 1)]
SEQ_LEN, CHUNK, LOGITS_CHUNK = 257, 64, 50  # chunks that do not divide T
EXACT = 1e-12  # of a gradient's largest magnitude, fp64
# The timed step: a reduced Qwen3-0.6B in bf16, long enough that the GPU, not the host's launches,
# sets its time; stream:2 on 4 layers rebuilds 3, so every phase runs.
TIMED_MODEL, TIMED_OVERRIDES = "Qwen/Qwen3-0.6B", {"num_hidden_layers": 4}
TIMED_SEQ_LEN, TIMED_CHUNK, TIMED_LOGITS_CHUNK = 16384, 4096, 2048
TIMED_PLACEMENT = "stream:2"
WORKING_PHASES = (CHECKPOINT_PASS, HEAD, KV_CAPTURE, CHUNK_FORWARD, CHUNK_BACKWARD, REBUILD, HOST_COPIES)


def _step(model, batch, checkpoints: str, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = streamed(
        model,
        batch.input_ids,
        objective=batch.objective(),
        attention_mask=batch.attention_mask,
        checkpoints=checkpoints,
        chunk_attention=LOWER_RIGHT,
        **kwargs,
    )
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads


@pytest.mark.parametrize(("placement", "batch_size"), STREAMS, ids=[f"{p}-B{b}" for p, b in STREAMS])
def test_cuda_stream_placement_gives_gpu_gradients(placement, batch_size):
    """fp64: the stream placement's loss and every gradient equal the gpu placement's (within
    1e-12 of each gradient's largest value), its host buffers page-locked, the layers the schedule
    rebuilds rebuilt, and its host memory all handed back."""
    model = _deep_model("tiny/qwen3").to(DEVICE)
    batch = make_batch("sft", batch_size=batch_size, seq_len=SEQ_LEN, vocab_size=model.config.vocab_size, device=DEVICE)
    chunks = {"chunk_size": CHUNK, "logits_chunk_size": LOGITS_CHUNK}
    ref_loss, ref_grads = _step(model, batch, "gpu", **chunks)
    with observing_stores() as stores:
        loss, grads = _step(model, batch, placement, **chunks)
    (store,) = stores
    assert store.pins_host_memory == (torch.device(DEVICE).type == "cuda")
    assert store.rebuilt == rebuilt_layers(NUM_LAYERS, int(placement.split(":")[1])) > 0
    assert store.transfer_bytes > 0 and store.host_bytes == 0 and store.max_device_inputs == 0
    assert ref_grads and grads.keys() == ref_grads.keys()
    assert abs(loss.item() - ref_loss.item()) <= EXACT * abs(ref_loss.item()), (loss.item(), ref_loss.item())
    bitwise = sum(torch.equal(grads[n], ref) for n, ref in ref_grads.items())
    print(f"{placement} B={batch_size}: {bitwise} of {len(ref_grads)} gradients equal gpu's to the bit")
    for name, ref in ref_grads.items():
        diff = (grads[name] - ref).abs().max().item()
        assert diff <= EXACT * max(ref.abs().max().item(), 1.0), f"{placement}: {name} differs by {diff:.3g}"


def _timed_model():
    return build_model(TIMED_MODEL, dtype=torch.bfloat16, device=DEVICE, **TIMED_OVERRIDES)


def _synchronize() -> None:
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def test_cuda_phase_times_add_up_to_the_step():
    """A stream:2 step timed by CUDA events, after one untimed step: every phase that does work has
    positive seconds, the host copies ran beside the compute stream, the compute stream's phases
    sum to at most the step's time and cover at least half of it, and the step's event time lies
    between half its wall time and its wall time."""
    model = _timed_model()
    batch = make_batch("sft", batch_size=1, seq_len=TIMED_SEQ_LEN, vocab_size=model.config.vocab_size, device=DEVICE)
    chunks = {"chunk_size": TIMED_CHUNK, "logits_chunk_size": TIMED_LOGITS_CHUNK}
    _step(model, batch, TIMED_PLACEMENT, **chunks)  # warm-up: cuBLAS handles, pinned buffers, kernel plans
    timer = PhaseTimer()
    _synchronize()
    start = time.perf_counter()
    _step(model, batch, TIMED_PLACEMENT, timer=timer, **chunks)
    _synchronize()
    wall_s = time.perf_counter() - start
    times = timer.resolve()
    shown = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in times.seconds.items())
    print(f"step {times.step_s * 1e3:.1f} ms (wall {wall_s * 1e3:.1f} ms), other {times.other_s * 1e3:.1f} ms: {shown}")
    idle = [name for name in WORKING_PHASES if not times.seconds[name] > 0]
    assert not idle, f"phases that did work but got no time: {idle} ({shown})"
    if torch.device(DEVICE).type == "cuda":
        assert HOST_COPIES in times.overlapped  # on the copies' side stream
    inside = sum(s for name, s in times.seconds.items() if name not in times.overlapped)
    assert inside <= times.step_s * 1.001 + 1e-6, f"compute-stream phases {inside:.4f} s > step {times.step_s:.4f} s"
    assert times.other_s <= 0.5 * times.step_s, f"phases cover {inside / times.step_s:.0%} of the step"
    assert 0.5 * wall_s <= times.step_s <= wall_s * 1.001 + 1e-4, (times.step_s, wall_s)
