"""Odd and bad input across the commands: each a one-line refusal or notice before any work,
never a traceback, and a results file given as --out keeps its rows."""

from __future__ import annotations

import errno
import importlib
import importlib.util
import tempfile

import pytest
import typer
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.measure import environment

runner = CliRunner()
PEERS_CSV = "results/cpu/peers_cpu.csv"  # a measured results file in the repository
NO_GPU = pytest.mark.skipif(environment.auto_device() != "cpu", reason="NVML sees a GPU here")
# without the extra, ulysses is refused first as not installed: the default tier passes either way
NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs .[deepspeed]")
WITHOUT_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="has .[deepspeed]")


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
RUN = ["run", "--device", "cpu", *TINY]
MEASURED = ["maxlen", "--device", "cpu", *TINY]
PLAN = ["plan", *TINY]
SMOKE = "experiments/smoke_cpu.toml"
SP2 = [*RUN, "--nproc", "2", "--sp", "2"]  # 2 ranks sharing each sequence
SP4_T18 = ["run", "--device", "cpu", "--model", "tiny/qwen3", "--seq", "18", "--nproc", "4", "--sp", "4"]
POINT_COMMANDS = {  # each command that takes a point, as it is given one
    "run": RUN,
    "estimate": ["estimate", *TINY],
    "maxlen": MEASURED,
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
    # a point's odd combinations and values beyond the shared table's
    pytest.param([*RUN, "--timeline", "--nproc", "2"], "--timeline records one process's step", id="timeline-ranks"),
    # ranks sharing each sequence (--sp): a divisor of --nproc, methods that can, a T and heads they split
    pytest.param([*RUN, "--sp", "0"], "--sp must be at least 1", id="run-sp-zero"),
    pytest.param([*RUN, "--nproc", "4", "--sp", "3"], "does not divide --nproc 4: give --sp 1, 2 or 4", id="sp-3"),
    pytest.param([*SP2, "--method", "bp", "ckpt"], "--method bp, ckpt cannot share a sequence", id="sp-bp-ckpt"),
    pytest.param([*RUN, "--method", "ulysses"], "ulysses runs only on ranks sharing each sequence", id="ulysses-sp-1"),
    pytest.param([*RUN, "--nproc", "8", "--sp", "8"], "--sp 8 cannot split tiny/qwen3's 4 query", id="sp-heads"),
    pytest.param(
        [*SP4_T18, "--method", "ulysses"],
        "--seq 18 is not a multiple of --sp 4",
        id="ulysses-seq",
        marks=NEEDS_DEEPSPEED,
    ),
    pytest.param(
        [*SP4_T18, "--method", "ulysses"],
        "ulysses needs DeepSpeed, an optional extra",
        id="ulysses-no-extra",
        marks=WITHOUT_DEEPSPEED,
    ),
    pytest.param(
        ["estimate", *TINY, "--nproc", "3", "--sp", "2"], "--sp 2 does not divide --nproc 3", id="estimate-sp"
    ),
    pytest.param(["estimate", *TINY, "--sp", "2"], "give --gpus N too, N a multiple of 2", id="estimate-sp-alone"),
    pytest.param([*RUN, "--set", "sp_layout=interleaved"], "add --sp 2 or more", id="run-layout-alone"),
    pytest.param([*RUN, "--set", "sp_layout=diagonal"], "choose from contiguous, interleaved", id="run-layout"),
    pytest.param(
        ["estimate", *TINY, "--gpus", "2", "--set", "sp_layout=interleaved"],
        "it predicts the contiguous layout",
        id="estimate-layout",
    ),
    pytest.param(["plan", *TINY, "--gpus", "4", "--sp", "1"], "give --sp 2 or more", id="plan-gpus-sp1"),
    pytest.param([*RUN, "--protocol", "later"], "unknown --protocol 'later'", id="run-protocol"),
    pytest.param([*RUN, "--step", "adam"], "unknown --step 'adam'", id="run-step"),
    pytest.param([*RUN, "--sdpa-backend", "cudnn"], "cudnn has no CPU kernel", id="run-cpu-sdpa"),
    pytest.param([*RUN, "--set", "chunk_attention=fa3"], "fa3 has no CPU kernel", id="run-cpu-chunk-kernel"),
    pytest.param([*RUN, "--checkpoints", "recompute:0"], "--checkpoints must be one of", id="run-placement"),
    pytest.param([*RUN, "--set", "mlp_tile_size=0"], "--set mlp_tile_size must be an integer >= 1", id="run-tile"),
    pytest.param(["estimate", *TINY, "--host-memory", "12"], "'12' has no unit", id="estimate-host-no-unit"),
    # a search's own settings and the options that apply to one kind of search only
    pytest.param([*MEASURED, "--resolution", "abc"], "--resolution 'abc'", id="maxlen-resolution"),
    pytest.param([*MEASURED, "--multiple-of", "0"], "--multiple-of must be at least 1", id="maxlen-multiple"),
    pytest.param([*MEASURED, "--max-seq", "8"], "--max-seq must be at least the first probe", id="maxlen-ceiling"),
    pytest.param([*SIM, "--budget", "5m"], "drop it with --simulate", id="simulate-budget"),
    pytest.param([*MEASURED, "--exact"], "--exact is how --simulate predicts", id="maxlen-exact"),
    # sbp plan, sbp check, sbp selftest, sbp peers, sbp env
    pytest.param([*PLAN, "--gpu-memory", "40"], "'40' has no unit", id="plan-gpu-memory"),
    pytest.param([*PLAN, "--host-memory", "lots"], "cannot read the size 'lots'", id="plan-host-memory"),
    pytest.param([*PLAN, "--seq", "abc"], "--seq must be an integer", id="plan-seq"),
    pytest.param(["plan", "--model", "nope/none-such"], "unknown model 'nope/none-such'", id="plan-model"),
    pytest.param(["check", *TINY, "--out", "{tmp}"], "is a directory", id="check-out-folder"),
    pytest.param(["selftest", "--budget", "10s"], "under 30 s", id="selftest-short-budget"),
    pytest.param(["selftest", "--budget", "soon"], "cannot read the duration 'soon'", id="selftest-budget"),
    pytest.param(["selftest", "--budget", "0"], "the duration '0' is not above zero", id="selftest-budget-0"),
    pytest.param([*MEASURED, "--budget", "0s"], "the duration '0s' is not above zero", id="maxlen-budget-0"),
    pytest.param(["peers", "setup", "official", "--wheels", "{tmp}/none"], "is not a directory", id="peers-wheels"),
    pytest.param(["env", "--device", "tpu"], "unknown device 'tpu'", id="env-device"),
    pytest.param(["env", "--device", "cuda:7"], "'cuda:7' was asked for but no CUDA GPU", id="env-cuda", marks=NO_GPU),
    # damaged or mistaken experiment files, and the sweep's own options
    pytest.param(["sweep", "{tmp}/broken.toml"], "not valid TOML", id="sweep-not-toml"),
    pytest.param(["sweep", "{tmp}/broken.toml", "--dry-run"], "not valid TOML", id="sweep-dry-run-not-toml"),
    pytest.param(["sweep", "{tmp}/binary.toml"], "binary.toml: not valid TOML: byte 0", id="sweep-binary"),
    pytest.param(["sweep", "{tmp}/renamed.toml"], "it is now called 'method'", id="sweep-old-key"),
    pytest.param(["sweep", "{tmp}/no_seq.toml", "--seeds-only"], "needed by a grid point", id="sweep-seeds-no-seq"),
    pytest.param(["sweep", "{tmp}/no_unit.toml"], "80 has no unit", id="sweep-size-no-unit"),
    pytest.param(["sweep", SMOKE, "--dry-run", "--seeds-only"], "give one of them", id="sweep-two-modes"),
    pytest.param(["sweep", "{tmp}/knobs.toml", "--device", "tpu"], "unknown device 'tpu'", id="sweep-device"),
    pytest.param(["sweep", "{tmp}/cpu.toml", "--seeds-only"], "cpu.toml runs its searches on the CPU", id="seeds-cpu"),
    # damaged results files given to the readers
    pytest.param(["report", "{tmp}/empty.csv"], "no result rows in", id="report-empty"),
    pytest.param(["report", "{tmp}/binary.csv"], "is not UTF-8 text", id="report-binary"),
    pytest.param(["report", PEERS_CSV, "--reference", "{tmp}/other.csv"], "not a paper reference CSV", id="report-ref"),
    pytest.param(["report", PEERS_CSV, "--exactness", "{tmp}/none.csv"], "no exactness CSV at", id="report-ex-missing"),
    pytest.param(["report", PEERS_CSV, "--exactness", "{tmp}/no_csv"], "is a folder", id="report-ex-folder"),
    pytest.param(["report", PEERS_CSV, "--exactness", "{tmp}/binary.csv"], "not UTF-8 text", id="report-ex-binary"),
    pytest.param(["report", PEERS_CSV, "--reference", "{tmp}/binary.csv"], "not UTF-8 text", id="report-ref-binary"),
    pytest.param(["plot", "{tmp}/header.csv"], "lacks the column(s) schema_version", id="plot-header-only"),
    pytest.param(["plot", "{tmp}/no_csv"], "no results CSV at", id="plot-empty-folder"),
    # items a user meets in the newer features: one line each, before any work
    pytest.param(["check", *TINY, "--method", "bp"], "--method bp is the fp64 reference", id="check-bp-alone"),
    pytest.param(
        ["check", *TINY, "--method", "bp", "--nproc", "2", "--sp", "2"],
        "--method bp runs in one process as the reference",
        id="check-bp-alone-ranked",
    ),
    pytest.param([*PLAN, "--seq", "1000000000"], "for the estimate's real token batches", id="plan-seq-1e9"),
    pytest.param(
        [*PLAN, "--seq", "1000000000", "--gpus", "2"], "for the estimate's real token batches", id="plan-gpus-seq-1e9"
    ),
    pytest.param([*PLAN, "--interconnect", "0"], "--interconnect '0' is not a rate", id="interconnect-0"),
    pytest.param([*PLAN, "--interconnect", "0GB/s"], "--interconnect '0GB/s' is not a rate", id="interconnect-0GB"),
    pytest.param([*PLAN, "--interconnect", "fast"], "--interconnect 'fast' is not a rate", id="interconnect-fast"),
    pytest.param([*RUN, "--trace"], "/traces, which is a file: move it aside", id="trace-folder"),
    pytest.param([*RUN, "--timeline"], "/timelines, which is a file: move it aside", id="timeline-folder"),
    pytest.param(["report", "{tmp}/sp0.csv"], "sp0.csv line 2, column sp: '0' ranks", id="csv-sp-0"),
    pytest.param(["report", "{tmp}/sp-2.csv"], "sp-2.csv line 2, column sp: '-2' ranks", id="csv-sp-negative"),
    pytest.param(["report", "{tmp}/sp4.csv"], "sp4.csv line 2, column sp: 4 ranks per sequence do not", id="csv-sp-4"),
    pytest.param(["plot", "{tmp}/diagonal.csv"], "column sp_layout: 'diagonal' is not one of", id="csv-layout"),
]


