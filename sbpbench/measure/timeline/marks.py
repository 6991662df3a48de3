"""Where a step is, as every timeline recorder names it: the phase (the model's labels and StreamBP's
own), the kind its allocations get, and the host sampled at each change."""

from __future__ import annotations

import re

from .data import INTERMEDIATES, LOGITS, OPTIMIZER_STATE

# StreamBP's phases (core/phases.py PHASES) that run inside one layer's backward
_LAYER_STAGES = ("K/V capture", "chunk forward", "chunk backward")
_LAYER = re.compile(r"layer (\d+)$")


class StepPhases:
    """Where a step is, named from two sources: the label hooks on the model's parts give (simulate's
    PhaseLabels: "forward layer 3", "head", "backward layer 3", "optimizer") and StreamBP's phase
    (core/phases.py: "checkpoint pass", "K/V capture", ...), which its PhaseTimer tells.

    A StreamBP phase inside a layer's backward is named with its layer ("chunk backward, layer 3"),
    counted down from the deepest layer the checkpoint pass called: its K/V capture runs no hooked
    module (core/architecture/key_values.py), so the hooks' label there still names the layer before."""

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
