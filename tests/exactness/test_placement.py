"""Checkpoint placements (core/placements/placement.py): gpu, cpu, recompute:K, cpu+recompute:K and
cpu+recompute:K+spill run the same operations, so they give gpu's loss and gradients to the bit; the offload path's ordering and
freeing, checked on CPU where its copies are ordinary tensor copies."""

from __future__ import annotations

from contextlib import contextmanager
from typing import ClassVar

import pytest
import torch

from sbpbench.core import UnsupportedModelError
from sbpbench.core import stream as stream_module
from sbpbench.core.placements.placement import CheckpointStore, Placement
from sbpbench.data import make_batch
from sbpbench.models import apply_lora

from ..conftest import FAMILIES, observing_stores, streamed, tiny_model

NUM_LAYERS = 5  # K = 2, 3 do not divide it, K = 5 does, K = 7 is deeper than the model
PLACEMENTS = (
    "cpu",
    "recompute:2",
    "recompute:3",
    "recompute:5",
    "cpu+recompute:2",
    "cpu+recompute:7",
    "cpu+recompute:4+spill",  # segments [0, 4) (X_1 spilled) and [4, 5)
    "cpu+recompute:5+spill",  # one segment, X_1 and X_2 spilled
)


def _deep_model(family: str, lora: bool = False):
    overrides = {"num_hidden_layers": NUM_LAYERS}
    if family == "tiny/gemma3":
        overrides["layer_types"] = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    model = tiny_model(family, torch.float64, **overrides)
    return apply_lora(model, rank=4, alpha=8, init_nonzero_seed=0) if lora else model


