"""Shared helpers: tiny models of every supported family and the paper-style batches."""

from __future__ import annotations

import os
import sys
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

from sbpbench.data import SFTBatch, make_sft_batch
from sbpbench.models import build_model

FAMILIES = ("tiny/qwen3", "tiny/qwen2", "tiny/llama", "tiny/mistral", "tiny/gemma3")


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
        if "gpu" in item.keywords:
            item.add_marker(skip)
