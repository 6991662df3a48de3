"""Shared helpers: tiny models of every supported family and the paper-style batches."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

# One intra-op thread unless OMP_NUM_THREADS says otherwise: the tiny test models gain nothing from
# more, and on a busy machine (other test runs beside this one) spinning OpenMP threads made steps
# several times slower. Set before torch starts its thread pool; subprocesses (CLI runs, isolated
# workers) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test reaches the network: a Hub id missing from the cache is an error at once, not a download
# attempt (huggingface_hub reads this at import, so before anything imports it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from sbpbench.core import Objective, StreamConfig, stream_backward
from sbpbench.core.internal import SteeredHooks
from sbpbench.data import SFTBatch, make_sft_batch
from sbpbench.methods.streambp import current_hooks, step_hooks
from sbpbench.models import build_model
from sbpbench.runner.selftest_summary import TEST_REPORT_ENV

FAMILIES = ("tiny/qwen3", "tiny/qwen2", "tiny/llama", "tiny/mistral", "tiny/gemma3")

# TRL is an optional extra (`pip install -e ".[trl]"`, installed by .ci/run): its tests skip without it.
needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL: pip install -e '.[trl]'")


REPOSITORY = Path(__file__).resolve().parents[1]


STREAM_KNOBS = set(StreamConfig.__dataclass_fields__)
STEP_HOOKS = set(SteeredHooks.__dataclass_fields__)  # what a test may give a step: watching and steering


def streamed(model, input_ids, labels=None, **kwargs):
    """stream_backward with StreamConfig's knobs and StepHooks' fields given as keywords (tests
    spell a step's settings inline), on top of the hooks of an enclosing `step_hooks` (as a
    method's step gets them); the rest go to stream_backward as they are."""
    config = StreamConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in STREAM_KNOBS})
    hooks = replace(current_hooks(), **{k: kwargs.pop(k) for k in list(kwargs) if k in STEP_HOOKS})
    return stream_backward(model, input_ids, labels, config=config, hooks=hooks, **kwargs)


@contextmanager
def observing_stores(**hooks) -> Iterator[list]:
    """The checkpoint store of each StreamBP step run inside (a method's, or `streamed`'s)."""
    stores: list = []
    with step_hooks(on_store=stores.append, **hooks):
        yield stores


@contextmanager
def observing_kernels() -> Iterator[set[str]]:
    """The chunk-attention kernels the StreamBP steps run inside ran."""
    seen: set[str] = set()
    with step_hooks(on_kernel=seen.add):
        yield seen


def load_script(relative: str, name: str):
    """A script of the repository that is not a package module (benchmarks/, .ci/), loaded as the
    module `name`, which is in sys.modules while it is (a dataclass of its looks itself up there)."""
    spec = importlib.util.spec_from_file_location(name, REPOSITORY / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny_model(name: str, dtype=torch.float64, seed: int = 0, **overrides):
    return build_model(name, dtype=dtype, seed=seed, **overrides)


def padded_batch(model, *, batch_size: int, seq_len: int, lengths=None, seed: int = 0) -> SFTBatch:
    """Random ids; lengths: real tokens per row (right padding after), None for no padding, or
    "paper" for the paper's random padding."""
    paper = isinstance(lengths, str) and lengths == "paper"
    batch = make_sft_batch(
        batch_size=batch_size, seq_len=seq_len, vocab_size=model.config.vocab_size, seed=seed, padding=paper
    )
    if paper or lengths is None:
        return batch
    mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    return SFTBatch(batch.input_ids, mask, batch.input_ids.masked_fill(mask == 0, -100))


def left_padded_batch(model, *, seq_len: int, spans, seed: int = 0) -> SFTBatch:
    """Random ids; spans: per row the real tokens [first, last) (left padding before, right padding
    after). Labels are the ids, -100 on pads and on each row's first real token (a pad predicts it)."""
    ids = torch.randint(
        0, model.config.vocab_size, (len(spans), seq_len), generator=torch.Generator().manual_seed(seed)
    )
    positions = torch.arange(seq_len)[None, :]
    first, last = (torch.tensor(bound)[:, None] for bound in zip(*spans))
    mask = ((positions >= first) & (positions < last)).long()
    labels = ids.masked_fill((mask == 0) | (positions == first), -100)
    return SFTBatch(ids.masked_fill(mask == 0, 0), mask, labels)


def packed_rows(model, *, doc_lengths, seed: int = 0):
    """Padding-free rows as TRL's collator packs them: per row its documents' lengths; position_ids
    0, 1, ... per document, the first label of each document -100. A trailing 1-token document
    stands for a pad (pad_to_multiple_of). Returns input_ids, labels, position_ids, all (B, T)."""
    seq_len = sum(doc_lengths[0])
    assert all(sum(row) == seq_len for row in doc_lengths), "every row must have the same length"
    ids = torch.randint(
        0, model.config.vocab_size, (len(doc_lengths), seq_len), generator=torch.Generator().manual_seed(seed)
    )
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in doc_lengths])
    labels = ids.masked_fill(position_ids == 0, -100)
    return ids, labels, position_ids


