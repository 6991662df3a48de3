"""Memory timelines (`sbp run --timeline`): a measured step's memory over time, its phases, its peak
and the peak's bytes by kind, on the CPU from the live-tensor tracker (deterministic, so asserted
to the byte), on a GPU from PyTorch's memory history (here through a stand-in), and the estimator's
prediction in the same format."""

from __future__ import annotations

import json
import pickle
import re
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from sbpbench.config import point_specs
from sbpbench.core import memory_kinds
from sbpbench.measure.tensor_tracker import LiveTensorTracker
from sbpbench.measure.timeline.data import KINDS, MAX_SAMPLES, load_timeline, peak_accuracy
from sbpbench.measure.timeline.log import TimelineLog
from sbpbench.measure.timeline.marks import StepPhases, phase_group
from sbpbench.measure.timeline.tracked import TrackedTimeline
from sbpbench.methods.memory_marks import marking
from sbpbench.models import load_config
from sbpbench.records import ResultRow
from sbpbench.runner import point
from sbpbench.simulate.timeline import predicted_timeline
from sbpbench.workload.build import build_model_and_batch, training_step
from sbpbench.workload.timeline import resident_kinds

from ..conftest import padded_batch, streamed, tiny_model
from ..cuda_standin import RecordingMemoryHistory


def _spec(method: str, seq_len: int = 96, **values):
    settings = {"model": "tiny/qwen3", "device": "cpu", "seq_len": seq_len, "repeats": 0, "threads": 1, **values}
    (spec,) = point_specs(settings, [method])
    return spec


def _measured(spec, tmp_path):
    row = point.measure_point(spec, tmp_path)
    assert row.status == "ok", row.error
    return row, load_timeline(row.timeline_file)


# Where streambp's peak is a layer's backward: a short logits chunk keeps the head below it.
LAYER_PEAK = {"logits_chunk_size": 16, "chunk_size": 32}


@pytest.mark.parametrize("method", ["bp", "ckpt", "streambp"])
def test_the_cpu_timeline_peaks_at_the_rows_peak_and_its_kinds_sum_to_it(tmp_path, method):
    """The tracker's timeline starts at the resident bytes, its highest sample is its peak, which is
    the row's peak_allocated_bytes to the byte, and the peak's kinds sum to it; weights and
    gradients are the row's."""
    spec = _spec(method, **(LAYER_PEAK if method == "streambp" else {}))
    row, timeline = _measured(spec, tmp_path)
    samples = timeline.samples
    assert timeline.source == "measured" and timeline.memory_source == "tensor-tracker" and timeline.axis == "op"
    assert samples["at"][0] == 0 and samples["bytes"][0] == row.baseline_bytes == timeline.baseline_bytes
    assert timeline.peak.bytes == row.peak_allocated_bytes == max(samples["bytes"])
    assert sum(timeline.peak.kinds.values()) == timeline.peak.bytes and list(timeline.peak.kinds) == list(KINDS)
    assert timeline.peak.kinds["weights"] == row.weights_bytes and timeline.peak.kinds["gradients"] >= row.grads_bytes
    assert samples["at"] == sorted(samples["at"]) and samples["at"][-1] == timeline.end
    assert timeline.point["method"] == method and timeline.status == "ok"


def test_streambp_phases_run_in_order_and_its_kinds_are_named(tmp_path):
    """A streambp timeline runs the checkpoint pass layer by layer, the head's chunks, then each layer's
    K/V capture, chunk forward and chunk backward from the last layer down; at a peak inside a
    layer's backward it holds checkpoints, K/V buffers and dK/dV sums."""
    row, timeline = _measured(_spec("streambp", **LAYER_PEAK), tmp_path)
    names = [timeline.phases[index] for _, index in timeline.spans]
    layers = row.num_layers
    assert [n for n in names if n.startswith("checkpoint pass, layer")] == [
        f"checkpoint pass, layer {i}" for i in range(layers)
    ]
    assert [n for n in names if n.startswith("K/V capture")] == [
        f"K/V capture, layer {i}" for i in reversed(range(layers))
    ]
    first_head = next(i for i, n in enumerate(names) if n.startswith("head chunk"))
    assert (
        names.index(f"checkpoint pass, layer {layers - 1}")
        < first_head
        < names.index(f"K/V capture, layer {layers - 1}")
    )
    found = re.fullmatch(r"chunk (forward|backward), layer (\d)", timeline.peak.phase)
    assert found, timeline.peak.phase
    kinds = timeline.peak.kinds
    hidden = load_config("tiny/qwen3").hidden_size
    held = int(found.group(2)) + 1  # X_0 .. X_l: the layers below still to run, and its own (fp32)
    assert kinds["checkpoints"] == held * row.batch_size * row.seq_len * hidden * 4
    assert kinds["K/V buffers"] > 0 and kinds["dK/dV sums"] == kinds["K/V buffers"]  # fp32 sums of fp32 K/V


