"""Odd and bad input across the commands: each a one-line refusal or notice before any work,
never a traceback, and a results file given as --out keeps its rows."""

from __future__ import annotations

import errno
import importlib
import tempfile

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app

runner = CliRunner()
PEERS_CSV = "results/cpu/peers_cpu.csv"  # a measured results file in the repository


def _line(result) -> str:
    return " ".join(result.output.split())


def test_estimate_keeps_every_method_when_one_cannot_be_modelled():
    """official and liger are reported as unsupported rows with their reason; bp's estimate is kept."""
    result = runner.invoke(
        app, ["estimate", "--model", "Qwen/Qwen3-0.6B", "--seq", "256", "--method", "official,liger,bp"]
    )
    assert result.exit_code == 0 and result.exception is None, result.output
    assert "official: unsupported:" in _line(result) and "liger: unsupported:" in _line(result)
    assert "bp: ok" in result.output and "peak GiB" in result.output


def test_an_exactness_csv_that_is_not_one_is_one_line(tmp_path):
    """`sbp report --exactness` given a results CSV or another program's CSV says it lacks columns."""
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    for given in (other, PEERS_CSV):
        result = runner.invoke(app, ["report", PEERS_CSV, "--exactness", str(given)])
        assert result.exit_code == 2 and "is not an exactness CSV" in _line(result), result.output


def test_a_non_numeric_error_in_an_exactness_csv_names_its_line(tmp_path):
    """A grad_rel_error that is not a number is refused with its file, line and column."""
    bad = tmp_path / "ex.csv"
    bad.write_text("method,reference,result,grad_rel_error,dtype\nckpt,bp,exact,abc,fp32\n")
    result = runner.invoke(app, ["report", PEERS_CSV, "--exactness", str(bad)])
    assert result.exit_code == 2 and "line 2, column grad_rel_error: 'abc'" in _line(result), result.output


def test_plot_out_a_regular_file_is_refused(tmp_path):
    """`sbp plot --out FILE` where FILE exists and is not a folder: one line, no figure."""
    target = tmp_path / "afile"
    target.write_text("x")
    result = runner.invoke(app, ["plot", PEERS_CSV, "--out", str(target)])
    assert result.exit_code == 2 and "is a file; pass a folder" in _line(result), result.output
    assert target.read_text() == "x"


def test_plot_out_a_folder_it_cannot_write_is_refused_before_drawing(tmp_path, monkeypatch):
    """A folder that refuses new files (as a read-only one does) is one permission line before any figure."""

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    result = runner.invoke(app, ["plot", PEERS_CSV, "--out", str(tmp_path / "ro")])
    assert result.exit_code == 2 and "permission denied" in _line(result) and ".png" not in result.output, result.output


def test_an_estimate_past_this_machines_memory_is_refused_with_its_bound(monkeypatch):
    """`sbp estimate --seq 1e9` is refused before any fake run, naming the usable memory and the longest --seq."""
    estimate_module = importlib.import_module(
        "sbpbench.simulate.estimate"
    )  # the package exports a function of that name

    monkeypatch.setattr(estimate_module, "available_ram_bytes", lambda: 16 << 30)
    result = runner.invoke(app, ["estimate", "--model", "tiny/qwen3", "--seq", "1000000000", "--method", "bp"])
    assert result.exit_code == 2 and "12.8 GiB is usable; give --seq 286331153 or less" in _line(result), result.output
    assert "simulating" not in result.output


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [("--num-layers", "999", "more than tiny/qwen3's 2 layers"), ("--lora-rank", "100000", "hidden size 64")],
)
def test_sizes_past_the_models_are_refused(flag, value, says):
    """--num-layers past the model's depth and --lora-rank past its hidden size are one line before any work."""
    for command in (["run", "--device", "cpu"], ["estimate"]):
        result = runner.invoke(app, [*command, "--model", "tiny/qwen3", "--seq", "16", flag, value])
        assert result.exit_code == 2 and says in _line(result), result.output


@pytest.mark.parametrize("scale", [1.0, 1.05], ids=["as-computed", "off-by-5%"])
def test_bf16_check_judges_by_bps_own_error_against_fp64(monkeypatch, scale):
    """bf16: streambp is exact within a few times bp's own error from fp64, and differs when its gradients are 5% off."""
    from sbpbench.methods import exactness

    real = exactness.step_gradients

    def steps(method, model, batch, settings):
        loss, grads = real(method, model, batch, settings)
        if method == "streambp":
            grads = {name: g * scale for name, g in grads.items()}
        return loss, grads

    monkeypatch.setattr(exactness, "step_gradients", steps)
    args = ["check", "--dtype", "bf16", "--model", "tiny/qwen3", "--seq", "32", "--method", "streambp"]
    result = runner.invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert ("DIFFERS" in result.output) == (scale != 1.0) and result.exit_code == (scale != 1.0), result.output


