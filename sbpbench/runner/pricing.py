"""`sbp sweep --dry-run`: an experiment's points not yet measured, priced for a GPU.

The points are the sweep's own (runner/sweep.py `plan`: file order, duplicates dropped, those in
the results CSV done), built with a GPU's defaults on any machine; simulate/cost.py prices them. A
search whose seed is stored in the results CSV (seeds.py) costs no host time, and its stored seed
is the max T its probes are priced at.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..config import MaxlenSpec, RunSpec
from ..config.experiment import load_experiment
from ..config.run import BeyondContextWarning
from ..simulate.cost import SEED_S, Pricing, measured_capacity, measured_gpu, price
from .seeds import seed_key, seed_memory, stored_seed
from .simulated_search import is_seeded
from .sweep import plan


def price_experiment(
    path: Path,
    *,
    results: Path,
    out: Path | None = None,
    gpu: str | None = None,
    capacity_bytes: int | None = None,
    reference=None,
) -> Pricing:
    """Each point of the experiment at `path` not yet in `out` (None: every point; a folder: its
    results/<name>.csv), priced for `gpu` (a device name; None: the GPU with most measured rows
    under `results`, else the default H100) of capacity_bytes (None: what its rows record)."""
    gpu = gpu or measured_gpu(results) or "H100"
    capacity = capacity_bytes if capacity_bytes is not None else measured_capacity(results, gpu)
    with warnings.catch_warnings():  # a price needs no word on lengths past a model's context
        warnings.simplefilter("ignore", BeyondContextWarning)
        loaded = load_experiment(path, device="cpu", defaults_for="cuda")  # a GPU's points, on any machine
    out = out / f"{loaded.name}.csv" if out is not None and out.is_dir() else out
    jobs = plan(loaded.points, out, device_name=gpu, resume=out is not None)
    titles = {id(point): title for point, title in zip(loaded.points, loaded.titles)}
    todo = [job.point for job in jobs if not job.done]

    def seed_of(search: MaxlenSpec) -> tuple[float, int | None]:
        if not is_seeded(search):
            return 0.0, None
        stored = stored_seed(out, seed_key(search, seed_memory(search, capacity, "cuda"), "cuda"), search)
        return (SEED_S, None) if stored is None else (0.0, stored.seed_seq_len)

    priced = price(
        todo,
        [titles.get(id(point), "") for point in todo],
        results=results,
        gpu=gpu,
        reference=reference,
        done=len(jobs) - len(todo),
        seed_of=seed_of,
    )
    return replace(priced, name=loaded.name)


def point_seconds(gpu: str, results: Path) -> Callable[[RunSpec], float]:
    """spec -> its predicted device seconds on `gpu` (start and steps, simulate/cost.py), at rates
    fitted to that GPU's rows under `results`: what a sweep's --budget weighs before starting one.
    A point the model cannot price is NaN (unknown): it starts as without a model."""
    from ..simulate.cost import point_cost
    from ..simulate.plan import meta_model
    from ..simulate.timing import fitted_rates

    rates = fitted_rates(results, gpu, meta_model)

    def seconds(spec: RunSpec) -> float:
        try:
            return point_cost(spec, rates).device_s
        except Exception:  # a price only decides whether to start: one that fails must not stop a measurement
            return math.nan

    return seconds