def test_streambp_head_chunks_hold_logits(tmp_path):
    """With its default logits chunk, a short streambp step peaks in a head chunk, and most of what
    the chunk made is its logits (their loss terms and backward), not intermediates."""
    _, timeline = _measured(_spec("streambp"), tmp_path)
    kinds = timeline.peak.kinds
    assert timeline.peak.phase.startswith("head chunk") and kinds["logits"] > 4 * kinds["intermediates"]


def test_bp_phases_are_forward_head_backward(tmp_path):
    """bp's timeline: the forward layer by layer, the head (whose allocations are logits), then the
    backward from the last layer down; its peak at the head holds the full logits."""
    row, timeline = _measured(_spec("bp"), tmp_path)
    names = [timeline.phases[index] for _, index in timeline.spans]
    layers = row.num_layers
    expected = [*(f"forward layer {i}" for i in range(layers)), "head"]
    expected += [*(f"backward layer {i}" for i in reversed(range(layers))), "backward embedding"]
    assert names[names.index("forward layer 0") :] == expected and set(names[:3]) == {"forward", "embedding"}
    assert timeline.peak.phase == "head" and timeline.peak.kinds["logits"] > 0


@pytest.mark.parametrize("seq_len", [48, 128])
@pytest.mark.parametrize("method", ["bp", "ckpt", "streambp"])
def test_the_prediction_is_the_cpu_measurement_bucket_for_bucket(tmp_path, method, seq_len):
    """The estimator's timeline for the CPU (target cpu) equals the tracker's: the same peak, the
    same phase of it, the same bytes in every kind, the same phases; accuracy 1.0 throughout."""
    spec = _spec(method, seq_len, **(LAYER_PEAK if method == "streambp" else {}))
    _, measured = _measured(spec, tmp_path)
    predicted = predicted_timeline(spec, target="cpu")
    assert predicted.source == "simulated" and predicted.memory_source == "fake-tensor"
    assert predicted.peak.bytes == measured.peak.bytes and predicted.peak.phase == measured.peak.phase
    assert predicted.peak.kinds == measured.peak.kinds
    assert predicted.phases == measured.phases
    assert all(bucket.ratio == 1.0 for bucket in peak_accuracy(measured, predicted))


def test_a_gpu_prediction_rounds_blocks_and_says_so():
    """Target cuda counts 512-byte blocks: every kind at the peak is a multiple of 512, and the
    timeline says it is a GPU's. (bf16: torch 2.13's meta kernel of the efficient attention
    backward, which fp32 chunks with a prefix take, fails under fake tensors.)"""
    predicted = predicted_timeline(_spec("streambp", dtype="bf16", **LAYER_PEAK), target="cuda")
    assert all(nbytes % 512 == 0 for nbytes in predicted.peak.kinds.values())
    assert sum(predicted.peak.kinds.values()) == predicted.peak.bytes
    assert any("predicted for a GPU" in note for note in predicted.notes)


def test_a_first_protocol_train_step_names_gradients_and_optimizer_state(tmp_path):
    """Under the first protocol with an optimizer step, the gradients made in the step are noted as
    gradients, and the optimizer's moments made in its step as optimizer state (the timeline's end)."""
    spec = _spec("bp", protocol="first", step="train")
    row, timeline = _measured(spec, tmp_path)
    assert timeline.peak.kinds["gradients"] == 0  # none resident, the peak comes before they all exist
    names = [timeline.phases[index] for _, index in timeline.spans]
    assert names[-1] == "optimizer"
    log = TrackedTimeline({"other": 0})
    model, batch = build_model_and_batch(spec)
    step = training_step(spec, model, batch)
    step.prepare()
    with marking(log, step), log:
        step.run()
    assert log.kind_bytes["gradients"] == row.grads_bytes
    moments = [t for state in step.optimizer.state.values() for name, t in state.items() if name != "step"]
    assert log.kind_bytes["optimizer state"] == sum(t.nbytes for t in moments)  # its step counters: torch.tensor()


