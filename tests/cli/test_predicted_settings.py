"""`sbp estimate` and `sbp plan` take what the settings table says the estimator models, and refuse
the rest at any value but its default, in one line, before any spec is made."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

import sbpbench.config
from sbpbench.cli import app
from sbpbench.cli.docs_page import render_help
from sbpbench.cli.flags import FLAGS
from sbpbench.settings import SETTINGS
from sbpbench.settings.table import NOT_ESTIMATED, has_flag, not_estimated

runner = CliRunner()
TINY = ["--model", "tiny/qwen3", "--seq", "64"]


class SpecsMade(Exception):
    """Raised in place of the work that follows the specs: the test has what it needs."""


@pytest.fixture
def made(monkeypatch) -> list:
    """The specs the command made; the command stops there (SpecsMade)."""
    specs = []
    real = sbpbench.config.point_specs

    def point_specs(*args, **kwargs):
        specs.extend(real(*args, **kwargs))
        raise SpecsMade

    monkeypatch.setattr(sbpbench.config, "point_specs", point_specs)
    return specs


@pytest.mark.parametrize(
    ("argv", "name", "flag"),
    [
        (["estimate", "--set", "chunk_attention=split"], "chunk_attention", "--set chunk_attention"),
        (["estimate", "--set", "chunk_attention=lower-right"], "chunk_attention", "--set chunk_attention"),
        (["estimate", "--gpus", "2", "--set", "sp_layout=interleaved"], "sp_layout", "--set sp_layout"),
        (["estimate", "--sdpa-backend", "math"], "sdpa_backend", "--sdpa-backend"),
        (["estimate", "--memory-limit", "80GiB"], "memory_limit", "--memory-limit"),
        (["plan", "--set", "chunk_attention=flex"], "chunk_attention", "--set chunk_attention"),
        (["plan", "--weights"], "weights", "--weights"),
        (["plan", "--device", "cuda"], "device", "--device"),
    ],
)
def test_a_setting_the_estimator_does_not_model_is_refused_first(made, argv, name, flag):
    """A setting the table marks not modelled, given at another value than its default, is one line
    naming it as typed, that the estimator does not model it, and what to do; no spec is made."""
    result = runner.invoke(app, [*argv, *TINY])
    expected = f"error: invalid input: {flag} is not modelled by the estimator: {not_estimated(name)}"
    assert result.exit_code == 2 and result.output.strip() == expected, result.output
    assert made == []


def test_a_modelled_knob_and_an_unmodelled_one_at_its_default_reach_the_spec(made):
    """A knob the estimator models reaches the predicted point's spec; one it does not model is taken
    at its default; plan's StreamBP point gets them alike."""
    argv = ["--set", "fp32_grad_accumulation=off", "--set", "chunk_attention=auto", *TINY]
    result = runner.invoke(app, ["estimate", "--method", "streambp", *argv])
    assert isinstance(result.exception, SpecsMade), result.output
    result = runner.invoke(app, ["plan", *argv])
    assert isinstance(result.exception, SpecsMade), result.output
    assert [(s.method, s.settings.fp32_grad_accumulation, s.settings.chunk_attention) for s in made] == [
        ("streambp", False, "auto"),
        ("streambp", False, "auto"),
    ]
    result = runner.invoke(app, ["estimate", "--method", "tiled", "--set", "mlp_tile_size=16", *TINY])
    assert isinstance(result.exception, SpecsMade) and made[-1].settings.mlp_tile_size == 16
    result = runner.invoke(app, ["estimate", "--method", "tiled", "--set", "offload_checkpoints=off", *TINY])
    assert isinstance(result.exception, SpecsMade) and made[-1].settings.offload_checkpoints is False


def test_what_is_refused_stays_out_of_the_help():
    """The helps of `sbp estimate` and `sbp plan` show no flag of a setting they refuse, and their
    `--set help` marks each knob they refuse."""
    refused = "|".join(FLAGS[name] for name in NOT_ESTIMATED if has_flag(name))
    for command in ("estimate", "plan"):
        options = re.findall(rf"^ +(?:-\w, )?({refused})\b", render_help(command), flags=re.MULTILINE)
        assert options == [], command
        lines = runner.invoke(app, [command, "--set", "help"]).output.splitlines()
        marked = {line.split("=")[0] for line in lines if "Not modelled by the estimator" in line}
        assert marked == {line.split("=")[0] for line in lines} & set(NOT_ESTIMATED), command
    assert {"chunk_attention", "sp_layout"} <= set(NOT_ESTIMATED) and SETTINGS["chunk_size"].estimator
