"""Experiment files: every shipped one loads into RunSpecs / MaxlenSpecs as the paper describes,
and a mistake names the file, the table, the key and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbpbench.config import MaxlenSpec, RunSpec
from sbpbench.config.experiment import ExperimentError, load_experiment

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
# the paper's Figure 3 and the peers' file go past Qwen3's 40,960-token context on purpose (test_bad_input.py: the
# warning); Table 3's searches say that their probes under T=2000 halve its 1000-token prompt (test_config.py: the notice)
pytestmark = [
    pytest.mark.filterwarnings("ignore::sbpbench.config.run.BeyondContextWarning"),
    pytest.mark.filterwarnings("ignore:prompt_len 1000. a probe under:sbpbench.settings.errors.SettingChanged"),
]


# long_context prices its searches from simulated runs: 7-13 s on 2 busy cores
SLOW_EXPERIMENTS = {"long_context"}


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem in SLOW_EXPERIMENTS else [])
        for p in sorted(EXPERIMENTS.glob("*.toml"))
    ],
)
def test_every_shipped_experiment_loads(path):
    experiment = load_experiment(path, device="cpu")
    assert experiment.name == path.stem and experiment.description
    assert experiment.points
    assert all(isinstance(p, (RunSpec, MaxlenSpec)) for p in experiment.points)


@pytest.mark.slow  # loads the three paper experiments: 9 s on 2 busy cores
def test_the_paper_experiments_hold_the_papers_settings():
    fig3 = load_experiment(EXPERIMENTS / "paper_fig3.toml", device="cpu")
    assert {p.model for p in fig3.grid} == {"Qwen/Qwen3-8B", "Qwen/Qwen3-14B"}
    assert {(p.dtype, p.step, p.protocol, p.memory_limit) for p in fig3.grid} == {("bf16", "bp", "steady", 80 << 30)}
    assert max(p.seq_len for p in fig3.grid if p.model == "Qwen/Qwen3-8B") >= 110_000

    table1 = load_experiment(EXPERIMENTS / "paper_table1.toml", device="cpu")
    assert sorted({p.seq_len for p in table1.grid}) == list(range(6000, 27001, 3000))
    streamed = [p for p in table1.grid if p.method == "streambp"]
    assert streamed and all(p.settings.chunk_size == -(-p.seq_len // 3) for p in streamed)
    assert all(p.settings.logits_chunk_size == 100 for p in streamed)
    assert all(p.settings.chunk_size is None for p in table1.grid if p.method != "streambp")  # bp/ckpt read none
    assert {p.method for p in table1.grid} == {"bp", "ckpt", "streambp"}

    table2 = load_experiment(EXPERIMENTS / "paper_table2.toml", device="cpu")
    assert sorted({p.batch_size for p in table2.grid}) == [1, 2, 4, 16]
    assert {p.seq_len for p in table2.grid} == {9000}

    maxlen = load_experiment(EXPERIMENTS / "paper_maxlen.toml", device="cpu")
    assert {(s.base.model, s.method) for s in maxlen.searches} >= {
        ("Qwen/Qwen3-8B", m) for m in ("bp", "ckpt", "streambp")
    }
    assert all(s.base.repeats == 0 and str(s.resolution) == "1%" for s in maxlen.searches)
    assert {s.base.lora_rank for s in maxlen.searches if s.base.model == "Qwen/Qwen3-32B"} == {32}


def test_smoke_cpu_is_a_cpu_experiment_with_a_grid_a_batch_series_and_searches():
    """The smoke experiment runs on the CPU, with a batch series and max-T searches, and times each
    point with a warm-up step and two timed steps, so its time figures can rank methods."""
    smoke = load_experiment(EXPERIMENTS / "smoke_cpu.toml")
    assert {p.device for p in smoke.grid} == {"cpu"}
    assert {(p.warmup, p.repeats) for p in smoke.grid} == {(1, 2)}
    assert {p.batch_size for p in smoke.grid} == {1, 2}
    assert {s.method for s in smoke.searches} == {"bp", "ckpt", "streambp"}


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return path


GOOD_POINT = '[[points]]\nmodel = "tiny/qwen3"\nseq_len = [64]\n'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD_POINT + "seqlens = [64]\n", ["[[points]] #1", "unknown key 'seqlens'", "allowed:", "seq_len"]),
        ("[defaults]\ndtype = 16\n" + GOOD_POINT, ["[defaults] dtype", "expected a string", "got 16"]),
        ('[defaults]\ndtype = "fp16"\n' + GOOD_POINT, ["dtype", "unknown value 'fp16'", "fp64, fp32, bf16"]),
        (GOOD_POINT + 'method = ["bp", "mst"]\n', ["[[points]] #1 method", "'mst'", "bp, ckpt, streambp"]),
        (GOOD_POINT + 'methods = ["bp"]\n', ["[[points]] #1", "unknown key 'methods'", "now called 'method'"]),
        (GOOD_POINT + "seq_len = 64\n", ["not valid TOML"]),  # TOML itself refuses a repeated key
        (
            '[[points]]\nmodel = "Qwen/Qwen3-9B"\nseq_len = [64]\n',
            ["[[points]] #1 model", "'Qwen/Qwen3-9B'", "did you mean Qwen/Qwen3-8B?", "hf download"],
        ),
        ('[[points]]\nmodel = "tiny/qwen3"\nseq_len = [64, "x"]\n', ["seq_len", "expected an integer", "'x'"]),
        ('[[points]]\nmodel = "tiny/qwen3"\nseq_len = []\n', ["seq_len", "non-empty list"]),
        ("[[points]]\nseq_len = [64]\n", ["[[points]] #1", "missing key 'model'"]),
        ('[[points]]\nmodel = "tiny/qwen3"\n', ["[[points]] #1 seq_len", "is needed by a grid point"]),
        ('kind = "grids"\n' + GOOD_POINT, ["kind", "'grids'", "grid, maxlen"]),
        ('title = "x"\n' + GOOD_POINT, ["unknown top-level key 'title'", "description"]),
        ('name = "x"\n', ["no [[points]]"]),
        (GOOD_POINT + 'resolution = "1%"\n', ["'resolution' does not apply to a grid point"]),
        (GOOD_POINT + 'memory_limit = "lots"\n', ["[[points]] #1", "cannot read memory_limit 'lots'"]),
        (GOOD_POINT + "memory_limit = 1\n", ["[[points]] #1 memory_limit", "1 has no unit", '"1GiB"']),
        (GOOD_POINT + 'memory_limit = "1"\n', ["[[points]] #1 memory_limit", "'1' has no unit", "1GiB"]),
        (GOOD_POINT + 'chunk_size = "half"\n', ["[[points]] #1 chunk_size", "'half'", "T/3"]),
        (GOOD_POINT + "batch_size = true\n", ["batch_size", "expected an integer", "True"]),
        (
            '[[points]]\nmodel = "tiny/qwen3"\nkind = "maxlen"\nresolution = "0%"\n',
            ["[[points]] #1 resolution", "'0%'"],
        ),
        (GOOD_POINT + 'kind = "maxlen"\n', ["[[points]] #1 seq_len", "takes one value in a maxlen point"]),
        (GOOD_POINT.replace("[64]", "[1]"), ["[[points]] #1 seq_len", "must be at least 2"]),
        ("points = [\n", ["not valid TOML"]),
    ],
)
def test_a_bad_experiment_file_names_file_table_key_and_what_is_allowed(tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(ExperimentError) as error:
        load_experiment(path, device="cpu")
    message = str(error.value)
    assert message.startswith(str(path)) and "\n" not in message
    for part in expected:
        assert part in message


def test_a_missing_experiment_file_is_a_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no experiment file"):
        load_experiment(tmp_path / "nope.toml")


def test_defaults_merge_into_points_and_grids_expand_in_order(tmp_path):
    path = _write(
        tmp_path,
        '[defaults]\nmodel = "tiny/qwen3"\nmethod = ["bp", "streambp"]\nchunk_size = "T/2"\n'
        "[[points]]\nseq_len = [64, 96]\nbatch_size = [1, 2]\n"
        '[[points]]\nkind = "maxlen"\nmethod = ["ckpt"]\nresolution = "64"\nseq_len = 32\nseq_len_ceiling = 512\n',
    )
    experiment = load_experiment(path, device="cpu")
    grid = [(p.batch_size, p.seq_len, p.method, p.settings.chunk_size) for p in experiment.grid]
    assert grid == [
        (1, 64, "bp", None), (1, 64, "streambp", 32), (1, 96, "bp", None), (1, 96, "streambp", 48),
        (2, 64, "bp", None), (2, 64, "streambp", 32), (2, 96, "bp", None), (2, 96, "streambp", 48),
    ]  # fmt: skip
    (search,) = experiment.searches
    assert (search.method, search.start, search.seq_len_ceiling, str(search.resolution)) == ("ckpt", 32, 512, "64")
    assert search.base.repeats == 0  # probes measure memory only