def test_an_oom_step_keeps_its_timeline_to_the_limit(tmp_path):
    """A step over --memory-limit is an oom row whose timeline ends at the op that crossed it."""
    spec = _spec("bp", 256, memory_limit="3MB")
    row = point.measure_point(spec, tmp_path)
    assert row.status == "oom"
    timeline = load_timeline(row.timeline_file)
    assert timeline.status == "oom" and timeline.peak.bytes == row.peak_allocated_bytes > 3_000_000


def test_recording_changes_no_gradient():
    """A recorded streambp step (every seam listening, bf16 with its fp32 sums) gives bitwise the
    loss and gradients of an unrecorded one."""
    model = tiny_model("tiny/qwen3", torch.bfloat16)
    batch = padded_batch(model, batch_size=2, seq_len=40, lengths=[40, 31])
    step = SimpleNamespace(model=model, optimizer=None, trainable=list(model.parameters()), method="streambp")

    def run():
        model.zero_grad(set_to_none=True)
        loss = streamed(model, batch.input_ids, batch.labels, chunk_size=16, logits_chunk_size=8,
                               checkpoints="cpu+recompute:2")  # fmt: skip
        return loss, {name: p.grad.clone() for name, p in model.named_parameters()}

    plain_loss, plain = run()
    recorder = TrackedTimeline({"other": 0})
    with marking(recorder, step), recorder:
        loss, recorded = run()
    assert torch.equal(loss, plain_loss) and all(torch.equal(recorded[name], plain[name]) for name in plain)
    assert recorder.peak_kinds["checkpoints"] > 0 and recorder.peak_kinds["gradients"] > 0


def test_the_core_seam_costs_nothing_without_a_listener():
    """Without a listener, `allocating` hands back one shared no-op context and `note` returns;
    with one, they reach it."""
    assert memory_kinds.allocating(None, "K/V buffers") is memory_kinds.allocating(None, "logits")
    memory_kinds.note(None, "checkpoints", torch.ones(1))
    tracker = LiveTensorTracker()
    with tracker:
        with memory_kinds.allocating(tracker, memory_kinds.KV_BUFFERS):
            kept = torch.ones(256)
        other = torch.ones(128)
        memory_kinds.note(tracker, memory_kinds.CHECKPOINTS, other)
    assert tracker.kind_bytes["K/V buffers"] == kept.nbytes and tracker.kind_bytes["checkpoints"] == other.nbytes
    assert set(memory_kinds.KINDS) <= set(KINDS)


def test_the_tracker_counts_bytes_by_kind():
    """Storages count under the kind they were made in; a note moves one; the peak keeps the kinds of
    its moment; a note about a tensor made before the tracker changes nothing."""
    before = torch.ones(1000)
    tracker = LiveTensorTracker()
    with tracker:
        previous = tracker.begin("logits")
        a = torch.ones(100)  # 400 B of logits
        tracker.end(previous)
        b = torch.ones(50)  # 200 B of intermediates
        tracker.note("checkpoints", (b, before))
        del a
        c = torch.ones(10)
    assert dict(tracker.kind_bytes) == {"logits": 0, "intermediates": 40, "checkpoints": 200}
    assert tracker.peak_bytes == 600 and tracker.peak_kinds == {"logits": 400, "intermediates": 200}
    del b, c


def test_the_log_keeps_its_peak_and_stays_small():
    """A long step's log keeps at most MAX_SAMPLES samples, among them its peak, first and last; its
    spans start where its phases changed."""
    log = TimelineLog()
    for at in range(100_000):
        log.phase = "forward" if at < 60_000 else "backward layer 0"
        log.add(at, (at * 7919) % 1000 + (5000 if at == 61_234 else 0))
    timeline = log.timeline(kinds={"intermediates": 5000 + (61_234 * 7919) % 1000}, point={}, source="measured",
                            memory_source="test", axis="op", baseline_bytes=0)  # fmt: skip
    samples = timeline.samples
    assert len(samples["at"]) <= MAX_SAMPLES and samples["at"][0] == 0 and samples["at"][-1] == 99_999
    assert timeline.peak.at == 61_234 and max(samples["bytes"]) == timeline.peak.bytes
    assert timeline.spans == [[0, 0], [60_000, 1]] and timeline.peak.phase == "backward layer 0"
    assert timeline.span_bounds() == [(0, 60_000, "forward"), (60_000, 99_999, "backward layer 0")]