TINY = ["--model", "tiny/qwen3", "--seq", "16"]
SIM = ["maxlen", "--simulate", *TINY]
POINT_COMMANDS = {  # each command that takes a point, as it is given one
    "run": ["run", "--device", "cpu", *TINY],
    "estimate": ["estimate", *TINY],
    "maxlen": ["maxlen", "--device", "cpu", *TINY],
    "maxlen-simulate": SIM,
    "check": ["check", *TINY],
}
BAD_VALUES = [  # (flags, what the one error line says)
    (["--seq", "abc"], "must be an integer"),
    (["--seq", "1.5"], "must be an integer"),
    (["--batch", "x"], "must be an integer"),
    (["--num-layers", "999"], "more than tiny/qwen3's 2 layers"),
    (["--lora-rank", "100000"], "hidden size 64"),
    (["--lora-rank", "many"], "must be an integer"),
    (["--method", "nope"], "unknown --method 'nope'"),
    (["--model", "nope/none-such"], "error:"),
    (["--model", "./no-such-dir"], "error:"),
    (["--dtype", "fp8"], "--dtype"),
    (["--objective", "ppo"], "--objective"),
    (["--chunk-size", "T/0"], "--chunk-size"),
    (["--chunk-size", "lots"], "--chunk-size"),
    (["--set", "nosuch=1"], "unknown knob"),
    (["--set", "mlp_tile_size"], "KNOB=VALUE"),
    (["--set", "fp32_grad_accumulation=maybe"], "true or false"),
    (["--seq", "0"], "--seq must be at least 2"),
    (["--seq", "-5"], "--seq must be at least 2"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--lora-rank", "-1"], "--lora-rank must be at least 0"),
    (["--num-layers", "0"], "--num-layers must be an integer >= 1"),
    (["--prompt-len", "-3"], "--prompt-len must be at least 1"),
    (["--seed", "x"], "--seed must be an integer"),
    (["--nproc", "0"], "--nproc must be at least 1"),
]
CASES = [
    pytest.param([*command, *flags], says, id=f"{name}{' '.join(flags)}")
    for name, command in POINT_COMMANDS.items()
    for flags, says in BAD_VALUES
    if not (name == "check" and flags[0] == "--nproc")  # sbp check runs one process: no --nproc
] + [
    pytest.param([*SIM, "--device", "cpu"], "--device does not apply to --simulate", id="simulate-device"),
    pytest.param([*SIM, "--memory-limit", "80GiB", "--gpu-memory", "40GiB"], "give one of them", id="two-budgets"),
    pytest.param([*SIM, "--set", "chunk_attention=upper-left"], "not modelled by the estimator", id="simulate-knob"),
    pytest.param([*SIM, "--gpu-memory", "40"], "--gpu-memory", id="size-without-unit"),
    pytest.param(["maxlen", *TINY, "--gpu-memory", "40GiB"], "add --simulate", id="gpu-memory-measured"),
    pytest.param(["estimate", *TINY, "--target", "tpu"], "unknown --target", id="estimate-target"),
    pytest.param(["estimate", *TINY, "--gpu-memory", "lots"], "--gpu-memory", id="estimate-gpu-memory"),
    pytest.param(["run", "--device", "cpu", *TINY, "--memory-limit", "12"], "--memory-limit", id="limit-no-unit"),
    pytest.param(["run", "--device", "tpu", *TINY], "--device", id="run-device"),
    pytest.param(["report", "no/such/dir"], "error:", id="report-missing"),
    pytest.param(["plot", "no/such/dir"], "error:", id="plot-missing"),
    pytest.param(["report", PEERS_CSV, "--glance", "--points"], "give one", id="report-two-summaries"),
    pytest.param(["sweep", "no/such.toml"], "error:", id="sweep-missing"),
]


@pytest.mark.parametrize(("args", "says"), CASES)
def test_bad_input_is_one_error_line_and_an_ok_row_survives(tmp_path, args, says):
    """Each bad input: exit 2, no traceback, one `error:` line saying what is wrong; a results file given as --out keeps its ok row."""
    from sbpbench.records import ResultRow, read_rows, upsert_rows

    out = tmp_path / "kept.csv"
    upsert_rows(out, [ResultRow(status="ok", model="tiny/qwen3", method="bp", seq_len=16)])
    writes = args[0] in ("run", "estimate", "maxlen", "sweep")
    result = runner.invoke(app, [*args, *(["--out", str(out)] if writes else [])])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in _line(result), result.output
    assert [r["status"] for r in read_rows(out)] == ["ok"]