def _step(model, batch, checkpoints: str, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = streamed(
        model,
        batch.input_ids,
        objective=batch.objective(),
        attention_mask=batch.attention_mask,
        chunk_size=7,
        logits_chunk_size=9,
        checkpoints=checkpoints,
        **kwargs,
    )
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads


def _assert_same_as_gpu(model, batch):
    ref_loss, ref_grads = _step(model, batch, "gpu")
    assert ref_grads, "no gradients"
    for placement in PLACEMENTS:
        loss, grads = _step(model, batch, placement)
        assert torch.equal(loss, ref_loss), f"{placement}: loss {loss.item()!r} != {ref_loss.item()!r}"
        assert grads.keys() == ref_grads.keys(), placement
        for name, ref in ref_grads.items():
            diff = (grads[name] - ref).abs().max().item()
            assert diff <= 1e-12 * max(ref.abs().max().item(), 1.0), f"{placement}: {name} differs by {diff:.3g}"


@pytest.mark.parametrize(
    "objective", ["sft", pytest.param("grpo", marks=pytest.mark.slow), pytest.param("dpo", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_placement_gives_gpu_gradients(family, objective):
    """fp64, 5 layers, chunks that do not divide T: every placement equals gpu's loss and gradients."""
    model = _deep_model(family)
    batch = make_batch(objective, batch_size=2, seq_len=30, vocab_size=model.config.vocab_size, prompt_len=8)
    _assert_same_as_gpu(model, batch)


@pytest.mark.parametrize(
    "family", ["tiny/qwen3", pytest.param("tiny/gemma3", marks=pytest.mark.slow)]
)  # gemma3: over 3 s
def test_every_placement_gives_gpu_gradients_with_lora(family):
    """LoRA (frozen base, adapters trained, frozen embedding: layer 0 needs no input gradient)."""
    model = _deep_model(family, lora=True)
    batch = make_batch("sft", batch_size=2, seq_len=30, vocab_size=model.config.vocab_size)
    _assert_same_as_gpu(model, batch)


class _Recording(CheckpointStore):
    """A store that logs every put/get/release and the inputs it holds on the device."""

    instances: ClassVar[list[_Recording]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, int, int]] = []
        _Recording.instances.append(self)

    def put(self, index, layer_input):
        super().put(index, layer_input)
        self.log.append(("put", index, self.device_inputs))

    def get(self, index, device):
        out = super().get(index, device)
        self.log.append(("get", index, self.device_inputs))
        return out

    def release(self, index):
        super().release(index)
        self.log.append(("release", index, self.device_inputs))


def _recorded_step(monkeypatch, checkpoints: str) -> _Recording:
    _Recording.instances = []
    monkeypatch.setattr(stream_module, "CheckpointStore", _Recording)
    model = _deep_model("tiny/qwen3")
    batch = make_batch("sft", batch_size=1, seq_len=20, vocab_size=model.config.vocab_size)
    _step(model, batch, checkpoints)
    (store,) = _Recording.instances
    return store


def _streamed_layer_loop() -> list[tuple[str, int, int]]:
    """The log of a layer loop that streams its inputs as cpu does: each get finds its input on the
    device and the next one's prefetch (2, the last get 1), each release leaves the prefetch."""
    expected = []
    for index in reversed(range(NUM_LAYERS)):
        expected += [("get", index, 2 if index > 0 else 1), ("release", index, 1 if index > 0 else 0)]
    return expected


def test_cpu_placement_holds_at_most_two_inputs_on_the_device(monkeypatch):
    """cpu: every input goes to the host during the pass, none stays on the device; the backward
    holds the current layer's input and the next one's prefetch, and frees each after its layer."""
    store = _recorded_step(monkeypatch, "cpu")
    assert [e for e in store.log if e[0] == "put"] == [("put", i, 0) for i in range(NUM_LAYERS)]
    assert [e for e in store.log if e[0] != "put"] == _streamed_layer_loop()
    assert store.max_device_inputs == 2
    d = 64 * 8  # hidden 64 in fp64, per position
    assert store.transfer_bytes == 2 * NUM_LAYERS * 20 * d  # each input out and back once
    assert store.max_host_bytes == NUM_LAYERS * 20 * d and store.host_bytes == 0


def test_recompute_keeps_every_kth_input_and_rebuilds_a_segment_at_its_start(monkeypatch):
    """recompute:2 on 5 layers keeps X_0, X_2, X_4; layer 3's get rebuilds X_3 from X_2; nothing
    goes to the host."""
    store = _recorded_step(monkeypatch, "recompute:2")
    assert [e[2] for e in store.log if e[0] == "put"] == [1, 1, 2, 2, 3]
    assert store.max_device_inputs == 3  # X_4 released before layer 3's get: X_0, X_2 and X_3
    assert store.transfer_bytes == 0 and store.max_host_bytes == 0


def test_cpu_recompute_holds_a_segment_and_one_prefetch(monkeypatch):
    """cpu+recompute:3 on 5 layers: the host holds X_0 and X_3; the device at most a segment (3)."""
    store = _recorded_step(monkeypatch, "cpu+recompute:3")
    assert store.max_device_inputs == 3
    assert store.device_inputs == 0


def test_spill_holds_at_most_two_inputs_on_the_device_and_streams_the_rebuilt_ones(monkeypatch):
    """cpu+recompute:5+spill on 5 layers: layer 4's get rebuilds X_1 .. X_4 from X_0 holding two at
    a time, sends X_1 and X_2 to the host and keeps X_3, X_4; every later get finds its input
    prefetched and sets the next one on its way, as cpu does."""
    store = _recorded_step(monkeypatch, "cpu+recompute:5+spill")
    assert [e for e in store.log if e[0] != "put"] == _streamed_layer_loop()
    assert store.max_device_inputs == 2
    d = 64 * 8  # hidden 64 in fp64, per position
    # X_0 out in the pass, back for the rebuild; X_1, X_2 out in the rebuild; X_2, X_1, X_0 back
    assert store.transfer_bytes == 7 * 20 * d
    assert store.max_host_bytes == 3 * 20 * d == Placement.parse("cpu+recompute:5+spill").host_inputs(5) * 20 * d
    assert store.host_bytes == 0


@pytest.mark.parametrize(
    ("placement", "num_layers", "inputs"),
    [
        ("gpu", 36, 0),
        ("cpu", 36, 36),
        ("cpu+recompute:4", 36, 9),
        ("cpu+recompute:4+spill", 36, 10),
        ("cpu+recompute:6+spill", 36, 9),
        ("cpu+recompute:6+spill", 4, 2),
        ("cpu+recompute:2+spill", 36, 18),
    ],
)
def test_host_inputs_counts_the_kept_and_the_spilled(placement, num_layers, inputs):
    """The planner's host count: ceil(L/K) kept, plus K - 3 spilled for a segment of K layers."""
    assert Placement.parse(placement).host_inputs(num_layers) == inputs


@pytest.mark.parametrize(
    ("text", "placement"),
    [
        ("gpu", Placement()),
        ("cpu", Placement(offload=True)),
        ("recompute:4", Placement(recompute_every=4)),
        ("cpu+recompute:2", Placement(offload=True, recompute_every=2)),
        ("recompute:3+cpu", Placement(offload=True, recompute_every=3)),
        ("cpu+recompute:4+spill", Placement(offload=True, recompute_every=4, spill=True)),
        ("spill+recompute:6+cpu", Placement(offload=True, recompute_every=6, spill=True)),
    ],
)
def test_placement_names_parse_and_round_trip(text, placement):
    """The names the CLI and rows use parse to a Placement and back (canonical order cpu first)."""
    assert Placement.parse(text) == placement
    assert Placement.parse(placement.name) == placement


@pytest.mark.parametrize(
    "text",
    [
        "host",
        "recompute",
        "recompute:0",
        "recompute:x",
        "cpu+cpu",
        "gpu+cpu",
        "spill",
        "cpu+spill",
        "recompute:4+spill",
        "cpu+recompute:4+spill+spill",
    ],
)
def test_a_bad_placement_is_refused(text):
    """A name outside gpu / cpu / recompute:K / cpu+recompute:K[+spill] raises, naming the choices."""
    with pytest.raises(ValueError, match="recompute:K"):
        Placement.parse(text)


def test_observed_stores_report_what_a_step_held_and_moved():
    """on_store hands out each step's store: its counters are what a row records."""

    model = _deep_model("tiny/llama")
    batch = make_batch("sft", batch_size=1, seq_len=20, vocab_size=model.config.vocab_size)
    with observing_stores() as stores:
        _step(model, batch, "cpu+recompute:2")
    (store,) = stores
    kept = 3  # X_0, X_2, X_4 of 5 layers
    assert store.max_host_bytes == kept * 20 * 64 * 8 and store.transfer_bytes == 2 * store.max_host_bytes
    assert store.host_bytes == 0 and store.device_inputs == 0  # all released (closed) after the step


def test_a_sharded_rebuild_gathers_each_layer_once_and_runs_it_hook_free(monkeypatch):
    """Under a data-parallel sync (FSDP2, DeepSpeed) a segment rebuild holds each rebuilt layer
    gathered once (sync.rebuilding) and runs its chunks through sync.call (hook-free): the gradients
    are the gpu placement's. A caller's hook on a layer, which the hook-free chunks would skip, is
    refused before the step."""
    from sbpbench.core.parallel.grad_sync_base import GradSync

    rebuilt, hooked = [], []

    class ShardedSync(GradSync):  # stands in for FSDP2Sync / DeepSpeedSync
        def call(self, layer):
            return layer.forward

        @contextmanager
        def rebuilding(self, layer):
            rebuilt.append(layer)
            yield

    model = _deep_model("tiny/qwen3")
    batch = make_batch("sft", batch_size=1, seq_len=16, vocab_size=model.config.vocab_size)
    _step(model, batch, "gpu")
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    monkeypatch.setattr(stream_module, "grad_sync_for", lambda model, parts, **kwargs: ShardedSync())
    layers = model.model.layers
    _step(model, batch, "cpu+recompute:2")
    # NUM_LAYERS = 5, K = 2: inputs 0, 2, 4 kept; X_1 and X_3 rebuilt by layers 0 and 2
    assert [list(layers).index(layer) for layer in rebuilt] == [2, 0]
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=1e-12, msg=name)
    layers[1].register_forward_pre_hook(lambda module, args: hooked.append(module))
    with pytest.raises(UnsupportedModelError, match="forward hook on layers.1 would not run"):
        _step(model, batch, "cpu+recompute:2")
    assert not hooked


@pytest.mark.parametrize("checkpoints", ["cpu", "cpu+recompute:2", "cpu+recompute:4+spill", "cpu+recompute:5+spill"])
def test_the_planner_counts_the_copies_the_store_makes(monkeypatch, checkpoints):
    """simulate/depth.py's store_counts, which the planner's time model and bounds use, gives the
    layer inputs a real step's store moved and held: copy-bound (no compute to hide a copy), the
    modelled copy time is one copy per layer input moved."""
    from sbpbench.simulate.depth import store_counts
    from sbpbench.simulate.timing import Rates, Work, step_time

    store = _recorded_step(monkeypatch, checkpoints)
    layer_bytes = 20 * 64 * 8  # B=1, T=20, hidden 64, fp64
    counts = store_counts(Placement.parse(checkpoints), NUM_LAYERS)
    assert counts.transfers * layer_bytes == store.transfer_bytes
    assert counts.max_host_inputs * layer_bytes == store.max_host_bytes
    idle = Work(0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0)
    rates = Rates()
    time = step_time(idle, rates, layer_input_bytes=layer_bytes, copies_out=1, copies_back=counts.transfers - 1)
    assert round(time.host_copies_s * rates.host_copy_bytes_s) == store.transfer_bytes
