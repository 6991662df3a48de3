"""The trainer code the pages show runs as written on a CPU: docs/trainers.md's StreamBPSFTTrainer
example, and its script that compares our updates with the stock trainer's. Each block is
read from its page, so the page cannot drift from what runs."""

from __future__ import annotations

import contextlib
import io
import re
import warnings

import pytest

from ..conftest import REPOSITORY, needs_trl

pytestmark = [needs_trl, pytest.mark.slow]  # each trains a tiny model through TRL: 5 to 15 s


def python_block(page: str, heading: str) -> str:
    """The first ```python block after `heading` in a page of the repository."""
    text = (REPOSITORY / page).read_text()
    start = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[start:], flags=re.S).group(1)


def run_block(code: str) -> tuple[dict, str, list]:
    """Run a page's code as a script (its own globals); its namespace, what it printed, its warnings."""
    namespace: dict = {"__name__": "__main__"}
    printed = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
        warnings.simplefilter("always")
        exec(compile(code, "<page>", "exec"), namespace)
    return namespace, printed.getvalue(), caught


def test_the_trainers_page_example_runs_as_written(tmp_path, monkeypatch):
    """docs/trainers.md's first example trains 3 steps on a CPU as pasted: no bf16 error, no missing
    processing class, and none of sbpbench's or transformers' warnings about checkpointing."""
    monkeypatch.chdir(tmp_path)  # it writes output_dir="out"
    namespace, _, caught = run_block(python_block("docs/trainers.md", "## A first run on a CPU"))
    assert namespace["trainer"].state.global_step == 3
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "checkpointing" in m], messages


def test_the_trainers_page_check_measures_float32_rounding(tmp_path, monkeypatch):
    """docs/trainers.md's check script, as a user runs it (stock loss kernels in float32): the
    updates differ by float32 rounding, about 4e-7 with SGD and 2e-2 with AdamW as the page says,
    more than fp64 rounding and far less than a wrong gradient would give."""
    monkeypatch.chdir(tmp_path)
    _, printed, _ = run_block(python_block("docs/trainers.md", "## How close to the stock trainer"))
    found = dict(re.findall(r"(\w+): the parameter updates differ by at most (\S+) \(relative\)", printed))
    assert set(found) == {"sgd", "adamw_torch"}, printed
    assert 1e-9 < float(found["sgd"]) <= 4e-6, printed
    assert 1e-9 < float(found["adamw_torch"]) <= 0.1, printed
