"""What measuring a point, a search or an experiment costs on a GPU, predicted in seconds.

A measured point is one process (runner/isolated.py). It starts (the interpreter, torch and
transformers, the model's random weights made on the GPU), then runs warmup + 1 + repeats steps
(runner/point.py). A step's seconds come from the planner's time model (timing.py), at rates
fitted to the GPU rows measured so far. The start is START_S plus BUILD_S_PER_GIB per GiB of
weights, read off one H100's selftest log (results/gpu/NVIDIA-H100-80GB-HBM3/selftest.log): a
Qwen3-4B point took 24-25 s with about 7.5 s of steps (17 s to start), a memory-only Qwen3-8B
point 30.5 s (29 s to start).

A seeded max-length search (runner/length_search.py) probes about SEEDED_PROBES lengths per method
around its seed, each a memory-only point near the predicted max T. Its seed is a fake-tensor search
on the host's CPU: wall time, not device time, priced apart (SEED_S), and nothing where the seed is
stored in the results file already (`sbp sweep --seeds-only`). These are predictions for planning a
session, never results. A point on the CPU is listed without a price (CPU_NOT_PRICED says why).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from ..config import MaxlenSpec, RunSpec
from ..core import Placement
from ..records import read_rows
from .plan import meta_model
from .timing import Rates, fitted_rates, step_time, work

START_S = 5.0  # interpreter, torch and transformers imports, CUDA context
BUILD_S_PER_GIB = 1.6  # random weights, gradients and the first allocations, per GiB of weights
SEEDED_PROBES = 3  # just below and just above the seed, and one more where the prediction is off
SEED_S = 60.0  # a fake-tensor search of one method on a 16-core host (selftest: 15-23 s per estimate)
COMMAND_S = 540.0  # the --dry-run's command length, as under `--budget 9m`
TIMED_METHODS = ("bp", "ckpt", "streambp")  # the time model's; other methods are priced as ckpt
# why a point on the CPU gets no predicted time
CPU_NOT_PRICED = (
    "the time model (timing.py) is a GPU's, its rates fitted to measured GPU rows or taken from published "
    "H100 figures, and it does not model a CPU's step (bp's attention takes a T x T mask path there)"
)


@dataclass(frozen=True)
class Cost:
    """One point's or search's predicted seconds: device time and, for a seeded search, host time."""

    label: str  # "Qwen/Qwen3-8B streambp T=65536 (cpu)"
    steps: int  # steps of the device (all probes of a search)
    device_s: float  # process starts plus steps
    host_s: float = 0.0  # the seed's fake-tensor search (a search only)
    note: str = ""  # "priced as ckpt", "max T from ..."
    title: str = ""  # the experiment entry it belongs to


@functools.lru_cache(maxsize=32)
def _meta(model: str, num_layers: int | None, dtype: str, lora_rank: int, lora_alpha: int) -> torch.nn.Module:
    """meta_model of a point by the fields it reads: an experiment's points share a few models, and
    building one (even on the meta device) takes a fifth of a second."""
    point = SimpleNamespace(model=model, num_layers=num_layers, dtype=dtype, lora_rank=lora_rank, lora_alpha=lora_alpha)
    return meta_model(point)


def _model(spec: RunSpec) -> torch.nn.Module:
    return _meta(spec.model, spec.num_layers, spec.dtype, spec.lora_rank, spec.lora_alpha)


def start_s(spec: RunSpec) -> float:
    """A point's start: imports plus building its weights (counted on the meta device)."""
    weights = sum(p.numel() * p.element_size() for p in _model(spec).parameters())
    return START_S + BUILD_S_PER_GIB * weights / 2**30


def step_s(spec: RunSpec, rates: Rates) -> tuple[float, float, str]:
    """One step's predicted seconds, the first step's page-locking of host copies (once per
    process), and a note when the method has no time model of its own."""
    method = spec.method if spec.method in TIMED_METHODS else "ckpt"
    settings = spec.settings
    step = work(
        _model(spec),
        method=method,
        batch_size=spec.batch_size,
        seq_len=spec.seq_len,
        chunk_size=settings.chunk_size,
        logits_chunk_size=settings.logits_chunk_size,
        placement=settings.checkpoints,
    )
    timed = step_time(step, rates)
    note = "" if method == spec.method else "priced as ckpt"
    return timed.total_s, timed.first_step_pinning_s, note


def point_cost(spec: RunSpec, rates: Rates) -> Cost:
    steps = spec.warmup + 1 + spec.repeats
    seconds, pinning, note = step_s(spec, rates)
    return Cost(_label(spec), steps, start_s(spec) + pinning + steps * seconds, note=note)


