"""The stream placements (core/placements/stream_store.py, core/placements/sequences.py): layer inputs, Z_L and the gradient
in host buffers, moved a chunk at a time, binomial rebuilds where the buffers are fewer than the
inputs (core/placements/rebuild_schedule.py). Same operations on the same values as the gpu placement: the
loss and every gradient equal gpu's to the bit (fp64, every family, objective, layout, LoRA); no
tensor of T positions x hidden size is made on the device; the schedule keeps at most N buffers
and rebuilds as few layers as binomial checkpointing allows."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sbpbench.core.placements.placement import Placement
from sbpbench.core.placements.rebuild_schedule import extra_forwards, rebuilt_layers, schedule
from sbpbench.data import make_batch

from ..conftest import FAMILIES, left_padded_batch, observing_stores, packed_rows, streamed
from .test_placement import NUM_LAYERS, _deep_model

STREAMS = ("stream", "stream:2", "stream:3")  # every input kept; each rebuilt from X_0; binomial
SPANS = [(6, 29), (0, 29), (3, 25)]  # left padding, none, both sides
DOCS = [[7, 12, 3, 9, 1, 1], [20, 13]]  # packed documents, T = 33


def _run(model, input_ids, checkpoints: str, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = streamed(model, input_ids, chunk_size=7, logits_chunk_size=9, checkpoints=checkpoints, **kwargs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads


def _assert_bitwise(model, input_ids, **kwargs) -> None:
    """Every stream placement gives the gpu placement's loss and gradients to the bit."""
    ref_loss, ref_grads = _run(model, input_ids, "gpu", **kwargs)
    assert ref_grads, "no gradients"
    for placement in STREAMS:
        loss, grads = _run(model, input_ids, placement, **kwargs)
        assert torch.equal(loss, ref_loss), f"{placement}: loss {loss.item()!r} != {ref_loss.item()!r}"
        assert grads.keys() == ref_grads.keys(), placement
        for name, ref in ref_grads.items():
            diff = (grads[name] - ref).abs().max().item()
            assert torch.equal(grads[name], ref), f"{placement}: {name} differs by {diff:.3g}"


