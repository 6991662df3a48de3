"""Orchestration: each measured point in a process of its own (its model and batch from
sbpbench.workload), sweeps, the max-length search, timeouts."""

from .exactness import ExactnessSpec, check_exactness
from .isolated import run_isolated, run_points

__all__ = ["ExactnessSpec", "check_exactness", "run_isolated", "run_points"]