def grpo_rows(model, *, prompt_lengths, completion_lengths, prompt_width: int, completion_width: int, seed: int = 0):
    """A batch as TRL's GRPOTrainer builds it: prompts left-padded to prompt_width, completions
    right-padded to completion_width, concatenated. Returns input_ids, attention_mask and labels
    (B, prompt_width + completion_width), labels on the completion tokens only."""
    seq_len = prompt_width + completion_width
    ids = torch.randint(
        0, model.config.vocab_size, (len(prompt_lengths), seq_len), generator=torch.Generator().manual_seed(seed)
    )
    positions = torch.arange(seq_len)[None, :]
    first = prompt_width - torch.tensor(prompt_lengths)[:, None]
    last = prompt_width + torch.tensor(completion_lengths)[:, None]
    mask = ((positions >= first) & (positions < last)).long()
    labels = ids.masked_fill((mask == 0) | (positions < prompt_width), -100)
    return ids.masked_fill(mask == 0, 0), mask, labels


@dataclass(frozen=True)
class ObjectiveBatch:
    """A batch for the methods registry whose objective `make()` builds (any objective and options)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    labels: torch.Tensor
    make: Callable[[], Objective]

    def objective(self) -> Objective:
        return self.make()


def cli_env() -> dict[str, str]:
    """A small environment for a CLI subprocess: wide columns, this interpreter's bin/ on PATH, the
    thread count, and PYTHONPATH, so that `PYTHONPATH=$PWD pytest` in a git worktree runs the
    worktree's code in the subprocess too, not the editable install's."""
    env = {"COLUMNS": "160", "PATH": str(Path(sys.executable).parent)}
    for name in ("PYTHONPATH", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "HF_HUB_CACHE"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker: keywords hold the tests/gpu/ folder's name too
            item.add_marker(skip)


def release_device_memory(cuda=None) -> None:
    """Drop what the tests left behind and hand the caching allocator's free blocks back to the
    driver (`cuda`: torch.cuda or a stand-in), so the next test, or a worker process it starts,
    finds the device as free as this process can leave it. A failed test's frames (its model, its
    gradients) stay alive in sys.last_traceback, which pytest keeps for post-mortem debugging;
    models in reference cycles wait for the collector."""
    cuda = cuda or torch.cuda
    for name in ("last_exc", "last_type", "last_value", "last_traceback"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    if cuda.is_initialized():  # never initialise CUDA only to empty it
        cuda.empty_cache()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a gpu-marked test and everything it set up is torn down (a module-scoped fixture's
    tensors too, at the module's last test, which an autouse fixture's teardown would run before),
    release device memory: a later test's worker then measures an empty device, not this
    process's cache of the tests before it."""
    try:
        return (yield)
    finally:
        if item.get_closest_marker("gpu") is not None:
            release_device_memory()


# Each test's outcome and failure text as it finishes, one JSON line each, to the file named by
# TEST_REPORT_ENV (sbp selftest sets it): what finished is on disk even when the run is killed at
# its time limit, before pytest prints its own summary. Lines: {"event": "collected", "tests":
# [...]}, {"event": "start", "test": id}, {"event": "result", "test", "when", "outcome",
# "seconds", "message"}.
REPORT_MESSAGE_CHARS = 4000


def _report(record: dict) -> None:
    path = os.environ.get(TEST_REPORT_ENV)
    if path:
        with open(path, "a") as out:  # opened and closed per line: nothing waits in a buffer
            out.write(json.dumps(record) + "\n")


def pytest_collection_finish(session):
    _report({"event": "collected", "tests": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location):
    _report({"event": "start", "test": nodeid})


def pytest_runtest_logreport(report):
    if report.when != "call" and report.outcome == "passed":
        return  # a passing set-up or teardown says nothing; a failing one (an error) does
    message = ""
    if report.failed:
        message = report.longreprtext[-REPORT_MESSAGE_CHARS:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])  # (file, line, reason)
    _report(
        {
            "event": "result",
            "test": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "seconds": round(report.duration, 2),
            "message": message,
        }
    )


@pytest.fixture
def fake_seeding(monkeypatch):
    """`sbp maxlen` with fake isolated points (ok up to T=300) and a fake simulated search that
    answers 296; the seed's own rules (runner/simulated_search.py) run as they are."""
    import sbpbench.runner.isolated as isolated_module
    import sbpbench.runner.simulated_search as simulated_search
    from sbpbench.records import ResultRow
    from sbpbench.workload.rows import spec_fields

    asked: list = []  # the MaxlenSpecs the seed was asked for

    def measure(spec, env) -> ResultRow:
        row = ResultRow(**spec_fields(spec))
        row.device_name, row.status = env.device_name, "ok" if spec.seq_len <= 300 else "oom"
        return row

    def simulated_max_len(search, out, *, probing, **options) -> ResultRow:
        asked.append(search)
        row = ResultRow(**spec_fields(search.base))
        row.status, row.max_seq_len, row.oom_seq_len = "ok", 296, 304
        return row

    monkeypatch.setattr(isolated_module, "run_isolated", measure)
    monkeypatch.setattr(simulated_search, "simulated_max_len", simulated_max_len)
    return asked
