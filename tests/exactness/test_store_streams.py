"""The CUDA branch of CheckpointStore and StreamingStore (side stream, events, record_stream,
page-locked buffers), run on CPU tensors through a recording stand-in for its CUDA calls
(tests/cuda_standin.py): every copy back is waited for before it is read, no host buffer is handed
back or unregistered while a copy may use it, no device tensor is freed under a copy, every buffer
goes back to the pool when the store closes (after an error too) and every registration is undone
when the pool is released; the gradients are the gpu placement's. A store with one wait removed
fails the checks, and so does the stream placement with any one of its chunk waits removed."""

from __future__ import annotations

import pytest
import torch

from sbpbench.core.placements.placement import Placement
from sbpbench.data import make_batch

from ..conftest import observing_stores, tiny_model
from ..cuda_standin import RecordingCalls, route_stores
from .test_placement import NUM_LAYERS, _deep_model, _step

PLACEMENTS = (
    "gpu", "cpu", "recompute:2", "cpu+recompute:2", "cpu+recompute:4+spill", "cpu+recompute:5+spill", "stream",
    "stream:2",
)  # fmt: skip


def _recorded_step(monkeypatch, calls: RecordingCalls, checkpoints: str, model=None, **kwargs):
    """One StreamBP step whose store makes its CUDA calls to `calls`, every op tracked."""
    route_stores(monkeypatch, calls)
    model = model if model is not None else _deep_model("tiny/qwen3")
    batch = make_batch("sft", batch_size=1, seq_len=20, vocab_size=model.config.vocab_size)
    with calls.tracking():
        return _step(model, batch, checkpoints, **kwargs)


def _layer_bytes() -> int:
    return 20 * 64 * 8  # B=1, T=20, hidden 64, fp64


# ids "checkpoints=...": a test id "gpu" would be skipped as GPU-only (conftest.py)
@pytest.mark.parametrize("checkpoints", PLACEMENTS, ids=lambda p: f"checkpoints={p}")
def test_the_cuda_branch_is_ordered_and_exact(monkeypatch, checkpoints):
    """Every placement's CUDA branch on the stand-in: no race, host or free violation, every buffer
    back in the pool, the gpu placement's loss and gradients to the bit."""
    model = _deep_model("tiny/qwen3")
    batch = make_batch("sft", batch_size=1, seq_len=20, vocab_size=model.config.vocab_size)
    ref_loss, ref_grads = _step(model, batch, "gpu")
    calls = RecordingCalls()
    with observing_stores() as stores:
        loss, grads = _recorded_step(monkeypatch, calls, checkpoints, model=model)
    calls.assert_clean()
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert torch.equal(grads[name], ref), name
    placement = Placement.parse(checkpoints)
    # the first step registers one buffer per layer input the host holds at once (at most what the
    # planner counts), reusing those freed, and hands every one back
    (store,) = stores
    assert len(calls.registrations) == store.max_host_bytes // _layer_bytes() <= placement.host_inputs(NUM_LAYERS)
    assert calls.pool.in_use == 0 and len(calls.registered) == len(calls.registrations)
    assert (calls.side_ops > 0) == (placement.offload or placement.stream)  # the copies ran on the side stream
    calls.pool.release()
    assert calls.registered == {} and not calls.violations


class _Stop(Exception):
    pass


def _raising_in_the_pass(model, layer: int = 3):
    """The checkpoint pass raises as it reaches `layer`, with copies out of the layers below in flight."""

    def hook(module, args):
        raise _Stop

    model.model.layers[layer].register_forward_pre_hook(hook)
    return model


def _raising_after_two_layers(done: int, num_layers: int) -> None:
    """A progress callback: the layer loop raises after two layers, with a copy back in flight."""
    if done == 2:
        raise _Stop


