"""Experiment files (experiments/*.toml): declarative grids and max-length searches for `sbp sweep`."""

from .loader import Experiment, ExperimentError, load_experiment

__all__ = ["Experiment", "ExperimentError", "load_experiment"]
