"""One step's memory over time: the file `sbp run --timeline` writes beside a row and `sbp plot` draws.

A timeline is one JSON object (`Timeline.to_dict`, FORMAT and VERSION in it):

    source, memory_source   measured (tensor-tracker | torch.cuda) or simulated (fake-tensor)
    point                   the point's settings, as its row names them (model, method, seq_len, ...)
    axis                    what `at` counts: "op" (ops since the step began: the CPU tracker and the
                            estimator) or "us" (microseconds since the step began: a GPU's memory history)
    end                     the step's last `at`
    baseline_bytes          allocated before the step (weights, gradients, optimizer state, batch)
    peak                    {bytes, at, phase, kinds}: the step's peak, where it was, and its bytes by
                            kind (KINDS), which sum to it
    samples                 {at, bytes, phase}: allocated bytes over the step, at most MAX_SAMPLES
                            points (each stretch keeps its lowest and highest, so the peak is one)
    phases, spans           phase names, and [start at, index into phases] each time the phase changed
    host                    {at, pinned_bytes, rss_bytes} at each phase change: the host copies a
                            placement keeps (pinned on CUDA) and the process's resident set
    capacity_bytes          the cap that applied (a memory limit, or a GPU's total), if any
    allocator_peak_bytes    CUDA: max_memory_allocated, which counts whole allocator blocks
    snapshot                CUDA: the raw memory snapshot's file beside it (pytorch.org/memory_viz)
    status                  ok, or oom: the step stopped there (the timeline is what ran)

Kinds: what the bytes at the peak are for. Weights, gradients and optimizer state by identity
(the trainable parameters' .grad, the optimizer's moments); checkpoints, K/V buffers, dK/dV sums,
gradient sums and logits as StreamBP makes them (core/memory_kinds.py) or a checkpointed model
keeps them; logits for whatever a model's head makes; intermediates for the rest the step's ops
made (a chunk's intermediates, saved activations, workspaces); other for the batch and what the
allocator adds (block rounding).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT, VERSION = "sbpbench memory timeline", 1
WEIGHTS, GRADIENTS, OPTIMIZER_STATE = "weights", "gradients", "optimizer state"
CHECKPOINTS, KV_BUFFERS, KV_GRAD_SUMS = "checkpoints", "K/V buffers", "dK/dV sums"
LOGITS, INTERMEDIATES, OTHER = "logits", "intermediates", "other"
KINDS = (WEIGHTS, GRADIENTS, OPTIMIZER_STATE, CHECKPOINTS, KV_BUFFERS, KV_GRAD_SUMS, LOGITS, INTERMEDIATES, OTHER)
MAX_SAMPLES = 4000  # two per stretch: 2000 stretches draw a step's curve finer than a figure's pixels


@dataclass
class Peak:
    bytes: int
    at: int
    phase: str
    kinds: dict[str, int]  # KINDS -> bytes, summing to `bytes`


@dataclass(kw_only=True)
class Timeline:
    source: str  # measured | simulated
    memory_source: str  # tensor-tracker | torch.cuda | fake-tensor
    point: dict
    axis: str  # op | us
    end: int
    baseline_bytes: int
    peak: Peak
    samples: dict[str, list]  # at, bytes, phase (index into phases)
    phases: list[str]
    spans: list[list[int]]  # [start at, phase index]
    host: dict[str, list] | None = None  # at, pinned_bytes, rss_bytes
    capacity_bytes: int | None = None
    allocator_peak_bytes: int | None = None
    snapshot: str | None = None
    status: str = "ok"
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Timeline:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(
                f"not a memory timeline of version {VERSION} (format {data.get('format')!r}, version "
                f"{data.get('version')!r}): write it again with `sbp run --timeline`"
            )
        values = {k: v for k, v in data.items() if k not in ("format", "version")}
        values["peak"] = Peak(**values["peak"])
        return cls(**values)

    def save(self, path: str | Path) -> Path:
        """Write atomically (a temporary file renamed), so a reader never sees half a timeline."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), separators=(",", ":")))
        os.replace(tmp, path)
        return path

    def phase_at(self, index: int) -> str:
        return self.phases[index]

    def span_bounds(self) -> list[tuple[int, int, str]]:
        """(start, end, phase) of each stretch of one phase, in order; the last ends at `end`."""
        starts = [at for at, _ in self.spans] + [self.end]
        return [(at, starts[i + 1], self.phases[p]) for i, (at, p) in enumerate(self.spans)]


def load_timeline(path: str | Path) -> Timeline:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the memory timeline {path}: {error}") from None
    return Timeline.from_dict(data)