# damaged and mistaken files, written into the test's folder: a case names one as {tmp}/NAME
KNOBS_TOML = """
name = "knobs"
description = "knobs given to methods that do not read them"
[defaults]
model = "tiny/qwen3"
device = "cpu"
[[points]]
method = ["bp", "streambp"]
seq_len = 16
chunk_size = 8
[[points]]
method = "ckpt"
seq_len = 16
mlp_tile_size = 512
"""
POINT = 'name = "odd"\ndescription = "odd"\n[[points]]\nmodel = "tiny/qwen3"\n'
ODD_FILES: dict[str, str | bytes] = {
    "broken.toml": "name = [\n",
    "binary.toml": b"\xff\xfe\x00binary",
    "renamed.toml": POINT + 'seq_len = 16\nmethods = ["bp"]\n',  # the first format's key
    "no_seq.toml": POINT + 'method = "bp"\n',
    "no_unit.toml": POINT + "seq_len = 16\nmemory_limit = 80\n",
    "knobs.toml": KNOBS_TOML,
    "cpu.toml": POINT + 'kind = "maxlen"\nmethod = "bp"\ndevice = "cpu"\nmemory_limit = "1GiB"\n',
    "empty.csv": "",
    "binary.csv": b"\xff\xfe\x00\x01",
    "header.csv": "status,method\n",
    "other.csv": "a,b\n1,2\n",
    "traces": "a file where --trace makes its folder",
    "timelines": "a file where --timeline makes its folder",
    # a results row hand-edited: its rank columns (nproc, sp, sp_layout) as no run writes them
    "sp0.csv": "schema_version,status,model,method,nproc,sp\n15,ok,tiny/qwen3,bp,2,0\n",
    "sp-2.csv": "schema_version,status,model,method,nproc,sp\n15,ok,tiny/qwen3,bp,2,-2\n",
    "sp4.csv": "schema_version,status,model,method,nproc,sp\n15,ok,tiny/qwen3,bp,2,4\n",
    "diagonal.csv": "schema_version,status,model,method,nproc,sp,sp_layout\n15,ok,tiny/qwen3,bp,2,2,diagonal\n",
}