def test_streambp_phases_are_named_with_their_layer():
    """A StreamBP phase inside a layer's backward names the layer counted down from the deepest the
    forward labels saw, not the hooks' stale label; groups drop the layer."""
    phases = StepPhases()
    for index in range(3):
        phases.set_label(f"forward layer {index}")
    phases.set_stage("checkpoint pass")
    assert phases.name == "checkpoint pass, layer 2"
    phases.set_stage(None)
    phases.set_label("head chunk 0")
    phases.set_stage("K/V capture")
    assert phases.name == "K/V capture, layer 2"
    phases.set_stage("chunk backward")
    phases.set_stage("K/V capture")
    assert phases.name == "K/V capture, layer 1" and phase_group(phases.name) == "K/V capture"
    phases.set_stage(None)
    phases.set_label("head")
    assert phases.kind == "logits" and phase_group("head chunk 12") == "head"


# --- the GPU path, through a stand-in for torch.cuda.memory's history ---------------------------


def _cuda_stubs(monkeypatch, history: RecordingMemoryHistory) -> None:
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: history.allocated())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: history.peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: history.peak)
    monkeypatch.setattr(point, "nvml_handle", lambda device: None)


def _cpu_step(spec):
    model, batch = build_model_and_batch(spec)
    return training_step(spec, model, batch)


@pytest.mark.parametrize(("method", "values"), [("streambp", {**LAYER_PEAK, "checkpoints": "cpu"}), ("ckpt", {})])
def test_the_cuda_memory_step_records_the_history_as_the_tracker_counts(monkeypatch, tmp_path, method, values):
    """The worker's CUDA memory step with --timeline (torch.cuda.memory against a stand-in that
    writes the allocator's trace for CPU tensors) starts the history, marks each entry with its
    phase and kind, pickles the snapshot beside the timeline and stops; replayed, the trace gives
    the peak, its phase and its kinds that the CPU tracker counts at 512-byte rounding."""
    spec = _spec(method, **values)
    step = _cpu_step(spec)
    step.prepare()
    tracked = TrackedTimeline(resident_kinds(step, 512), granularity_bytes=512)
    with marking(tracked, step), tracked:
        step.run()
    expected = tracked.timeline(point={})

    step = _cpu_step(spec)
    history = RecordingMemoryHistory(baseline_bytes=sum(resident_kinds(step, 512).values()))
    _cuda_stubs(monkeypatch, history)
    row = ResultRow()
    point._measure_cuda(spec, step, row, torch.device("cuda:0"), lambda name: step.prepare(), tmp_path, history)

    timeline = load_timeline(row.timeline_file)
    assert timeline.memory_source == "torch.cuda" and timeline.axis == "us"
    assert timeline.peak.bytes == expected.peak.bytes and timeline.peak.kinds == expected.peak.kinds
    assert timeline.peak.phase == expected.peak.phase
    assert set(timeline.phases) <= set(expected.phases)  # the replay sees the phases that allocate
    assert timeline.allocator_peak_bytes == history.peak == row.peak_allocated_bytes
    assert history.calls[0][0] == "start" and history.calls[-1] == ("stop",)
    assert history.calls[-3:-1] == [("set_metadata", ""), ("snapshot",)]
    marks = [text for name, *text in history.calls if name == "set_metadata" for text in text if text]
    assert all(text.startswith("sbp\t") for text in marks) and len({text.split("\t")[1] for text in marks}) == len(
        marks
    )
    with (tmp_path / timeline.snapshot).open("rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["device_traces"][0] and {"action", "addr", "size", "time_us"} <= set(
        snapshot["device_traces"][0][1]
    )