def breakdown(kinds: dict[str, int]) -> dict[str, int]:
    """`kinds` in KINDS' order, every kind present (0 where none), unknown names refused."""
    unknown = set(kinds) - set(KINDS)
    assert not unknown, f"not a memory kind: {sorted(unknown)}"
    return {kind: int(kinds.get(kind, 0)) for kind in KINDS}


class TimelineLog:
    """The samples of one step as they come: `log.phase = name` when the phase changes, `add(at,
    nbytes)` after each op or event, `host_sample(...)` at phase changes; `timeline(...)` at the end.

    Memory stays bounded: samples fall into stretches of `width` consecutive points, each keeping its
    lowest and its highest; past max_samples / 2 stretches, neighbours merge and the width doubles."""

    def __init__(self, max_samples: int = MAX_SAMPLES):
        assert max_samples >= 4
        self.max_stretches = (max_samples - 2) // 2  # and the first and last points
        self.width = 1
        self._stretches: list[list] = []  # [count, (low at, bytes, phase), (high at, bytes, phase)]
        self.phases: list[str] = []
        self._index: dict[str, int] = {}
        self.spans: list[list[int]] = []
        self._phase = -1
        self._changed = True
        self.last_at = 0
        self._ends: list[tuple[int, int, int]] = []  # the first point and the latest
        self.peak: tuple[int, int, int] | None = None  # (bytes, at, phase index)
        self.host: dict[str, list] = {"at": [], "pinned_bytes": [], "rss_bytes": []}

    @property
    def phase(self) -> str:
        return self.phases[self._phase] if self._phase >= 0 else ""

    @phase.setter
    def phase(self, name: str) -> None:
        index = self._index.get(name)
        if index is None:
            index = self._index[name] = len(self.phases)
            self.phases.append(name)
        if index != self._phase:
            self._phase = index
            self._changed = True

    def add(self, at: int, nbytes: int) -> None:
        phase = self._phase
        if self._changed:  # the span starts at the first point in its phase
            if self.spans and self.spans[-1][0] == at:
                self.spans[-1][1] = phase
            else:
                self.spans.append([at, phase])
            self._changed = False
        self.last_at = at
        point = (at, nbytes, phase)
        self._ends[1:] = [point]
        if self.peak is None or nbytes > self.peak[0]:
            self.peak = (nbytes, at, phase)
        stretches = self._stretches
        if stretches and stretches[-1][0] < self.width:
            last = stretches[-1]
            last[0] += 1
            if nbytes < last[1][1]:
                last[1] = point
            if nbytes > last[2][1]:
                last[2] = point
            return
        stretches.append([1, point, point])
        if len(stretches) > self.max_stretches:
            self._merge()

    def _merge(self) -> None:
        merged = []
        for i in range(0, len(self._stretches), 2):
            pair = self._stretches[i : i + 2]
            low = min((s[1] for s in pair), key=lambda p: p[1])
            high = max((s[2] for s in pair), key=lambda p: p[1])  # max() keeps the first of equals
            merged.append([sum(s[0] for s in pair), low, high])
        self._stretches = merged
        self.width *= 2

    def host_sample(self, at: int, pinned_bytes: int | None, rss_bytes: int | None) -> None:
        self.host["at"].append(at)
        self.host["pinned_bytes"].append(pinned_bytes)
        self.host["rss_bytes"].append(rss_bytes)

    def samples(self, offset: int = 0) -> dict[str, list]:
        """Each stretch's lowest and highest point, and the first and last point of all, in order."""
        points = sorted({*self._ends, *(p for _, low, high in self._stretches for p in (low, high))})
        return {"at": [p[0] for p in points], "bytes": [p[1] + offset for p in points], "phase": [p[2] for p in points]}

    def timeline(self, *, kinds: dict[str, int], offset: int = 0, **fields) -> Timeline:
        """The Timeline of what was logged, `offset` added to every logged byte count (a baseline
        the log did not count); `kinds`: the bytes by kind at the peak, offset included."""
        nbytes, at, phase = self.peak if self.peak is not None else (0, 0, 0)
        nbytes += offset
        peak = Peak(bytes=nbytes, at=at, phase=self.phases[phase] if self.phases else "", kinds=breakdown(kinds))
        assert sum(peak.kinds.values()) == nbytes, f"the kinds sum to {sum(peak.kinds.values()):,} B, not {nbytes:,} B"
        host = self.host if self.host["at"] else None
        fields.setdefault("end", self.last_at)
        return Timeline(
            peak=peak, samples=self.samples(offset), phases=self.phases, spans=self.spans, host=host, **fields
        )