def _odd_files(folder) -> None:
    """ODD_FILES in `folder`, and an empty folder no_csv/."""
    for name, content in ODD_FILES.items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    (folder / "no_csv").mkdir()


def _kept_row(out) -> None:
    """A results file holding one ok row, which every case must leave as it was."""
    from sbpbench.records import ResultRow, upsert_rows

    upsert_rows(out, [ResultRow(status="ok", model="tiny/qwen3", method="bp", seq_len=16)])


def _writes(args: list[str]) -> bool:
    return args[0] in ("run", "estimate", "maxlen", "sweep")


@pytest.mark.parametrize(("args", "says"), CASES)
def test_bad_input_is_one_error_line_and_an_ok_row_survives(tmp_path, args, says):
    """Each bad input: exit 2, no traceback, one `error:` line saying what is wrong; a results file given as --out keeps its ok row."""
    from sbpbench.records import read_rows

    _odd_files(tmp_path)
    args = [arg.format(tmp=tmp_path) for arg in args]
    out = tmp_path / "kept.csv"
    _kept_row(out)
    result = runner.invoke(app, [*args, *(["--out", str(out)] if _writes(args) else [])])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in _line(result), result.output
    assert [r["status"] for r in read_rows(out)] == ["ok"]


USAGE_CASES = [  # what Typer refuses before the command: an option or argument a command does not take
    pytest.param(["models", "extra"], "unexpected extra argument", id="models-argument"),
    pytest.param(["peers", "setup", "nope"], "'nope' is not one of 'official'", id="peers-name"),
    pytest.param(["plan", *TINY, "--method", "bp"], "No such option: --method", id="plan-method"),
    pytest.param(["plan", *TINY, "--nproc", "2"], "No such option: --nproc", id="plan-nproc"),
]


