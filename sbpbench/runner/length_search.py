"""The longest trainable sequence: exponential growth, then bisection, over a monotone probe.

A probe answers "does one step at seq_len T fit?" (True: ok, False: out of memory). Memory grows
with T, so the answers are monotone, and every probe already answered (this search's, or cached
from an interrupted one) settles every T on its side: an ok at T proves every shorter length ok,
an OOM every longer one. The search asks the probe only what nothing cached settles, so a
resumed search replays the same steps and probes only what is still open.

Growth doubles T from `start` until the first OOM (or `ceiling`); bisection then halves the
bracket [longest ok, shortest OOM] until it is no wider than the resolution.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..config.maxlen import MIN_SEQ_LEN, Resolution


@dataclass
class SearchResult:
    max_ok: int | None  # the longest length that fit (None: not even the shortest tried)
    min_oom: int | None  # the shortest that did not (None: everything up to the ceiling fit)
    probes: list[tuple[int, bool]] = field(default_factory=list)  # every answer used, in order
    num_run: int = 0  # answers the probe computed (the rest came from the cache)


class _Known:
    """Probe answers, with monotonicity: the longest ok and the shortest OOM seen so far."""

    def __init__(self, cached: Mapping[int, bool]):
        self.max_ok = max((t for t, fits in cached.items() if fits), default=None)
        self.min_oom = min((t for t, fits in cached.items() if not fits), default=None)
        if self.max_ok is not None and self.min_oom is not None and self.max_ok >= self.min_oom:
            raise ValueError(
                f"cached probes are not monotone: T={self.max_ok} fit but T={self.min_oom} ran out of memory; "
                "remove the stale rows or rerun with --no-resume"
            )

    def settled(self, seq_len: int) -> bool | None:
        if self.max_ok is not None and seq_len <= self.max_ok:
            return True
        if self.min_oom is not None and seq_len >= self.min_oom:
            return False
        return None

    def add(self, seq_len: int, fits: bool) -> None:
        if fits:
            self.max_ok = seq_len if self.max_ok is None else max(self.max_ok, seq_len)
        else:
            self.min_oom = seq_len if self.min_oom is None else min(self.min_oom, seq_len)


def search_max_len(
    probe: Callable[[int], bool],
    *,
    start: int,
    ceiling: int,
    resolution: Resolution,
    cached: Mapping[int, bool] | None = None,
    multiple_of: int = 1,
) -> SearchResult:
    """The longest T <= ceiling for which probe(T) is True, to `resolution`.

    Probed lengths are multiples of `multiple_of` (the CUDA kernels' favourite, e.g. 8), except
    `ceiling` itself. The probe may raise (an error that is not an OOM): the search stops there,
    having kept every answer so far in `cached` order for a resume."""
    if not MIN_SEQ_LEN <= start <= ceiling:
        raise ValueError(f"need {MIN_SEQ_LEN} <= start <= ceiling, got start {start}, ceiling {ceiling}")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    known = _Known(cached or {})
    result = SearchResult(max_ok=None, min_oom=None)

    def ask(seq_len: int) -> bool:
        answer = known.settled(seq_len)
        if answer is None:
            answer = bool(probe(seq_len))
            result.num_run += 1
            known.add(seq_len, answer)
        result.probes.append((seq_len, answer))
        return answer

    # growth: start, 2*start, ... until an OOM or the ceiling; if start itself does not fit,
    # halve down to MIN_SEQ_LEN until something does
    low, high = None, None
    if ask(start):
        low = start
        while low < ceiling:
            longer = min(ceiling, _round(2 * low, multiple_of))
            if not ask(longer):
                high = longer
                break
            low = longer
    else:
        high = start
        while high // 2 >= MIN_SEQ_LEN:
            shorter = _round(high // 2, multiple_of) if high // 2 >= multiple_of else high // 2
            if ask(shorter):
                low = shorter
                break
            high = shorter
    # bisection inside [low, high]: low fits, high does not. It starts from the bracket every answer
    # makes, not only this walk's: a cached or first-pass probe may lie inside it (a coarse pass's ok
    # at 858,000 inside [851,968, 917,504]), and then nothing it settles is probed again.
    if high is not None and low is not None:
        if known.max_ok is not None and low < known.max_ok <= ceiling:
            low = known.max_ok
        if known.min_oom is not None and known.min_oom < high:
            high = known.min_oom
        while high - low > max(resolution.width(low), multiple_of):
            middle = _round((low + high) // 2, multiple_of)
            if middle <= low or middle >= high:
                break
            if ask(middle):
                low = middle
            else:
                high = middle
    result.max_ok, result.min_oom = low, high
    return result


def _round(seq_len: int, multiple_of: int) -> int:
    return max(multiple_of, seq_len // multiple_of * multiple_of)
