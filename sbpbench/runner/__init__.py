"""Orchestration: builds models and batches and runs methods on them."""

from .exactness import ExactnessSpec, check_exactness

__all__ = ["ExactnessSpec", "check_exactness"]
