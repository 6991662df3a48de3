"""`sbp sweep --dry-run`: an experiment's points not yet measured, priced for a GPU.

The points are the sweep's own (runner/sweep.py `plan`: file order, duplicates dropped, those in
the results CSV done), built with a GPU's defaults on any machine; simulate/cost.py prices them. A
search whose seed is stored in the results CSV (seeds.py) costs no host time, and its stored seed
is the max T its probes are priced at. An experiment that runs on the CPU is listed with its own
defaults and this machine's CPU, unpriced (cost.py CPU_NOT_PRICED).
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
from ..simulate.cost import SEED_S, Pricing, measured_capacity, measured_gpu, price, unpriced
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
    device: str | None = None,
) -> Pricing:
    """Each point of the experiment at `path` not yet in `out` (None: every point; a folder: its
    results/<name>.csv), priced for `gpu` (a device name; None: the GPU with most measured rows
    under `results`, else the default H100) of capacity_bytes (None: what its rows record).
    device: the sweep's --device (None: the file's); an experiment that runs on the CPU is listed
    unpriced."""
    with warnings.catch_warnings():  # a price needs no word on lengths past a model's context
        warnings.simplefilter("ignore", BeyondContextWarning)
        loaded = load_experiment(path, device="cpu", defaults_for="cuda")  # a GPU's points, on any machine
        out = out / f"{loaded.name}.csv" if out is not None and out.is_dir() else out
        if runs_on_cpu(loaded.points, loaded.devices, device):
            return _on_the_cpu(path, out)
    gpu = gpu or measured_gpu(results) or "H100"
    capacity = capacity_bytes if capacity_bytes is not None else measured_capacity(results, gpu)
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


def runs_on_cpu(points: tuple, devices: tuple[str, ...], device: str | None) -> bool:
    """Whether a sweep of these points (config/experiment.py Experiment's) runs on the CPU: its
    --device where given, else the device its file names for the point whose device the sweep takes
    (its first grid point, else its first search: runner/experiment.py `plan_experiment`). "auto"
    (or no device named) is priced for a GPU: the machine a dry run plans for is not this one."""
    if device is None:
        grid = [named for point, named in zip(points, devices) if isinstance(point, RunSpec)]
        device = (grid or list(devices) or ["auto"])[0]
    return device.strip().lower() == "cpu"


def _on_the_cpu(path: Path, out: Path | None) -> Pricing:
    """The experiment's points not yet in `out`, as its sweep on this machine's CPU builds them (the
    CPU's defaults, rows keyed by this CPU's name), listed unpriced."""
    from ..measure.environment import capture_environment

    loaded = load_experiment(path, device="cpu")
    cpu = capture_environment("cpu").device_name
    jobs = plan(loaded.points, out, device_name=cpu, resume=out is not None)
    titles = {id(point): title for point, title in zip(loaded.points, loaded.titles)}
    costs = [replace(unpriced(job.point), title=titles.get(id(job.point), "")) for job in jobs if not job.done]
    return Pricing(cpu, None, costs, done=len(jobs) - len(costs), name=loaded.name)


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