def search_cost(search: MaxlenSpec, rates: Rates, max_t: int | None, why: str = "", host_s: float = SEED_S) -> Cost:
    """A seeded search: SEEDED_PROBES memory-only points at about `max_t` (the predicted max T, None
    when unknown: no device time can be given), after host_s of host time for its seed."""
    label = _search_label(search)
    if max_t is None:
        return Cost(label, 0, float("nan"), host_s, note="max T unknown: predict it with `sbp maxlen --simulate`")
    probe = search.probe(max(1, min(max_t, search.seq_len_ceiling)))
    seconds, pinning, note = step_s(probe, rates)
    probes = SEEDED_PROBES * (probe.warmup + 1)
    device = SEEDED_PROBES * (start_s(probe) + pinning) + probes * seconds
    return Cost(label, probes, device, host_s, note=", ".join(n for n in (f"at max T {max_t:,}{why}", note) if n))


def unpriced(point: RunSpec | MaxlenSpec) -> Cost:
    """A point or search listed without a price: one that runs on the CPU (CPU_NOT_PRICED)."""
    if isinstance(point, MaxlenSpec):
        return Cost(_search_label(point), 0, math.nan, note="on the CPU: not priced")
    return Cost(_label(point), point.warmup + 1 + point.repeats, math.nan, note="on the CPU: not priced")


# How a search is seeded, for its price: the host seconds its seed takes, and the seed's max T
# where one is stored (None: not stored).
SeedOf = Callable[[MaxlenSpec], tuple[float, int | None]]


def experiment_costs(
    points: Iterable[RunSpec | MaxlenSpec],
    rates: Rates,
    max_t_of: Callable[[MaxlenSpec], tuple[int | None, str]],
    seed_of: SeedOf | None = None,
) -> list[Cost]:
    """Each point's or search's cost, in the experiment's order; max_t_of(search) gives a search's
    predicted max T and where it came from, unless seed_of gives its stored seed (default: no seed
    stored, SEED_S of host time)."""
    costs = []
    for point in points:
        if isinstance(point, MaxlenSpec):
            host_s, stored = seed_of(point) if seed_of is not None else (SEED_S, None)
            max_t, why = (stored, " (its stored seed)") if stored else max_t_of(point)
            costs.append(search_cost(point, rates, max_t, why, host_s=host_s))
        else:
            costs.append(point_cost(point, rates))
    return costs


def predicted_max_t(search: MaxlenSpec, rows: list[dict], reference=None) -> tuple[int | None, str]:
    """A search's max T for pricing it: the latest simulated max-length row of the same model,
    method, ranks and setting in `rows` (results rows as read_rows gives them), else the paper's number
    for it (a reference table), else None; with where it came from."""
    base = search.base
    same = {
        "model": base.model, "method": base.method, "objective": base.objective, "lora_rank": str(base.lora_rank),
        "step": base.step, "dtype": base.dtype, "batch_size": str(base.batch_size),
        "nproc": str(base.nproc), "sp": str(base.sp),  # a row of 8 GPUs sharing a sequence is not one GPU's
    }  # fmt: skip
    place = str(base.settings.checkpoints or ("gpu" if base.method == "streambp" else ""))
    found = [
        row
        for row in rows
        if (row.get("kind"), row.get("source")) == ("maxlen", "simulated")
        and row.get("max_seq_len")
        and all(str(row.get(k)) == v for k, v in same.items())
        and (row.get("checkpoints") or ("gpu" if row["method"] == "streambp" else "")) == place
        and (base.num_layers is None or str(row.get("num_layers")) == str(base.num_layers))
    ]
    if found:
        latest = max(found, key=lambda row: row["timestamp_utc"])
        return int(float(latest["max_seq_len"])), " (predicted)"
    if reference is not None:
        from ..records.select import MAXLEN_TABLE, paper_rows

        like = {**same, "lora_rank": base.lora_rank, "batch_size": base.batch_size}
        paper = paper_rows(reference, table=MAXLEN_TABLE.get(base.step, ""), metric="max_seq_len", like=like)
        if len(paper):
            return int(paper["value"].iloc[0]), " (the paper's)"
    return None, ""


def _default_placement(spec: RunSpec) -> bool:
    return spec.method != "streambp" or spec.settings.checkpoints in (None, Placement())


def _search_label(search: MaxlenSpec) -> str:
    base = search.base
    return f"{base.model} {base.method} max T" + ("" if _default_placement(base) else f" ({base.settings.checkpoints})")


def _label(spec: RunSpec) -> str:
    batch = f" B={spec.batch_size}" if spec.batch_size != 1 else ""
    place = "" if _default_placement(spec) else f" ({spec.settings.checkpoints})"
    return f"{spec.model} {spec.method} T={spec.seq_len}{batch}{place}"


@dataclass(frozen=True)
class Pricing:
    """An experiment's points not yet measured, each with its predicted cost on one GPU, or listed
    unpriced where the experiment runs on the CPU."""

    device: str  # the GPU priced: its rows gave the rates (or "H100": the default rates); or the CPU's name
    rates: Rates | None  # None: not priced, the experiment runs on the CPU (CPU_NOT_PRICED)
    costs: list[Cost]
    done: int  # points already in the results CSV (resume): no cost
    name: str = ""  # the experiment's

    @property
    def device_s(self) -> float:
        return sum(c.device_s for c in self.costs)

    @property
    def host_s(self) -> float:
        return sum(c.host_s for c in self.costs)


