"""The longest trainable sequence over a monotone probe: growth then bisection, or from a seed.

A probe answers "does one step at seq_len T fit?" (True: ok, False: out of memory). Memory grows
with T, so the answers are monotone, and every probe already answered (this search's, or cached
from an interrupted one) settles every T on its side: an ok at T proves every shorter length ok,
an OOM every longer one. The search asks the probe only what nothing cached settles, so a
resumed search replays the same steps and probes only what is still open.

Blind (no seed): growth doubles T from `start` until the first OOM (or `ceiling`); bisection then
halves the bracket [longest ok, shortest OOM] until it is no wider than the resolution.

Seeded (a predicted longest fit: `sbp estimate`'s search, at the same resolution): the prediction
says the answer lies in [seed, seed + one resolution width), its own first OOM being at most that
far above. So the first probe is the seed and the second one width above it; a right prediction
is two probes, seed ok and the next OOM, with nothing left to bisect. (A bracket centred on the
seed would miss half of the right predictions.) A probe that disagrees moves the bracket to its
side by steps that double (1, 2, 4... widths) until a probe agrees, then bisection closes it: a
prediction off by a fraction f costs about 2 log2(f / resolution) probes more, and the answer is
the true one whatever f. Doubling is galloping search: with the error's size unknown, it takes at
most about twice the probes that knowing it would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ..config.maxlen import MIN_SEQ_LEN, Resolution


class Probe(NamedTuple):
    seq_len: int
    fits: bool
    ran: bool  # the probe computed it (False: a cached answer, or settled by one)


@dataclass
class SearchResult:
    max_ok: int | None  # the longest length that fit (None: not even the shortest tried)
    min_oom: int | None  # the shortest that did not (None: everything up to the ceiling fit)
    probes: list[Probe] = field(default_factory=list)  # every answer used, in order
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

    def answer(self, ceiling: int, resolution: Resolution, multiple_of: int) -> tuple[int | None, int | None] | None:
        """The search's (max_ok, min_oom) if these answers already give it (`answered`), else None."""
        if self.max_ok is not None and self.max_ok >= ceiling:
            return ceiling, None
        if self.min_oom is not None and self.min_oom <= MIN_SEQ_LEN:
            return None, self.min_oom
        if self.max_ok is None or self.min_oom is None:
            return None
        closed = self.min_oom - self.max_ok <= max(resolution.width(self.max_ok), multiple_of)
        return (self.max_ok, self.min_oom) if closed else None

    def add(self, seq_len: int, fits: bool) -> None:
        if fits:
            self.max_ok = seq_len if self.max_ok is None else max(self.max_ok, seq_len)
        else:
            self.min_oom = seq_len if self.min_oom is None else min(self.min_oom, seq_len)


def answered(cached: Mapping[int, bool], *, ceiling: int, resolution: Resolution, multiple_of: int = 1) -> bool:
    """Whether cached answers alone answer the search, so that no probe (and no seed) is needed:
    the ceiling fits, the shortest length does not, or [longest ok, shortest OOM] is no wider
    than the resolution."""
    return _Known(cached).answer(ceiling, resolution, multiple_of) is not None


def search_max_len(
    probe: Callable[[int], bool],
    *,
    start: int,
    ceiling: int,
    resolution: Resolution,
    cached: Mapping[int, bool] | None = None,
    multiple_of: int = 1,
    seed: int | None = None,
) -> SearchResult:
    """The longest T <= ceiling for which probe(T) is True, to `resolution`.

    Probed lengths are multiples of `multiple_of` (the CUDA kernels' favourite, e.g. 8), except
    `ceiling` itself and lengths below multiple_of. seed: a predicted longest fit to start from
    (module docstring; below MIN_SEQ_LEN: nothing predicted to fit), None: growth from `start`.
    The probe may raise (an error that is not an OOM): the search stops there, having kept every
    answer so far in `cached` order for a resume."""
    if not MIN_SEQ_LEN <= start <= ceiling:
        raise ValueError(f"need {MIN_SEQ_LEN} <= start <= ceiling, got start {start}, ceiling {ceiling}")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    known = _Known(cached or {})
    result = SearchResult(max_ok=None, min_oom=None)

    def ask(seq_len: int) -> bool:
        answer = known.settled(seq_len)
        ran = answer is None
        if ran:
            answer = bool(probe(seq_len))
            result.num_run += 1
            known.add(seq_len, answer)
        result.probes.append(Probe(seq_len, answer, ran))
        return answer

    done = known.answer(ceiling, resolution, multiple_of)
    if done is not None:  # a finished search rerun: its bracket's answers, and nothing replayed
        result.max_ok, result.min_oom = done
        result.probes = [Probe(t, t != result.min_oom, False) for t in done if t is not None]
        return result
    if seed is None:
        low, high = _grow(ask, start, ceiling, multiple_of)
    else:
        low, high = _from_seed(ask, seed, ceiling, resolution, multiple_of)
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


Ask = Callable[[int], bool]


def _grow(ask: Ask, start: int, ceiling: int, multiple_of: int) -> tuple[int | None, int | None]:
    """The blind bracket: start, 2*start, ... until an OOM or the ceiling; if start itself does not
    fit, halve down to MIN_SEQ_LEN until something does."""
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
            shorter = _below(high // 2, multiple_of)
            if ask(shorter):
                low = shorter
                break
            high = shorter
    return low, high


def _from_seed(
    ask: Ask, seed: int, ceiling: int, resolution: Resolution, multiple_of: int
) -> tuple[int | None, int | None]:
    """The seeded bracket (module docstring): the seed, then one width past it on the side its
    answer points to, then doubling steps (2, 4... widths) until a probe agrees. A seed at or past
    the ceiling probes the ceiling first; one below MIN_SEQ_LEN, the shortest length."""
    first = min(ceiling, _below(max(seed, MIN_SEQ_LEN), multiple_of))
    step = max(resolution.width(first), multiple_of)
    if ask(first):
        low = first
        while low < ceiling:
            longer = min(ceiling, _below(low + step, multiple_of))  # > low: step >= multiple_of
            if not ask(longer):
                return low, longer
            low, step = longer, 2 * step
        return low, None
    high = first
    while high > MIN_SEQ_LEN:
        shorter = max(MIN_SEQ_LEN, _below(high - step, multiple_of))
        if ask(shorter):
            return shorter, high
        high, step = shorter, 2 * step
    return None, high


def _round(seq_len: int, multiple_of: int) -> int:
    return max(multiple_of, seq_len // multiple_of * multiple_of)


def _below(seq_len: int, multiple_of: int) -> int:
    """seq_len rounded down to a multiple, or seq_len itself where no multiple is that short."""
    return _round(seq_len, multiple_of) if seq_len >= multiple_of else seq_len