@pytest.mark.parametrize(("args", "says"), USAGE_CASES)
def test_an_option_a_command_does_not_take_is_one_usage_error(args, says):
    """Exit 2, no traceback, and Typer's one `Error:` line after its usage line."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in result.output, result.output


NOTICE_CASES = [  # (args, the notice lines): a knob no method to run reads is said, and the command goes on
    pytest.param(
        [*RUN, "--method", "bp", "--checkpoints", "stream:2"],
        ["--checkpoints is read only by streambp; bp ignores it"],
        id="run-placement-for-bp",
    ),
    pytest.param(
        [*RUN, "--method", "ckpt", "--set", "mlp_tile_size=512", "--phases"],
        [
            "--set mlp_tile_size is read only by tiled; ckpt ignores it",
            "--phases is read only by streambp; ckpt ignores it",
        ],
        id="run-tile-and-phases-for-ckpt",
    ),
    pytest.param(
        ["estimate", *TINY, "--method", "bp", "--chunk-size", "8"],
        ["--chunk-size is read only by streambp, official; bp ignores it"],
        id="estimate-chunk-for-bp",
    ),
    pytest.param(
        [*SIM, "--method", "bp", "ckpt", "--set", "fp32_grad_accumulation=off", "--host-memory", "1TiB"],
        ["--set fp32_grad_accumulation is read only by streambp; bp, ckpt ignore it"],
        id="maxlen-accumulation-for-bp-ckpt",
    ),
    pytest.param(
        ["sweep", "{tmp}/knobs.toml", "--dry-run"],
        [
            "{tmp}/knobs.toml: chunk_size is read only by streambp, official; bp ignores it",
            "{tmp}/knobs.toml: mlp_tile_size is read only by tiled; ckpt ignores it",
        ],
        id="sweep-file-knobs",
    ),
]


@pytest.fixture
def no_work(monkeypatch):
    """Each command's work (measuring, predicting, searching, pricing) replaced by a clean exit."""
    import sbpbench.runner.searches
    import sbpbench.simulate.depth
    from sbpbench.cli import run_cmd, sweep_cmd

    def work(*args, **kwargs):
        raise typer.Exit(0)

    monkeypatch.setattr(run_cmd, "_measure_all", work)
    monkeypatch.setattr(sbpbench.simulate.depth, "estimate_point_by_depth", work)
    monkeypatch.setattr(sbpbench.runner.searches, "run_searches", work)
    monkeypatch.setattr(sweep_cmd, "_dry_run", work)


