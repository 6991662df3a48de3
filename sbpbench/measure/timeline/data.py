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
(the trainable parameters' .grad, the optimizer's moments); checkpoints, K/V buffers, dK/dV sums, carried states,
gradient sums and logits as StreamBP makes them (core/memory_kinds.py) or a checkpointed model
keeps them; logits for whatever a model's head makes; intermediates for the rest the step's ops
made (a chunk's intermediates, saved activations, workspaces); other for the batch and what the
allocator adds (block rounding).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT, VERSION = "sbpbench memory timeline", 1
WEIGHTS, GRADIENTS, OPTIMIZER_STATE = "weights", "gradients", "optimizer state"
CHECKPOINTS, KV_BUFFERS, KV_GRAD_SUMS = "checkpoints", "K/V buffers", "dK/dV sums"
LOGITS, INTERMEDIATES, OTHER = "logits", "intermediates", "other"
CARRIED_STATES = "carried states"  # a state-carrying layer's start states per chunk
KINDS = (
    WEIGHTS, GRADIENTS, OPTIMIZER_STATE, CHECKPOINTS, KV_BUFFERS, KV_GRAD_SUMS, CARRIED_STATES, LOGITS, INTERMEDIATES,
    OTHER,
)  # fmt: skip
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
