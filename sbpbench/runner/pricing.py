"""`sbp sweep --dry-run`: an experiment's points not yet measured, priced for a GPU.

The points are the sweep's own (runner/sweep.py `plan`: file order, duplicates dropped, those in
the results CSV done), built with a GPU's defaults on any machine; simulate/cost.py prices them.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

from ..config.experiment import load_experiment
from ..config.run import BeyondContextWarning
from ..simulate.cost import Pricing, measured_gpu, price
from .sweep import plan


def price_experiment(
    path: Path, *, results: Path, out: Path | None = None, gpu: str | None = None, reference=None
) -> Pricing:
    """Each point of the experiment at `path` not yet in `out` (None: every point; a folder: its
    results/<name>.csv), priced for `gpu` (a device name; None: the GPU with most measured rows
    under `results`, else the default H100)."""
    gpu = gpu or measured_gpu(results) or "H100"
    with warnings.catch_warnings():  # a price needs no word on lengths past a model's context
        warnings.simplefilter("ignore", BeyondContextWarning)
        loaded = load_experiment(path, device="cpu", defaults_for="cuda")  # a GPU's points, on any machine
    out = out / f"{loaded.name}.csv" if out is not None and out.is_dir() else out
    jobs = plan(loaded.points, out, device_name=gpu, resume=out is not None)
    titles = {id(point): title for point, title in zip(loaded.points, loaded.titles)}
    todo = [job.point for job in jobs if not job.done]
    priced = price(
        todo,
        [titles.get(id(point), "") for point in todo],
        results=results,
        gpu=gpu,
        reference=reference,
        done=len(jobs) - len(todo),
    )
    return replace(priced, name=loaded.name)
