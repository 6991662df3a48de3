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

if TYPE_CHECKING:
    from ..config import MaxlenSpec
    from ..records import ResultRow
    from .budget import Budget
    from .maxlen import Seed

SIMULATED_DEVICE = {"cuda": "simulated GPU", "cpu": "simulated CPU"}  # what sbpbench.simulate writes as device_name
Note = Callable[[str], None]


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


def estimate_seed(*, capacity_bytes: int | None, budget: Budget | None = None, note: Note) -> Seed:
    """A measured search's seed (runner/maxlen.py Seed): the simulated search's max T for the same
    probes, predicting what the probes measure: on a GPU max_memory_allocated against the search's
    memory limit (or capacity_bytes, the device's, where it has none or a larger one); on a CPU the
    tracked tensors against the same cap. Under `budget` each predicted probe starts only while a
    measured one still could (runner/budget.py). note: one line per seed, with what it cost."""
    from ..measure.host_memory import total_ram_bytes
    from ..measure.memory_cap import memory_cap
    from ..simulate.length import EXTRAPOLATED_METHODS
    from .budget import started_within
    from .maxlen import ProbeFailed

    def seed(search: MaxlenSpec) -> int | None:
        spec = search.base
        without = _unseeded(spec, EXTRAPOLATED_METHODS)
        if without:
            note(f"{spec.method}: no seed ({without}): growing from T={search.start:,}")
            return None
        cuda = spec.device.startswith("cuda")
        # the probes' own cap (runner/point.py); without a limit a GPU still has its memory, the tracker none
        cap = memory_cap(spec.memory_limit, capacity_bytes) if capacity_bytes else spec.memory_limit
        probing = simulated_probing(
            target="cuda" if cuda else "cpu",
            memory_bytes=capacity_bytes if cap is None and cuda else cap,
            # a GPU run's checkpoint copies go to this machine's RAM; on a CPU the tracker counts them
            host_memory_bytes=total_ram_bytes() if cuda else None,
        )
        if budget is not None:
            probing["measure"] = started_within(probing["measure"], budget, what="a predicted probe of the seed")
        # the probes' own point on fake CPU tensors; weights and forced kernels were ruled out above
        predicted = replace(search, base=replace(spec, device="cpu", weights=False), seed_from_estimate=False)
        started = time.monotonic()
        try:
            answer = simulated_max_len(predicted, None, probing=probing, resume=False)
        except ProbeFailed as error:
            note(f"{spec.method}: no seed (the prediction failed: {error}): growing from T={search.start:,}")
            return None
        if answer.status not in ("ok", "oom"):  # unsupported, or an error row
            note(f"{spec.method}: no seed (the prediction is {answer.status}): growing from T={search.start:,}")
            return None
        took = duration(time.monotonic() - started)
        if answer.max_seq_len is None:  # status oom: not even the shortest length fits
            note(f"{spec.method}: seed: predicted that not even T={answer.oom_seq_len:,} fits ({took})")
            return 0
        note(f"{spec.method}: seed: predicted max T {answer.max_seq_len:,} ({took})")
        return answer.max_seq_len

    return seed


def _unseeded(spec, extrapolated: tuple[str, ...]) -> str:
    """Why the estimator gives this point no seed ("": it does)."""
    if spec.method not in extrapolated:
        # the estimator runs these in full at each length: minutes per probe at long T, a seed
        # costing more than the probes it saves
        return f"the estimator runs {spec.method} in full at each length"
    if spec.sdpa_backend != "auto":
        return f"the estimator models torch's own kernel choice, not --sdpa-backend {spec.sdpa_backend}"
    kernel = spec.settings.chunk_attention
    if kernel not in (None, "auto", "lower-right"):  # simulate/estimate.py refuses it
        return f"the estimator models the lower-right chunk kernel only, not --set chunk_attention={kernel}"
    return ""