# StreamBP's phases (core/phases.py PHASES) that run inside one layer's backward
_LAYER_STAGES = ("K/V capture", "chunk forward", "chunk backward")
_LAYER = re.compile(r"layer (\d+)$")


class StepPhases:
    """Where a step is, named from two sources: the label hooks on the model's parts give (simulate's
    PhaseLabels: "forward layer 3", "head", "backward layer 3", "optimizer") and StreamBP's phase
    (core/phases.py: "checkpoint pass", "K/V capture", ...), which its PhaseTimer tells.

    A StreamBP phase inside a layer's backward is named with its layer ("chunk backward, layer 3"),
    counted down from the deepest layer the checkpoint pass called: its K/V capture runs no hooked
    module (kv_capture.py), so the hooks' label there still names the layer before."""

    def __init__(self, label: str = "forward"):
        self.label, self.stage = label, None
        self._layers = 0  # decoder layers seen in forward labels
        self._backward: int | None = None  # the layer whose backward StreamBP runs

    def set_label(self, label: str) -> None:
        self.label = label
        found = _LAYER.search(label)
        if found and label.startswith("forward"):
            self._layers = max(self._layers, int(found.group(1)) + 1)

    def set_stage(self, stage: str | None) -> None:
        if stage == "K/V capture" and stage != self.stage:
            self._backward = (self._layers if self._backward is None else self._backward) - 1
        self.stage = stage

    @property
    def name(self) -> str:
        stage, label = self.stage, self.label
        if stage is None:
            return label
        if stage == "head":
            return label if label.startswith("head") else stage
        if stage in _LAYER_STAGES and self._backward is not None:
            return f"{stage}, layer {self._backward}"
        found = _LAYER.search(label)
        if stage in ("checkpoint pass", "rebuild") and found:
            return f"{stage}, layer {found.group(1)}"
        return stage

    @property
    def kind(self) -> str:
        """What the phase's allocations are unless told otherwise: a model's own head (not
        StreamBP's chunked one, which says so itself) makes logits; the optimizer its state."""
        if self.label == "head":
            return LOGITS
        return OPTIMIZER_STATE if self.label == "optimizer" else INTERMEDIATES


def phase_group(name: str) -> str:
    """A phase without its layer or chunk ("chunk backward, layer 3" -> "chunk backward"): what a
    figure shades alike."""
    return re.sub(r"(,)? (layer|chunk) \d+$", "", name)


class PhaseMarks:
    """What every timeline recorder does when the step moves on: it names the phase (StepPhases) and
    samples the host (`host_probe`: () -> (pinned bytes, RSS bytes), set by whoever knows the step's
    checkpoint store). A recorder calls `_start_marks()` first and gives `_mark(name, kind)` (the
    phase and the kind its allocations get), `_now()` and `_host_sample(at, pinned, rss)`."""

    def _start_marks(self) -> None:
        self.steps = StepPhases()
        self.host_probe = None

    @property
    def phase(self) -> str:
        return self.steps.name

    @phase.setter
    def phase(self, label: str) -> None:  # the hooks' label (PhaseLabels sets `counter.phase`)
        self.steps.set_label(label)
        self._moved()

    def on_stage(self, stage: str | None) -> None:
        """StreamBP's PhaseTimer: the phase the step entered, or the one it is back in (None: none)."""
        self.steps.set_stage(stage)
        self._moved()

    def _moved(self) -> None:
        self._mark(self.steps.name, self.steps.kind)
        if self.host_probe is not None:
            self._host_sample(self._now(), *self.host_probe())


@dataclass(frozen=True)
class BucketAccuracy:
    kind: str  # a KINDS name, or "total"
    measured_bytes: int
    predicted_bytes: int | None

    @property
    def ratio(self) -> float | None:
        """predicted / measured (1.0: exact; None where either is missing or nothing was measured)."""
        if self.predicted_bytes is None or not self.measured_bytes:
            return None
        return self.predicted_bytes / self.measured_bytes


def peak_accuracy(measured: Timeline, predicted: Timeline | None) -> list[BucketAccuracy]:
    """The peak's bytes by kind, measured beside predicted, every kind either has, then the total
    (torchtitan's estimator reports its accuracy so: a ratio per category and in total)."""
    theirs = predicted.peak.kinds if predicted is not None else {}
    rows = [
        BucketAccuracy(kind, measured.peak.kinds.get(kind, 0), theirs.get(kind, 0) if predicted is not None else None)
        for kind in KINDS
        if measured.peak.kinds.get(kind, 0) or theirs.get(kind, 0)
    ]
    total = predicted.peak.bytes if predicted is not None else None
    return rows + [BucketAccuracy("total", measured.peak.bytes, total)]