def test_a_full_history_is_anchored_at_the_end(monkeypatch, tmp_path):
    """When the allocator's ring buffer dropped the first entries, the replay starts from the
    allocated bytes after the step instead and says the timeline starts late."""
    spec = _spec("bp")
    step = _cpu_step(spec)
    history = RecordingMemoryHistory(baseline_bytes=sum(resident_kinds(step, 512).values()))
    _cuda_stubs(monkeypatch, history)
    monkeypatch.setattr(point, "CudaTimeline", _small_history(200))
    row = ResultRow()
    point._measure_cuda(spec, step, row, torch.device("cuda:0"), lambda name: step.prepare(), tmp_path, history)
    timeline = load_timeline(row.timeline_file)
    assert timeline.samples["bytes"][-1] == history.at_snapshot and any("was full" in n for n in timeline.notes)
    assert sum(timeline.peak.kinds.values()) == timeline.peak.bytes


def test_a_failed_snapshot_costs_the_timeline_not_the_row(monkeypatch, tmp_path):
    """A snapshot that fails after the step leaves the row measured, with no timeline named and the
    history stopped."""
    spec = _spec("bp")
    step = _cpu_step(spec)
    history = RecordingMemoryHistory(baseline_bytes=sum(resident_kinds(step, 512).values()))
    _cuda_stubs(monkeypatch, history)

    def broken():
        raise RuntimeError("snapshot failed")

    monkeypatch.setattr(history, "snapshot", broken)
    row = ResultRow()
    point._measure_cuda(spec, step, row, torch.device("cuda:0"), lambda name: step.prepare(), tmp_path, history)
    assert row.loss is not None and row.peak_allocated_bytes == history.peak and row.timeline_file == ""
    assert history.calls[-1] == ("stop",)


class DeviceThreadHistory(RecordingMemoryHistory):
    """The stand-in with torch's per-thread metadata: on a GPU autograd runs a backward on its
    device thread unless multithreaded backward is off, so an entry made while a backward node runs
    carries that thread's metadata, set only by a hook running there."""

    def __init__(self, baseline_bytes: int = 0):
        super().__init__(baseline_bytes)
        self.labels = {"step": "", "device": ""}  # each thread's metadata

    def _thread(self) -> str:
        in_backward = torch._C._current_autograd_node() is not None
        return "device" if in_backward and torch._C._is_multithreading_enabled() else "step"

    def set_metadata(self, text: str) -> None:
        self.calls.append(("set_metadata", text))
        self.labels[self._thread()] = text

    def _entry(self, action: str, address: int, nbytes: int) -> None:
        self.metadata = self.labels[self._thread()]
        super()._entry(action, address, nbytes)


def _tracked_peak(spec):
    """The CPU tracker's peak of the point's step at 512-byte rounding."""
    step = _cpu_step(spec)
    step.prepare()
    tracked = TrackedTimeline(resident_kinds(step, 512), granularity_bytes=512)
    with marking(tracked, step), tracked:
        step.run()
    return tracked.timeline(point={}).peak


def _recorded(monkeypatch, tmp_path, spec):
    """The worker's CUDA memory step recorded through DeviceThreadHistory: (history, timeline)."""
    step = _cpu_step(spec)
    history = DeviceThreadHistory(baseline_bytes=sum(resident_kinds(step, 512).values()))
    _cuda_stubs(monkeypatch, history)
    row = ResultRow()
    point._measure_cuda(spec, step, row, torch.device("cuda:0"), lambda name: step.prepare(), tmp_path, history)
    return history, load_timeline(row.timeline_file)


def _step_allocations(history) -> list[dict]:
    """The alloc entries from the recorder's first mark on."""
    entries = history.entries
    first = next(i for i, e in enumerate(entries) if e.get("user_metadata", "").startswith("sbp\t"))
    return [e for e in entries[first:] if e["action"] == "alloc"]


@pytest.mark.parametrize(("method", "values"), [("streambp", {**LAYER_PEAK, "checkpoints": "cpu"}), ("bp", {})])
def test_the_recorded_backward_runs_on_the_steps_thread(monkeypatch, tmp_path, method, values):
    """The allocator's metadata is per thread and a GPU's backward runs on autograd's device
    thread: the recorder runs the step's backward on the step's thread, so every allocation carries
    a mark and the replay gives the tracker's peak, its phase and its kinds; multithreaded
    backward is back on after."""
    spec = _spec(method, **values)
    expected = _tracked_peak(spec)
    history, timeline = _recorded(monkeypatch, tmp_path, spec)
    assert all(e["user_metadata"].startswith("sbp\t") for e in _step_allocations(history))
    assert timeline.peak.bytes == expected.bytes and timeline.peak.kinds == expected.kinds
    assert timeline.peak.phase == expected.phase
    assert torch._C._is_multithreading_enabled()