def measured_gpu(results: Path) -> str | None:
    """The device name of most measured GPU rows under `results` (a CSV or a folder), or None."""
    counts: dict[str, int] = {}
    for row in _rows(results):
        if row.get("source") == "measured" and str(row.get("device", "")).startswith("cuda"):
            counts[row["device_name"]] = counts.get(row["device_name"], 0) + 1
    return max(counts, key=counts.get) if counts else None


def measured_capacity(results: Path, gpu: str) -> int | None:
    """The memory of the GPU called `gpu` (device_total_memory_bytes) that most of its measured
    rows under `results` record, or None."""
    counts: dict[int, int] = {}
    for row in _rows(results):
        if row.get("source") == "measured" and row.get("device_name") == gpu and row.get("device_total_memory_bytes"):
            total = int(float(row["device_total_memory_bytes"]))
            counts[total] = counts.get(total, 0) + 1
    return max(counts, key=counts.get) if counts else None


def price(
    points: list,
    titles: list[str],
    *,
    results: Path,
    gpu: str,
    reference=None,
    done: int = 0,
    seed_of: SeedOf | None = None,
) -> Pricing:
    """The points (in order, with their entries' titles) priced for `gpu`: rates fitted to its rows
    under `results`, the searches' max T from their stored seeds (seed_of) or the simulated rows
    there (else the paper's)."""
    rates = fitted_rates(results, gpu, meta_model)
    rows = list(_rows(results))
    costs = experiment_costs(points, rates, lambda search: predicted_max_t(search, rows, reference), seed_of)
    costs = [replace(cost, title=title) for cost, title in zip(costs, titles)]
    return Pricing(gpu, rates, costs, done=done)


def _rows(results: Path) -> Iterable[dict]:
    files = sorted(results.rglob("*.csv")) if results.is_dir() else [results] if results.exists() else []
    for path in files:
        try:
            yield from read_rows(path)
        except ValueError:  # not a results CSV (the paper's reference, an exactness table)
            continue


def commands(costs: list[Cost], budget_s: float = COMMAND_S, min_start_s: float = 30.0) -> list[int]:
    """Which command (1, 2, ...) of `sbp sweep --budget` each cost falls in, run in order: a point
    starts when min_start_s or more is left (runner/budget.py's MIN_START_S), and one that would not
    finish in what is left moves to the next command (under --budget it would start, be cut and
    run again there). An unknown cost (NaN) counts its host time only."""
    numbers, used, command = [], 0.0, 1
    for cost in costs:
        seconds = cost.host_s + (0.0 if math.isnan(cost.device_s) else cost.device_s)
        if used and (budget_s - used < min_start_s or seconds > budget_s - used):
            command, used = command + 1, 0.0
        numbers.append(command)
        used += seconds
    return numbers


def groups(pricing: Pricing, budget_s: float = COMMAND_S) -> list[dict]:
    """The costs by experiment entry (consecutive costs of one title), with their commands."""
    found: list[dict] = []
    for cost, number in zip(pricing.costs, commands(pricing.costs, budget_s)):
        if not found or found[-1]["title"] != cost.title:
            found.append({"title": cost.title, "points": 0, "device_s": 0.0, "host_s": 0.0, "commands": []})
        group = found[-1]
        group["points"] += 1
        group["device_s"] += cost.device_s
        group["host_s"] += cost.host_s
        if number not in group["commands"]:
            group["commands"].append(number)
    return found


def pricing_markdown(pricing: Pricing, budget_s: float = COMMAND_S) -> str:
    """The entries as a Markdown table (points, predicted device and host minutes, the `--budget`
    commands each falls in), then the GPU and the rates priced with."""
    lines = [
        f"| entry | points | device min | host min | command (--budget {budget_s / 60:g}m) |",
        "|---|---:|---:|---:|---|",
    ]
    for group in groups(pricing, budget_s):
        span = group["commands"]
        cells = [
            group["title"] or "(untitled)",
            str(group["points"]),
            _minutes(group["device_s"]),
            _minutes(group["host_s"]),
            str(span[0]) if len(span) == 1 else f"{span[0]}-{span[-1]}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    count = max(commands(pricing.costs, budget_s), default=0)
    total = ["all", str(len(pricing.costs)), _minutes(pricing.device_s), _minutes(pricing.host_s), f"{count} commands"]
    lines += ["| " + " | ".join(total) + " |", ""]
    if pricing.rates is None:
        lines.append(f"Runs on the CPU ({pricing.device}): no time predicted, as {CPU_NOT_PRICED}.")
    else:
        lines.append(f"Predicted for {pricing.device}, not measured. Rates: {pricing.rates.describe()}.")
    return "\n".join(lines) + "\n"


def _minutes(seconds: float) -> str:
    return "?" if math.isnan(seconds) else f"{seconds / 60:.1f}"
