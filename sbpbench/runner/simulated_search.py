"""The max-length search on predicted probes (`sbp maxlen --simulate`), and the seed it gives a
measured search (`sbp maxlen`, `sbp sweep`): the predicted max T for exactly the probes' point.

It joins runner's search (maxlen.py) with simulate's probes (simulate/depth.py). The estimator is
imported inside the functions: a command that only parses its options loads none of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..measure.units import duration
from ..settings import SETTINGS
from ..settings.table import NOT_ESTIMATED, UNTIMED, not_estimated

if TYPE_CHECKING:
    from pathlib import Path

    from ..config import MaxlenSpec
    from ..records import ResultRow
    from .budget import Budget
    from .maxlen import Seed

Note = Callable[[str], None]
# A seed's probe point: the search's own on fake CPU tensors, whose memory does not depend on weights' values
SEED_POINT = {"device": "cpu", "weights": False}


def simulated_probing(
    *,
    target: str,
    memory_bytes: int | None,
    host_memory_bytes: int | None,
    exact: bool = False,
    note: Note | None = None,
) -> dict:
    """find_max_len's arguments for probes that are predictions of a `target` run ("cuda": a GPU
    of memory_bytes; "cpu": the tensor tracker capped at memory_bytes). note: progress lines."""
    from ..simulate.depth import estimate_point_by_depth
    from .seeds import SIMULATED_DEVICE

    def measure(spec, env) -> ResultRow:
        return estimate_point_by_depth(
            spec,
            target=target,
            gpu_memory_bytes=memory_bytes,
            host_memory_bytes=host_memory_bytes,
            exact=exact,
            note=None if note is None else lambda line: note(f"{spec.method} T={spec.seq_len}: {line}"),
        )

    return {"measure": measure, "device_name": SIMULATED_DEVICE[target], "source": "simulated"}


def simulated_max_len(search: MaxlenSpec, out, *, probing: dict, exact: bool = False, **options) -> ResultRow:
    """find_max_len on predicted probes: first the lengths that share their short runs (multiples
    of the layer chunk, simulate/length.py), then the rest of the bracket; `exact` runs each probe
    in full, so no length is cheaper than another."""
    from ..simulate.length import shared_multiple
    from .maxlen import find_max_len

    first = None if exact else shared_multiple(search)
    return find_max_len(search, out, first_multiple=first, **probing, **options)


def estimate_seed(
    *,
    capacity_bytes: int | None,
    budget: Budget | None = None,
    note: Note,
    out: Path | None = None,
    target: str | None = None,
    on_row: Callable[[ResultRow, bool], None] | None = None,
) -> Seed:
    """A measured search's seed (runner/maxlen.py Seed): the simulated search's max T for the same
    probes, predicting what the probes measure: on a GPU max_memory_allocated against the search's
    memory limit (or capacity_bytes, the device's, where it has none or a larger one); on a CPU the
    tracked tensors against the same cap. Under `budget` each predicted probe starts only while a
    measured one still could (runner/budget.py). note: one line per seed, with what it cost.

    out: the results file a seed is read from when stored there (seeds.py), and stored in when
    predicted. target: the device kind predicted ("cuda", "cpu"; None: the search's own).
    on_row(row, stored): each seed's row, and whether it was read from `out`."""
    from ..records import upsert_rows
    from ..simulate.length import EXTRAPOLATED_METHODS
    from .seeds import seed_key, seed_memory, seed_target, stored_seed

    def seed(search: MaxlenSpec) -> int | None:
        spec = search.base
        without = _unseeded(spec, EXTRAPOLATED_METHODS)
        if without:
            note(f"{spec.method}: no seed ({without}): growing from T={search.start:,}")
            return None
        aim = target or seed_target(search)
        memory = seed_memory(search, capacity_bytes, aim)
        row = stored_seed(out, seed_key(search, memory, aim), search)
        stored = row is not None
        if stored:
            cost = f"stored in {out}"
        else:
            started = time.monotonic()
            row = _predicted_seed(search, memory_bytes=memory, target=aim, budget=budget)
            cost = duration(time.monotonic() - started)
            if out is not None:
                upsert_rows(out, [row])
        if on_row is not None:
            on_row(row, stored)
        note(f"{spec.method}: {seed_line(row, cost, start=search.start)}")
        return row.seed_seq_len

    return seed


def _predicted_seed(search: MaxlenSpec, *, memory_bytes: int | None, target: str, budget: Budget | None) -> ResultRow:
    """The seed row of `search` from its simulated search on fake CPU tensors (seeds.py)."""
    from ..measure.host_memory import total_ram_bytes
    from ..records import ResultRow
    from ..workload.rows import spec_fields
    from .budget import started_within
    from .maxlen import ProbeFailed
    from .seeds import seed_row

    spec = search.base
    probing = simulated_probing(
        target=target,
        memory_bytes=memory_bytes,
        # a GPU run's checkpoint copies go to this machine's RAM; on a CPU the tracker counts them
        host_memory_bytes=total_ram_bytes() if target == "cuda" else None,
    )
    if budget is not None:
        probing["measure"] = started_within(probing["measure"], budget, what="a predicted probe of the seed")
    # the probes' own point on fake CPU tensors; what the estimator does not model was ruled out above
    predicted = replace(search, base=replace(spec, **SEED_POINT), seed_from_estimate=False)
    try:
        answer = simulated_max_len(predicted, None, probing=probing, resume=False)
    except ProbeFailed as error:
        answer = ResultRow(**spec_fields(spec), status="error", error=f"the prediction failed: {error}")
    seed = None
    if answer.status in ("ok", "oom"):  # oom: not even the shortest length fits, seed 0
        seed, answer.error = (0 if answer.max_seq_len is None else answer.max_seq_len), ""
    elif not answer.error.startswith("the prediction failed"):  # unsupported, or an error row
        answer.error = f"the prediction is {answer.status}" + (f": {answer.error}" if answer.error else "")
    return seed_row(search, answer, memory_bytes=memory_bytes, target=target, seed=seed)


def seed_line(row: ResultRow, cost: str, *, start: int) -> str:
    """A seed row in one line, with what it cost: "seed: predicted max T 4,736 (52 s)"."""
    if row.seed_seq_len is None:
        return f"no seed ({row.error}): growing from T={start:,}"
    if row.seed_seq_len == 0:
        return f"seed: predicted that not even T={row.oom_seq_len:,} fits ({cost})"
    return f"seed: predicted max T {row.seed_seq_len:,} ({cost})"


def is_seeded(search: MaxlenSpec) -> bool:
    """Whether a measured search starts from a seed: its file asks for one and the estimator gives it."""
    from ..simulate.length import EXTRAPOLATED_METHODS

    return search.seed_from_estimate and not _unseeded(search.base, EXTRAPOLATED_METHODS)


def seed_sets_itself(name: str) -> bool:
    """Whether a setting `sbp estimate` refuses leaves a seed right: the seed sets it (SEED_POINT),
    predicts against the search's own cap (memory_limit) in this process (timeout_s), or the setting
    only times steps (the settings table's UNTIMED)."""
    return name in SEED_POINT or name in ("memory_limit", "timeout_s") or SETTINGS[name].estimator == UNTIMED


def unmodelled(spec) -> tuple[str, str] | None:
    """The first setting of a search's probe point (a RunSpec) that the estimator does not model and
    `sbp estimate` refuses (the settings table's `estimator`), given at a value but its default, as
    (name, value as written); None where a seed predicts the point (or `seed_sets_itself`)."""
    for name in NOT_ESTIMATED:
        if seed_sets_itself(name):
            continue
        value = getattr(spec.settings, name) if SETTINGS[name].read_by else getattr(spec, name)
        if value is not None and value != SETTINGS[name].default:  # a knob the method does not read is None
            return name, str(value).lower() if isinstance(value, bool) else str(value)
    return None


def _unseeded(spec, extrapolated: tuple[str, ...]) -> str:
    """Why the estimator gives this point no seed ("": it does)."""
    if spec.method not in extrapolated:
        # the estimator runs these in full at each length: minutes per probe at long T, a seed
        # costing more than the probes it saves
        return f"the estimator runs {spec.method} in full at each length"
    found = unmodelled(spec)
    if found is not None:
        name, value = found
        return f"the estimator does not model {name} {value}: {not_estimated(name)}"
    return ""