@pytest.mark.parametrize(
    ("drop", "caught"),
    [
        ("wait_event", "race"),  # the layer reads its input before the copy back is done
        ("wait_stream", "race"),  # the copies start before the compute that wrote (or frees) their memory
        ("event_synchronize", "host"),  # a buffer goes back to the pool while its copy back reads it
        ("record_stream", "free"),  # X_l's memory is freed while its copy out reads it
        ("stream_synchronize", "host"),  # after an error, buffers go back while their copies out run
    ],
)
def test_a_store_with_one_wait_removed_is_caught(monkeypatch, drop, caught):
    """The cpu step with one of the store's waits swallowed by the stand-in fails its checks (the
    close's stream synchronisation matters after an error in the pass, so that step raises there)."""
    calls = RecordingCalls(drop=drop)
    if drop == "stream_synchronize":
        with pytest.raises(_Stop):
            _recorded_step(monkeypatch, calls, "cpu", model=_raising_in_the_pass(_deep_model("tiny/qwen3")))
    else:
        _recorded_step(monkeypatch, calls, "cpu")
    assert any(v.startswith(caught) for v in calls.violations), calls.violations[:4]


@pytest.mark.parametrize("drop", ["wait_event", "wait_stream", "event_synchronize", "record_stream"])
def test_a_stream_store_with_one_kind_of_wait_removed_is_caught(monkeypatch, drop):
    """stream:2 (buffers reused in place, rebuilds) with every call of one kind swallowed: caught."""
    calls = RecordingCalls(drop=drop)
    _recorded_step(monkeypatch, calls, "stream:2")
    caught = {"wait_event": "race", "wait_stream": "race", "event_synchronize": "host", "record_stream": "free"}
    assert any(v.startswith(caught[drop]) for v in calls.violations), calls.violations[:4]


def _stream_waits(monkeypatch, drop_at: int | None) -> RecordingCalls:
    """A 2-layer stream:2 step (X_1 rebuilt from X_0; 3 layer chunks, 3 head chunks) on the stand-in,
    with the drop_at-th wait of the compute stream for a copy removed (None: none)."""
    calls = RecordingCalls(drop="wait_event" if drop_at is not None else None, drop_at=drop_at)
    model = tiny_model("tiny/qwen3", torch.float64, num_hidden_layers=2)
    _recorded_step(monkeypatch, calls, "stream:2", model=model)
    return calls


def _every_wait(monkeypatch) -> list[int]:
    return list(range(_stream_waits(monkeypatch, None).calls["wait_event"]))


@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_the_stream_placement_without_one_chunk_wait_is_caught(monkeypatch, position):
    """One wait of the compute stream for a chunk's copy removed (the first, one in the middle, the
    last of the step): the chunk is read before its copy is known done, a race."""
    waits = _every_wait(monkeypatch)
    drop_at = {"first": waits[0], "middle": waits[len(waits) // 2], "last": waits[-1]}[position]
    calls = _stream_waits(monkeypatch, drop_at)
    assert any(v.startswith("race") for v in calls.violations), (drop_at, calls.violations[:4])


@pytest.mark.slow
def test_the_stream_placement_without_any_one_chunk_wait_is_caught(monkeypatch):
    """Each of the step's waits for a chunk's copy removed in turn: every one is caught (no wait is
    redundant: a chunk is taken where it is first read, so no later wait covers its copy)."""
    missed = [k for k in _every_wait(monkeypatch) if not any(
        v.startswith("race") for v in _stream_waits(monkeypatch, k).violations
    )]  # fmt: skip
    assert not missed, missed


@pytest.mark.parametrize("where", ["checkpoint pass", "layer backward"])
def test_an_error_mid_step_hands_every_buffer_back(monkeypatch, where):
    """An exception inside the step (in the checkpoint pass with copies out in flight, or after two
    layers' backward with a copy back in flight): the store's close waits for its copies and hands
    every buffer back to the pool without a violation; releasing the pool undoes every registration."""
    calls = RecordingCalls()
    model = _deep_model("tiny/qwen3")
    with pytest.raises(_Stop):
        if where == "checkpoint pass":
            _recorded_step(monkeypatch, calls, "cpu", model=_raising_in_the_pass(model))
        else:
            _recorded_step(monkeypatch, calls, "cpu", model=model, progress=_raising_after_two_layers)
    calls.assert_clean()
    assert calls.registrations and calls.pool.in_use == 0
    calls.pool.release()
    assert calls.registered == {} and not calls.violations