@pytest.mark.parametrize(("method", "values"), [("streambp", {**LAYER_PEAK, "checkpoints": "cpu"}), ("bp", {})])
def test_the_replay_counts_a_backward_without_the_steps_marks(monkeypatch, tmp_path, method, values):
    """Where the backward stays on autograd's device thread, its allocations carry no mark or an
    old one; the replay still counts every byte, each of the latest mark's kind: the tracker's
    peak and its kinds."""
    spec = _spec(method, **values)
    expected = _tracked_peak(spec)
    monkeypatch.setattr(torch.autograd, "set_multithreading_enabled", lambda mode: nullcontext())
    history, timeline = _recorded(monkeypatch, tmp_path, spec)
    assert any(not e["user_metadata"] for e in _step_allocations(history))  # the case under test
    assert timeline.peak.bytes == expected.bytes and timeline.peak.kinds == expected.kinds


def test_the_replay_gives_unmarked_and_stale_entries_the_latest_mark():
    """An entry with no mark, another tool's metadata, or an older mark than one already seen (a
    thread whose metadata was set earlier) counts under the latest mark in the trace; entries
    before the first mark are not the step's."""
    from sbpbench.measure.timeline.cuda import timeline_from_trace

    def entry(action, address, size, label):
        return {"action": action, "addr": address, "size": size, "stream": 0, "user_metadata": label}

    forward, head, layer = (
        "sbp\t1\tintermediates\tforward",
        "sbp\t2\tlogits\thead",
        "sbp\t3\tintermediates\tbackward layer 0",
    )
    trace = [
        entry("alloc", 1, 8, ""),  # before the recorder's first mark
        entry("alloc", 10, 1024, forward),
        entry("alloc", 20, 4096, head),
        entry("alloc", 30, 2048, ""),  # the head's backward, on the device thread: logits
        entry("free_requested", 20, 4096, ""),
        entry("alloc", 40, 1000, "another tool's label"),  # logits, 1024 B as allocated
        entry("alloc", 50, 512, layer),  # a hook set the mark on the device thread
        entry("alloc", 60, 8192, head),  # the step's thread, its metadata older: intermediates
        entry("free_requested", 60, 8192, head),
    ]
    for time_us, each in enumerate(trace):
        each["time_us"] = time_us
    host = {"at": [], "pinned_bytes": [], "rss_bytes": []}
    timeline = timeline_from_trace(trace, 5120, {"weights": 4096}, [], host, point={})
    peak = timeline.peak
    assert peak.bytes == 5120 + 1024 + 2048 + 1024 + 512 + 8192 and peak.phase == "backward layer 0"
    assert {k: v for k, v in peak.kinds.items() if v} == {
        "weights": 4096, "logits": 2048 + 1024, "intermediates": 1024 + 512 + 8192, "other": 1024,
    }  # fmt: skip
    assert timeline.samples["bytes"][-1] == 5120 + 1024 + 2048 + 1024 + 512


def _small_history(entries: int):
    from sbpbench.measure.timeline.cuda import CudaTimeline

    def make(device, kinds, *, calls):
        return CudaTimeline(device, kinds, calls=calls, max_entries=entries)

    return make


def test_a_timeline_file_is_refused_when_not_one(tmp_path):
    """Reading a file that is not a timeline of this version is a one-line error saying what to do."""
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="sbp run --timeline"):
        load_timeline(path)


# --- files beside the CSV, the figure, the command ------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Measured rows with their timelines and predictions, in a runs.csv as `sbp run` leaves them."""
    from sbpbench.records import upsert_rows
    from sbpbench.runner import timelines

    out = tmp_path_factory.mktemp("saved") / "runs.csv"
    for method in ("bp", "streambp"):
        spec = _spec(method, 64)
        row = point.measure_point(spec, timelines.timeline_dir(out))
        row.device_name = "test CPU"
        timelines.finish(row, out)
        timelines.predict_beside(spec, row, out)
        upsert_rows(out, [row])
    return out