@pytest.mark.parametrize(("args", "notices"), NOTICE_CASES)
def test_a_knob_no_method_reads_is_a_notice_not_an_error(no_work, tmp_path, args, notices):
    """Exit 0, no traceback, one `notice:` line per ignored knob (none an error); --out keeps its ok row."""
    from sbpbench.records import read_rows

    _odd_files(tmp_path)
    args = [arg.format(tmp=tmp_path) for arg in args]
    out = tmp_path / "kept.csv"
    _kept_row(out)
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0 and isinstance(result.exception, (SystemExit, type(None))), result.output
    assert "Traceback" not in result.output and "error:" not in result.output, result.output
    said = [line for line in result.output.splitlines() if line.startswith("notice:")]
    assert said == [f"notice: {notice.format(tmp=tmp_path)}" for notice in notices], result.output
    assert [r["status"] for r in read_rows(out)] == ["ok"]


@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_env_refuses_a_cuda_device_when_no_gpu_is_visible(monkeypatch, device):
    """`sbp env --device cuda[:N]` where NVML sees no GPU: one line, exit 2, and torch.cuda never touched."""
    import torch

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda was touched: sbp env reads the GPU through NVML only")

    monkeypatch.setattr(environment, "pynvml", None)  # no NVML library: no GPU visible, on any machine
    monkeypatch.setattr(torch.cuda, "is_available", forbidden)
    monkeypatch.setattr(torch.cuda, "device_count", forbidden)
    result = runner.invoke(app, ["env", "--device", device])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    said = f"error: invalid input: --device {device!r} was asked for but no CUDA GPU is visible; use cpu"
    assert result.output.strip() == said, result.output


