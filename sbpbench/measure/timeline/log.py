"""A step's memory samples as they come, kept bounded, and the Timeline they make (data.py)."""

from __future__ import annotations

from .data import MAX_SAMPLES, Peak, Timeline, breakdown


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