def test_rows_name_their_timelines_beside_the_csv(saved):
    """A row's timeline_file is relative to its CSV's folder, under timelines/, with the prediction
    beside it; the file repeats the row's settings, provenance included."""
    from sbpbench.records import read_rows
    from sbpbench.runner.timelines import measured_and_predicted

    out = saved
    for row in read_rows(out):
        assert row["timeline_file"].startswith("timelines/") and row["timeline_file"].endswith(".measured.json")
        measured, predicted = measured_and_predicted(row, out.parent)
        assert measured.point["device_name"] == "test CPU" and measured.point["method"] == row["method"]
        assert predicted is not None and predicted.point["device_name"] == "simulated CPU"


def test_a_failed_prediction_leaves_the_measurement_alone(saved, monkeypatch, tmp_path):
    """Where the estimator cannot walk a point, the reason comes back, the measured timeline stays
    and no earlier prediction is left beside it to be taken for this one's."""
    import shutil

    from sbpbench.records import read_rows
    from sbpbench.records.store import decode_row
    from sbpbench.runner import timelines
    from sbpbench.simulate import timeline as simulated

    def fails(spec, target):
        raise ValueError("a kernel the estimator does not model")

    monkeypatch.setattr(simulated, "predicted_timeline", fails)
    out = shutil.copytree(saved.parent, tmp_path / "copy") / saved.name
    row = decode_row(read_rows(out)[0])
    reason = timelines.predict_beside(_spec(row.method, 64), row, out)
    assert reason == "ValueError: a kernel the estimator does not model"
    measured, predicted = timelines.measured_and_predicted(row, out.parent)
    assert measured.point["method"] == row.method and predicted is None


def test_plot_draws_one_timeline_figure_per_point(saved, tmp_path):
    """`sbp plot`'s timeline figure: one per point (the methods as panels), PNG and SVG, the same
    SVG when drawn again."""
    from sbpbench.plot import memory_timelines
    from sbpbench.records import load_results
    from sbpbench.records.select import complete_columns

    table = complete_columns(load_results(saved))
    first = memory_timelines(table, tmp_path / "plots", formats=("png", "svg"))
    assert [p.suffix for p in first] == [".png", ".svg"] and first[0].name.startswith("memory_timeline__tiny-qwen3")
    svg = first[1].read_text()
    assert "T=64" in svg and "tiny/qwen3" in svg and "CPU, live-tensor tracker" in svg and "StreamBP" in svg
    second = memory_timelines(table, tmp_path / "again", formats=("png", "svg"))
    assert second[1].read_text() == svg
    assert memory_timelines(table[table["method"] == "none"], tmp_path / "none") == []


def test_timeline_refuses_several_ranks_before_any_work(tmp_path):
    """`sbp run --timeline --nproc 2`: a one-line error naming --nproc, nothing written."""
    from typer.testing import CliRunner

    from sbpbench.cli import app

    out = tmp_path / "runs.csv"
    args = ["run", "--device", "cpu", "--model", "tiny/qwen3", "--seq", "16", "--nproc", "2", "--timeline"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 2 and "--nproc" in result.output and "timeline" in result.output
    assert not out.exists()


@pytest.mark.slow
def test_sbp_run_timeline_then_sbp_plot(tmp_path):
    """The command line end to end: `sbp run --timeline` prints each method's peak by kind beside the
    prediction and saves both timelines; `sbp plot` draws their figure."""
    import subprocess
    import sys
    from pathlib import Path

    from ..conftest import cli_env

    sbp = str(Path(sys.executable).parent / "sbp")
    out = tmp_path / "runs.csv"
    args = ["--device", "cpu", "--model", "tiny/qwen3", "--seq", "64", "--repeats", "0", "--method", "bp", "streambp"]
    command = [sbp, "run", *args, "--timeline", "--out", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=cli_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("The peak by kind") == 2 and "peak phase" in done.stdout and "1.000" in done.stdout
    assert len(list((tmp_path / "timelines").glob("*.measured.json"))) == 2
    assert len(list((tmp_path / "timelines").glob("*.predicted.json"))) == 2
    command = [sbp, "plot", str(tmp_path), "--out", str(tmp_path / "plots")]
    plotted = subprocess.run(command, check=False, capture_output=True, text=True, env=cli_env(), timeout=600)
    assert plotted.returncode == 0, plotted.stderr
    assert any(name.startswith("memory_timeline__") for name in plotted.stdout.split("/"))
