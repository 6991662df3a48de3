"""The `sbp` command line: exit codes, tables, one-line errors."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app

runner = CliRunner()


def test_check_reports_exact_methods():
    """`sbp check` on a tiny model prints every method that runs on a CPU as exact (liger as
    unsupported) and exits 0."""
    methods = ["ckpt", "streambp", "ckpt-offload", "ckpt-chunked-ce", "tiled", "liger"]
    args = ["check", "--model", "tiny/gemma3", "--seq", "30", "--chunk-size", "7", "--set", "mlp_tile_size=7"]
    result = runner.invoke(app, [*args, "--method", *methods])
    assert result.exit_code == 0, result.output
    assert result.output.count("exact") == 5 and "DIFFERS" not in result.output
    assert "unsupported" in result.output


def test_check_appends_a_row_per_compared_method(tmp_path):
    """`sbp check --out` appends one row per method compared with bp, with its point and provenance;
    in fp32, bp's own step against fp64 is shown but not written."""
    from sbpbench.records.exactness import read_exactness

    out = tmp_path / "exactness.csv"
    args = ["check", "--model", "tiny/qwen3", "--seq", "16", "--chunk-size", "5", "--method", "ckpt", "streambp"]
    result = runner.invoke(app, [*args, "--dtype", "fp32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"2 comparison(s) appended to {out}" in " ".join(result.output.split())
    rows = read_exactness(out)
    assert [(r["method"], r["result"], r["dtype"], r["seq_len"]) for r in rows] == [
        ("ckpt", "exact", "fp32", "16"),
        ("streambp", "exact", "fp32", "16"),
    ]
    assert "chunk_size=5" in rows[1]["settings"] and rows[1]["torch_version"]


def test_check_unknown_model_is_a_one_line_error():
    """An unknown model gives `error: ...` naming the known models, exit 2, no traceback."""
    result = runner.invoke(app, ["check", "--model", "nope/nope"])
    assert result.exit_code == 2
    assert "unknown model 'nope/nope'" in result.output and "Traceback" not in result.output


def test_check_refuses_cuda_without_a_gpu():
    """`sbp check --device cuda` on a machine without a GPU: exit 2 and a message saying so."""
    result = runner.invoke(app, ["check", "--model", "tiny/qwen3", "--device", "cuda"])
    assert result.exit_code == 2 and "no CUDA GPU" in result.output


def test_models_lists_the_registry():
    """`sbp models` lists real and tiny names of the registry."""
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    for name in ("Qwen/Qwen3-32B", "meta-llama/Llama-3.1-8B", "tiny/gemma3"):
        assert name in result.output


@pytest.mark.slow
def test_console_script_is_installed():
    """The installed `sbp` entry point runs in a fresh process."""
    beside_python = Path(sys.executable).parent / "sbp"
    script = str(beside_python) if beside_python.exists() else shutil.which("sbp")
    assert script, "the sbp console script is not installed"
    done = subprocess.run([script, "--help"], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "check" in done.stdout


def test_check_grpo_and_dpo_with_lora():
    """`sbp check --objective grpo|dpo --lora-rank 4`: ckpt and streambp exact on a tiny model (the
    peers: tests/exactness/test_peers.py)."""
    for objective in ("grpo", "dpo"):
        args = ["check", "--model", "tiny/llama", "--seq", "30", "--chunk-size", "7", "--objective", objective]
        args += ["--method", "ckpt", "streambp"]
        result = runner.invoke(app, [*args, "--lora-rank", "4", "--batch", "4"])
        assert result.exit_code == 0, result.output
        assert result.output.count("exact") == 2 and "DIFFERS" not in result.output


def test_check_of_an_unseen_architecture_prints_its_self_check(tmp_path):
    """A local config of an architecture CI does not verify (OLMo 2): `sbp check` first prints its
    self-check's verdict; an architecture its self-check refuses (MiniMax's lightning attention) is one
    line, exit 2."""
    from transformers import AutoConfig

    from sbpbench.core.architecture.small_copy import small_config

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    AutoConfig.for_model("olmo2", num_key_value_heads=2, vocab_size=512, **sizes).save_pretrained(tmp_path / "olmo2")
    small_config(AutoConfig.for_model("minimax")).save_pretrained(tmp_path / "next")
    result = runner.invoke(app, ["check", "--model", str(tmp_path / "olmo2"), "--seq", "16", "--method", "streambp"])
    assert result.exit_code == 0, result.output
    assert "StreamBP streams Olmo2ForCausalLM: its self-check (a small float64 copy) agrees" in result.output
    result = runner.invoke(app, ["check", "--model", str(tmp_path / "next"), "--seq", "16", "--method", "streambp"])
    assert result.exit_code == 2  # a user error, before any work
    assert "self-check of MiniMaxForCausalLM differs" in result.output and "Traceback" not in result.output
