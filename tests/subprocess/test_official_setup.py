"""`sbp peers setup official` on this environment's torch: the virtualenv sees torch and torch's
requirements from here and nothing else of ours (runner/parent_torch.py), and it builds from carried
wheels with no package index, as a GPU machine without one must (docs/reproducing.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sbpbench.runner.official import REQUIREMENTS, setup_commands
from sbpbench.runner.parent_torch import link_parent_torch, requirement_closure

from ..cli.test_cli_run import _sbp
from ..conftest import cli_env


def test_torch_closure_holds_its_requirements_and_nothing_that_needs_our_transformers():
    names = {dist.metadata["Name"].lower().replace("_", "-") for dist in requirement_closure("torch")}
    assert {"torch", "filelock", "sympy", "mpmath", "jinja2", "networkx"} <= names
    assert not names & {"transformers", "huggingface-hub", "tokenizers", "datasets", "accelerate", "trl", "peft"}


@pytest.mark.slow  # over 3 s on 2 cores
def test_a_linked_virtualenv_imports_this_torch_and_none_of_our_other_packages(tmp_path):
    """In a bare virtualenv (no pip, nothing installed) with the link: torch imports, the same
    version from this environment; transformers and datasets do not (a leaked datasets built for our
    huggingface_hub is what broke `from transformers import Trainer` in the peer's environment)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    links = link_parent_torch(venv)
    probe = (
        "import importlib.util as u, torch; "
        "print(torch.__version__, u.find_spec('transformers') is None, u.find_spec('datasets') is None)"
    )
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True)
    import torch

    assert out.stdout.split() == [torch.__version__, "True", "True"]
    assert (links / "torch").resolve() == Path(torch.__file__).resolve().parent


def test_setup_with_wheels_never_asks_the_index():
    commands = setup_commands(Path("/v"), Path("/w"))
    pip = next(c for c in commands if "pip" in c)
    assert pip[pip.index("--no-index") + 1 :][:2] == ["--find-links", "/w"] and pip[-len(REQUIREMENTS) :] == list(
        REQUIREMENTS
    )
    assert not any("torch==" in part for command in commands for part in command)  # torch is linked, not installed
    assert "--no-index" not in next(c for c in setup_commands(Path("/v")) if "pip" in c)


@pytest.mark.slow  # over 3 s on 2 cores
def test_wheels_that_are_not_a_folder_are_one_line_exit_2(tmp_path):
    result = subprocess.run(
        [_sbp(), "peers", "setup", "official", "--path", str(tmp_path / "v"), "--wheels", str(tmp_path / "nowhere")],
        check=False, capture_output=True, text=True, env=cli_env(),
    )  # fmt: skip
    assert result.returncode == 2 and "is not a directory" in result.stderr
    assert not (tmp_path / "v").exists()


@pytest.fixture(scope="session")
def official_venv(tmp_path_factory) -> Path:
    """The official peer's virtualenv built as on a machine without an index: its wheels
    downloaded first (here, from the index this machine has), then setup from them alone."""
    root = tmp_path_factory.mktemp("official")
    wheels = root / "wheels"
    download = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:"]
    subprocess.run([*download, "-d", str(wheels), *REQUIREMENTS], check=True)
    venv = root / "venv"
    setup = subprocess.run(
        [_sbp(), "peers", "setup", "official", "--path", str(venv), "--wheels", str(wheels)],
        check=False, capture_output=True, text=True, env=cli_env(),
    )  # fmt: skip
    assert setup.returncode == 0, setup.stdout[-2000:] + setup.stderr[-2000:]
    assert "transformers 4.51.3" in setup.stdout
    return venv


@pytest.mark.slow
def test_the_official_code_runs_from_a_virtualenv_built_from_wheels(official_venv, tmp_path):
    out = tmp_path / "rows.csv"
    args = ["run", "--device", "cpu", "--model", "tiny/qwen3", "--seq", "64", "--method", "official", "--out", str(out)]
    result = subprocess.run(
        [_sbp(), *args],
        check=False,
        capture_output=True,
        text=True,
        env={**cli_env(), "SBP_OFFICIAL_VENV": str(official_venv)},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    from sbpbench.records import read_rows

    (row,) = read_rows(out)
    assert row["status"] == "ok", row["error"]


@pytest.mark.slow
def test_official_is_exact_but_for_its_normalisation(official_venv, monkeypatch):
    """Measured, not assumed: the official code (streambp 1.0) divides the summed loss by the number
    of labelled tokens, not of predicted ones (one more per row), so with one row and one logits
    chunk its loss and gradients are bp's times N_targets / N_labels, to float32 rounding (its
    loss is float32). With several rows and several logits chunks its per-chunk token counts are
    off too (it subtracts one boundary token per chunk, not per row): the error is larger."""
    from sbpbench.config import point_specs
    from sbpbench.methods.exactness import step_gradients
    from sbpbench.runner.official import official_gradients
    from sbpbench.settings import EXACTNESS_DEFAULTS
    from sbpbench.workload.build import build_model_and_batch

    monkeypatch.setenv("SBP_OFFICIAL_VENV", str(official_venv))

    def run(seq_len, batch_size, logits_chunk):
        values = {
            "model": "tiny/qwen3",
            "seq_len": seq_len,
            "batch_size": batch_size,
            "logits_chunk_size": logits_chunk,
        }
        bp, official = point_specs(values, ("bp", "official"), defaults=EXACTNESS_DEFAULTS)
        model, batch = build_model_and_batch(official)
        ref_loss, ref = step_gradients("bp", model, batch, bp.settings)
        loss, grads = official_gradients(official, model)
        labels = batch.labels
        scale = int((labels[:, 1:] != -100).sum()) / int((labels != -100).sum())
        worst = max(float((grads[n] / scale - g).abs().max() / g.abs().max()) for n, g in ref.items())
        return float(loss / ref_loss), scale, worst

    ratio, scale, worst = run(30, 1, 100)
    assert ratio == pytest.approx(scale, rel=1e-6) and scale < 1
    assert worst < 1e-6
    ratio, scale, worst = run(64, 3, 16)
    assert worst > 1e-3  # not a rescaling any more: per-chunk counts are wrong with several rows
