"""A max-length search's seed kept as a row of the results file, so that no GPU waits for it.

A seed is the estimator's predicted max T for a search's probes (simulated_search.py
`estimate_seed`): a fake-tensor search on the host's CPU, about a minute a method, while the GPU
idles. Its row is a prediction, never a measurement: kind seed, source simulated, and the plots
and the report read kinds point and maxlen only. A sweep stores each seed it predicts and reads a
stored one instead of predicting it again; `sbp sweep --seeds-only` stores them ahead, on any machine.

A seed row is keyed like its search's answer (model, method, settings), with kind seed, the
simulated target as device_name ("simulated GPU") and, as memory_limit_bytes, the memory the
prediction ran against: the search's limit, or the GPU's capacity where that is smaller. A seed
predicted for 80 GiB thus serves an H200 capped at 80 GiB, and an H100 (79.6 GiB) predicts its own.
A stored prediction that failed (status error) is predicted again, as a point's error is rerun.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from ..config import MaxlenSpec
from ..measure.memory_cap import memory_cap
from ..records import ResultRow, decode_row, read_rows, row_key
from ..workload.rows import spec_fields

SEED_KIND = "seed"
SIMULATED_DEVICE = {"cuda": "simulated GPU", "cpu": "simulated CPU"}  # what sbpbench.simulate writes as device_name
# The prediction's columns a seed row keeps: its answer, the peak of its longest fit, its provenance.
_KEPT = (
    "status", "error", "max_seq_len", "oom_seq_len", "search_resolution", "num_probes", "search_probes",
    "num_params", "trainable_params", "peak_allocated_bytes", "activation_peak_bytes", "margin_bytes", "peak_phase",
    "host", "torch_version", "transformers_version", "sbpbench_version", "python_version", "git_commit", "git_dirty",
)  # fmt: skip


def seed_target(search: MaxlenSpec) -> str:
    """The device kind a search's probes run on, which its seed predicts: "cuda" or "cpu"."""
    return "cuda" if search.base.device.startswith("cuda") else "cpu"


def seed_memory(search: MaxlenSpec, capacity_bytes: int | None, target: str) -> int | None:
    """The memory a seed is predicted against: the probes' own cap (runner/point.py), the search's
    limit capped by the device's capacity; a GPU search without a limit, the capacity."""
    limit = search.base.memory_limit
    cap = memory_cap(limit, capacity_bytes) if capacity_bytes else limit
    return capacity_bytes if cap is None and target == "cuda" else cap


def seed_key(search: MaxlenSpec, memory_bytes: int | None, target: str) -> tuple[str, ...]:
    """The key of the seed row of `search` predicted for a `target` device of memory_bytes."""
    values = {
        **spec_fields(search.base),
        "kind": SEED_KIND,
        "source": "simulated",
        "device_name": SIMULATED_DEVICE[target],
        "seq_len": None,
        "memory_limit_bytes": memory_bytes,
    }
    return row_key(values)


def stored_seed(out: Path | None, key: tuple[str, ...], search: MaxlenSpec) -> ResultRow | None:
    """The seed row of `key` in `out` that still serves `search`, or None: none there, a failed
    prediction, or one of another resolution, or one that reached a ceiling lower than the search's."""
    found = [row for row in (read_rows(out) if out is not None else []) if row_key(row) == key]
    if not found or found[0]["status"] == "error" or found[0]["search_resolution"] != str(search.resolution):
        return None
    row = decode_row(found[0])
    if row.max_seq_len is not None and row.oom_seq_len is None and row.max_seq_len < search.seq_len_ceiling:
        return None
    return row


def seed_row(
    search: MaxlenSpec, answer: ResultRow, *, memory_bytes: int | None, target: str, seed: int | None
) -> ResultRow:
    """The seed row of `search` from the predicted search's `answer` (a maxlen row, or an error row
    saying why there is no seed): `seed` as seed_seq_len, empty where there is none."""
    row = ResultRow(**spec_fields(search.base))
    row.kind, row.source, row.seq_len = SEED_KIND, "simulated", None
    row.device, row.device_name, row.memory_source = target, SIMULATED_DEVICE[target], "fake-tensor"
    row.memory_limit_bytes = row.memory_limit_effective_bytes = row.device_total_memory_bytes = memory_bytes
    for column in _KEPT:
        setattr(row, column, getattr(answer, column))
    row.search_resolution = str(search.resolution)
    row.seed_seq_len = seed
    row.timestamp_utc = datetime.now(UTC).isoformat(timespec="seconds")
    return row