@pytest.mark.parametrize(
    "objective", ["sft", pytest.param("grpo", marks=pytest.mark.slow), pytest.param("dpo", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("family", FAMILIES)
def test_stream_gives_gpu_gradients_to_the_bit(family, objective):
    """fp64, 5 layers, chunks that do not divide T, batch of 2: stream, stream:2, stream:3 equal gpu."""
    model = _deep_model(family)
    batch = make_batch(objective, batch_size=2, seq_len=30, vocab_size=model.config.vocab_size, prompt_len=8)
    _assert_bitwise(model, batch.input_ids, objective=batch.objective(), attention_mask=batch.attention_mask)


@pytest.mark.parametrize("family", ["tiny/qwen3", pytest.param("tiny/gemma3", marks=pytest.mark.slow)])
def test_stream_with_lora_to_the_bit(family):
    """LoRA (frozen base and embedding: layer 0 writes no input gradient, no embedding backward)."""
    model = _deep_model(family, lora=True)
    batch = make_batch("sft", batch_size=2, seq_len=30, vocab_size=model.config.vocab_size)
    _assert_bitwise(model, batch.input_ids, objective=batch.objective(), attention_mask=batch.attention_mask)


@pytest.mark.parametrize("family", ["tiny/qwen3", *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES[1:])])
def test_stream_layouts_to_the_bit(family):
    """Left and right padding in one batch, and packed documents (position_ids): gpu's to the bit."""
    model = _deep_model(family)
    batch = left_padded_batch(model, seq_len=29, spans=SPANS)
    _assert_bitwise(model, batch.input_ids, labels=batch.labels, attention_mask=batch.attention_mask)
    input_ids, labels, position_ids = packed_rows(model, doc_lengths=DOCS)
    _assert_bitwise(model, input_ids, labels=labels, position_ids=position_ids)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op makes whose storage holds its elements (not a view, not
    a stride-0 token): what a step allocates."""

    def __init__(self):
        super().__init__()
        self.made: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            owns = isinstance(tensor, torch.Tensor) and tensor.storage_offset() == 0
            if owns and tensor.untyped_storage().nbytes() == tensor.nbytes > 0:
                self.made.add(tuple(tensor.shape))
        return out


@pytest.mark.parametrize("checkpoints", ["gpu", "stream:2"], ids=lambda p: f"checkpoints={p}")
def test_stream_makes_no_tensor_of_every_position_and_the_hidden_size(monkeypatch, checkpoints):
    """Allocations during a step on the CUDA stand-in: the gpu placement makes (B, T, d) tensors (its
    layer inputs, Z_L, dZ); stream makes none on the device (its host buffers are the pool's, bytes)."""
    from ..cuda_standin import RecordingCalls, route_stores

    calls = RecordingCalls()
    route_stores(monkeypatch, calls)
    model = _deep_model("tiny/qwen3")
    batch = make_batch("sft", batch_size=2, seq_len=30, vocab_size=model.config.vocab_size)
    shapes = _Shapes()
    with shapes:
        _run(model, batch.input_ids, checkpoints, objective=batch.objective())
    whole = (2, 30, model.config.hidden_size)
    assert (whole in shapes.made) == (checkpoints == "gpu"), sorted(s for s in shapes.made if len(s) == 3)[-4:]
    calls.pool.release()


@pytest.mark.parametrize("num_buffers", [2, 3, 4, 5])
def test_the_store_keeps_at_most_n_buffers_and_rebuilds_as_the_schedule_says(num_buffers):
    """stream:N on 5 layers: the host holds N layer inputs at most (the store asserts it on every
    buffer it takes), the step rebuilds F(L, N - 2) + 1 - L layers, and every buffer is back."""
    model = _deep_model("tiny/llama")
    batch = make_batch("sft", batch_size=1, seq_len=20, vocab_size=model.config.vocab_size)
    with observing_stores() as stores:
        _run(model, batch.input_ids, f"stream:{num_buffers}", objective=batch.objective())
    (store,) = stores
    layer_input = 20 * model.config.hidden_size * 8  # B = 1, T = 20, fp64
    assert store.max_host_bytes == num_buffers * layer_input and store.host_bytes == 0
    assert store.rebuilt == rebuilt_layers(NUM_LAYERS, num_buffers) == schedule(NUM_LAYERS, num_buffers).rebuilt
    assert store.device_inputs == store.max_device_inputs == 0


@cache
def _brute_force(layers: int, free: int) -> float:
    """F(layers, free) by trying every way: advance m <= layers - 1 into a free buffer, serve the top,
    free it, serve the rest (or infinity without a buffer)."""
    if layers <= 1:
        return 0
    if free <= 0:
        return float("inf")
    return min(m + _brute_force(layers - m, free - 1) + _brute_force(m, free) for m in range(1, layers))


def test_the_schedule_rebuilds_the_fewest_layers():
    """The DP's count matches trying every split, and the schedule's gets advance exactly that much;
    every buffer kept (at most N - 1 inputs and the gradient's) and each input kept before its get."""
    for layers in range(1, 13):
        for buffers in range(2, layers + 2):
            assert extra_forwards(layers, buffers - 1) == _brute_force(layers, buffers - 1), (layers, buffers)
            plan = schedule(layers, buffers)
            kept = {0, *plan.pass_kept}
            assert len(plan.pass_kept) <= buffers - 1
            for index in reversed(range(layers)):
                for start, end in plan.advances[index]:
                    assert start in kept and end not in kept
                    kept.add(end)
                assert index in kept and len(kept - {0}) <= buffers - 1
                kept.discard(index)
            assert plan.rebuilt == rebuilt_layers(layers, buffers)


def test_qwen3_8b_rebuilds_37_layers_with_seven_buffers():
    """36 layers: N = 7 (two million tokens in 120 GiB of host) rebuilds 37 layers, N = 14 (one
    million) 22, N = 36 none; segments rebuilt into host memory (cpu+recompute:6+spill) would hold 12
    inputs for 30."""
    assert [rebuilt_layers(36, n) for n in (2, 7, 14, 36)] == [595, 37, 22, 0]


@pytest.mark.parametrize(
    ("text", "placement"),
    [
        ("stream", Placement(stream=True)),
        ("stream:7", Placement(stream=True, host_buffers=7)),
        ("STREAM:2", Placement(stream=True, host_buffers=2)),
    ],
)
def test_stream_names_parse_and_round_trip(text, placement):
    """stream and stream:N parse to a Placement and back; N counts layer inputs (the gradient's too)."""
    assert Placement.parse(text) == placement
    assert Placement.parse(placement.name) == placement
    assert placement.buffers(36) == (placement.host_buffers or 36)
    assert Placement(stream=True, host_buffers=50).buffers(36) == 36  # never more than one per input


@pytest.mark.parametrize("text", ["stream:1", "stream:0", "stream:x", "stream+cpu", "cpu+stream:4", "stream:4+spill"])
def test_a_bad_stream_placement_is_refused(text):
    """stream:N needs N >= 2 and stands alone."""
    with pytest.raises(ValueError, match="N >= 2|recompute:K"):
        Placement.parse(text)


@pytest.mark.parametrize(("num_buffers", "lora"), [(2, False), (3, True), (5, False)])
def test_the_planner_counts_the_copies_a_stream_step_makes(num_buffers, lora):
    """simulate/depth.py's stream_transfers, which the planner's time model and the depth lift use,
    is what a real step's copies move (every head chunk with a target; LoRA: no dX_0, no embedding
    backward), in layer inputs."""
    from sbpbench.simulate.depth import stream_transfers

    model = _deep_model("tiny/qwen3", lora=lora)
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with observing_stores() as stores:
        _run(model, ids, f"stream:{num_buffers}", labels=ids)
    (store,) = stores
    layer_input = 20 * model.config.hidden_size * 8  # B = 1, T = 20, fp64
    assert store.transfer_bytes == stream_transfers(NUM_LAYERS, num_buffers, embedding_trains=not lora) * layer_input
