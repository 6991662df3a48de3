"""Orchestration: builds models and batches, runs methods on them, one process per measured point."""

from .exactness import ExactnessSpec, check_exactness
from .isolated import run_isolated, run_points

__all__ = ["ExactnessSpec", "check_exactness", "run_isolated", "run_points"]
