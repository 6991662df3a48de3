"""Orchestration: builds models and batches, runs methods on them, one process per measured point."""

from .exactness import ExactnessSpec, check_exactness
from .isolated import run_isolated, run_points
from .spec import DTYPES, PROTOCOLS, RunSpec

__all__ = ["DTYPES", "PROTOCOLS", "ExactnessSpec", "RunSpec", "check_exactness", "run_isolated", "run_points"]
