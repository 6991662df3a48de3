"""The thread policy of a measurement: a set intra-op thread count, recorded with the load."""

from __future__ import annotations

import os

import pytest
import torch

from sbpbench.config import ConfigError, point_specs
from sbpbench.measure import threads
from sbpbench.runner.point import measure_point


def test_default_threads_are_omp_num_threads_else_the_physical_cores(monkeypatch):
    """Unset threads resolve to OMP_NUM_THREADS when it is a positive integer, else to the physical
    cores of the affinity mask, never more than its CPUs."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    (spec,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": 16}, ["bp"])
    assert spec.threads == 3
    for unusable in ("", "0", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        (spec,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": 16}, ["bp"])
        assert spec.threads == threads.physical_cores_available()
        assert 1 <= spec.threads <= len(threads.available_cpus())


def test_threads_are_checked_and_travel_to_the_worker():
    """threads=0 names the field; a given count survives the JSON trip to the worker."""
    with pytest.raises(ConfigError, match="threads"):
        point_specs({"device": "cpu", "model": "tiny/qwen3", "threads": 0}, ["bp"])
    (spec,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": 16, "threads": 1}, ["bp"])
    assert type(spec).from_json(spec.to_json()).threads == 1


def test_a_point_runs_and_records_its_thread_count_and_the_load():
    """measure_point sets torch's intra-op threads to the spec's and the row says so, with the load."""
    before = torch.get_num_threads()
    try:
        (spec,) = point_specs(
            {"device": "cpu", "model": "tiny/qwen3", "seq_len": 16, "threads": 1, "repeats": 1, "warmup": 0}, ["bp"]
        )
        row = measure_point(spec)
        assert row.status == "ok" and row.num_threads == 1 == torch.get_num_threads()
        assert row.load_avg_1m == pytest.approx(os.getloadavg()[0], abs=5)
    finally:
        torch.set_num_threads(before)


def test_busy_warning_only_when_the_load_exceeds_the_cpus(monkeypatch):
    """One line naming the load and the CPUs when load > CPUs, nothing otherwise."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.9, 3.0, 2.5))
    warning = threads.busy_warning()
    assert warning is not None and "3.9" in warning and "2 CPU" in warning and "\n" not in warning
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert threads.busy_warning() is None