def test_env_refuses_a_cuda_device_past_the_visible_ones(monkeypatch):
    """`sbp env --device cuda:7` where NVML sees 2 GPUs: one line naming the visible ones, exit 2;
    cuda:1 goes on to the table (its capture stubbed), and torch.cuda is never touched."""
    import torch

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda was touched: sbp env reads the GPU through NVML only")

    monkeypatch.setattr(torch.cuda, "is_available", forbidden)
    monkeypatch.setattr(torch.cuda, "device_count", forbidden)
    monkeypatch.setattr(environment, "auto_device", lambda: "cuda")
    monkeypatch.setattr(environment, "visible_gpu_count", lambda: 2)
    result = runner.invoke(app, ["env", "--device", "cuda:7"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    said = "error: invalid input: --device cuda:7 does not exist: 2 CUDA device(s) visible (cuda:0..cuda:1)"
    assert result.output.strip() == said, result.output
    captured = []

    def capture(device):  # what follows the check: past it, the device was accepted
        captured.append(device)
        raise typer.Exit(0)

    monkeypatch.setattr(environment, "capture_environment", capture)
    assert runner.invoke(app, ["env", "--device", "cuda:1"]).exit_code == 0 and captured == ["cuda:1"]


def test_seeds_only_goes_on_for_a_file_with_a_gpu_search(monkeypatch, tmp_path):
    """A file with one search on the CPU and one on the machine's device (a GPU's, for seeds) is seeded, not refused."""
    from sbpbench.cli import sweep_cmd

    def work(*args, **kwargs):
        raise typer.Exit(0)

    monkeypatch.setattr(sweep_cmd, "_seeds_only", work)
    path = tmp_path / "mixed.toml"
    search = 'kind = "maxlen"\nmodel = "tiny/qwen3"\nmethod = "bp"\nmemory_limit = "1GiB"\n'
    path.write_text(f'name = "mixed"\n[[points]]\n{search}device = "cpu"\n[[points]]\n{search}')
    result = runner.invoke(app, ["sweep", str(path), "--seeds-only"])
    assert result.exit_code == 0 and "error:" not in result.output, result.output


def test_a_row_error_with_brackets_is_printed_as_written(monkeypatch, tmp_path):
    """A row error holding `[...]` (a gloo error names its source file so) prints whole, and so does the written line."""
    from sbpbench.cli import run_cmd
    from sbpbench.records import ResultRow

    said = "gloo: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [red]"
    row = ResultRow(status="error", model="tiny/qwen3", method="streambp", seq_len=16, error=said, device="cpu")
    monkeypatch.setattr(run_cmd, "_measure_all", lambda *args, **kwargs: [row])
    result = runner.invoke(app, [*RUN, "--method", "streambp", "--out", str(tmp_path / "r.csv")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"streambp: error: {said}" in _line(result) and "row(s)" in result.output, result.output


def test_maxlen_simulate_names_the_host_when_nothing_fits(monkeypatch, tmp_path):
    """Every probe over the predicted host memory: the notice names the default, each probe line and the
    answer say `host: needs ...` (on stderr, as progress), and the line under the table names --host-memory."""
    import sbpbench.simulate.depth
    from sbpbench.records import ResultRow
    from sbpbench.workload.rows import spec_fields

    host = "host: needs 40.00 GiB (pinned checkpoints + process) of 23.54 GiB"

    def predicted(spec, **kwargs):
        return ResultRow(**spec_fields(spec), status="oom", error=host, peak_allocated_bytes=2**30, source="simulated")

    monkeypatch.setattr(sbpbench.simulate.depth, "estimate_point_by_depth", predicted)
    result = runner.invoke(app, [*SIM, "--method", "streambp", "--out", str(tmp_path / "e.csv")])
    assert result.exit_code == 0 and isinstance(result.exception, (SystemExit, type(None))), result.output
    assert "notice: --host-memory not given: predicting for this machine's RAM" in result.output, result.output
    assert f"T=2: oom ({host})" in result.stderr and f"max T oom: even T=2 does not fit: {host}" in result.stderr
    assert "probe streambp" not in result.stdout, "progress goes to stderr, the table and the answer to stdout"
    assert f"streambp: even T=2 does not fit: {host}; --host-memory SIZE gives the GPU machine's" in _line(result)


def test_a_shipped_experiment_named_from_another_folder_says_where_it_is(monkeypatch, tmp_path):
    """`sbp sweep experiments/smoke_cpu.toml` outside the checkout: the path is relative to this folder, and the shipped file's path."""
    from sbpbench.config.experiment import SHIPPED

    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["sweep", SMOKE])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    said = f"(a path relative to this folder, {tmp_path}); the shipped file is {SHIPPED / 'smoke_cpu.toml'}"
    assert said in _line(result), result.output
