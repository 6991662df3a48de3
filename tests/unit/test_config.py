"""The run configuration: one set of names and defaults for the CLI, experiment files and Python."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import typer

from sbpbench.cli import _one_line_warning, app
from sbpbench.cli.flags import FLAGS
from sbpbench.config import FIELD_NAMES, ConfigError, MaxlenSpec, RunSpec, point_specs
from sbpbench.config.experiment import POINT_KEYS
from sbpbench.config.maxlen import search_specs
from sbpbench.settings import METHOD_KNOBS, SETTINGS, SettingChanged

# The command line stays small on purpose: a cap on each command's visible flags stops it growing
# (an axis added to the point is a deliberate raise of its cap), and a new method knob adds no flag
# (it comes through --set). Nothing here is a list to edit when a knob is added.
# run: --trace (30), --sp (31); maxlen: --sp (38); check: --nproc and --sp (19); sweep: --seeds-only (7); plan: --all;
# estimate: --gpus (24); plan: --gpus and --interconnect (21)
MAX_VISIBLE_FLAGS = {"run": 31, "maxlen": 39, "estimate": 25, "plan": 22, "check": 19, "sweep": 7}
KNOB_AXES = {"chunk_size", "logits_chunk_size", "checkpoints"}  # StreamBP's chunk sizes and placement


def _flags(command_name: str, *, hidden: bool = False) -> set[str]:
    """A command's long flags (`hidden`: also those its help does not show)."""
    command = typer.main.get_command(app).commands[command_name]
    flags = set()
    for param in command.params:
        if hidden or not getattr(param, "hidden", False):
            flags |= {
                f for f in (*param.opts, *param.secondary_opts) if f.startswith("--") and not f.startswith("--no-")
            }
    return flags


@pytest.mark.parametrize("command", sorted(MAX_VISIBLE_FLAGS))
def test_no_command_grows_past_its_cap_of_flags(command):
    """A command shows at most its cap of flags (its help lists them; --seq and --start are two)."""
    assert len(_flags(command)) <= MAX_VISIBLE_FLAGS[command], sorted(_flags(command))


@pytest.mark.parametrize("command", sorted(MAX_VISIBLE_FLAGS))
def test_method_knobs_but_the_axes_come_through_set(command):
    """Of the method knobs only the point's axes have a flag in a help; a command that takes any
    knob takes --set; the knobs' former flags still parse but are hidden."""
    knob_flags = {FLAGS[name]: name for name in METHOD_KNOBS}
    shown = {knob_flags[f] for f in _flags(command) if f in knob_flags}
    assert shown <= KNOB_AXES == {name for name in METHOD_KNOBS if SETTINGS[name].axis}
    takes_knobs = any(f"--{name.replace('_', '-')}" in _flags(command, hidden=True) for name in METHOD_KNOBS)
    assert ("--set" in _flags(command)) == takes_knobs


def test_experiment_keys_are_the_config_field_names():
    """An experiment file says seq_len where Python says seq_len: the keys are the fields (plus a
    search's own settings, the point kind and the entry's title)."""
    search = {"seq_len_ceiling", "resolution", "multiple_of", "seed_from_estimate"}
    assert set(POINT_KEYS) == {*FIELD_NAMES, *search, "kind", "title"}
    assert set(FLAGS) == set(POINT_KEYS) - {"kind", "title"}


def test_defaults_are_filled_by_the_config_per_device_and_objective():
    """The CPU default point and the per-objective batch sizes come from one place."""
    (bp, streambp) = point_specs({"device": "cpu"}, ["bp", "streambp"])
    assert (bp.model, bp.seq_len, bp.dtype, bp.batch_size, bp.device) == ("small/qwen3", 2048, "fp32", 1, "cpu")
    assert (streambp.settings.chunk_size, streambp.settings.logits_chunk_size) == (683, 1024)  # the rule's
    assert streambp.auto_settings == ("chunk_size", "logits_chunk_size")
    assert point_specs({"device": "cpu", "objective": "grpo"}, ["bp"])[0].batch_size == 8
    assert point_specs({"device": "cpu", "objective": "dpo"}, ["bp"])[0].batch_size == 2
    gpu_shaped = point_specs({"device": "cpu"}, ["bp"], defaults_for="cuda")[0]
    assert (gpu_shaped.model, gpu_shaped.seq_len, gpu_shaped.dtype) == ("Qwen/Qwen3-4B", 9000, "bf16")


def test_a_method_holds_only_the_settings_it_reads():
    """bp and ckpt ignore StreamBP's chunk sizes, so their specs (and rows, and keys) hold none."""
    specs = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": 90, "chunk_size": "T/3"})
    by_method = {s.method: s.settings for s in specs}
    assert by_method["streambp"].chunk_size == 30
    assert by_method["bp"].chunk_size is None and by_method["ckpt"].logits_chunk_size is None
    assert replace(specs[0], method="streambp").settings.chunk_size == 500  # re-derived: the default


@pytest.mark.parametrize(
    ("values", "field", "words"),
    [
        ({"seq_len": 1}, "seq_len", "at least 2"),
        ({"batch_size": 3, "objective": "dpo"}, "batch_size", "even"),
        ({"chunk_size": 0}, "chunk_size", '>= 1 or "auto"'),
        ({"chunk_size": "half"}, "chunk_size", "T/3"),
        ({"memory_limit": "lots"}, "memory_limit", "cannot read memory_limit 'lots'"),
        ({"memory_limit": "1"}, "memory_limit", "memory_limit '1' has no unit: write 1GiB"),
        ({"objective": "ppo"}, "objective", "sft, grpo, dpo"),
        ({"device": "tpu"}, "device", "cuda:N"),
        ({"timeout_s": 0}, "timeout_s", "positive"),
        ({"seqlen": 5}, "seqlen", "is not a setting"),
    ],
)
def test_a_bad_setting_names_its_field(values, field, words):
    """The config's error carries the field, which each front end renames (flag, TOML key)."""
    with pytest.raises(ConfigError) as error:
        point_specs({"device": "cpu", "model": "tiny/qwen3", **values}, ["streambp"])
    assert error.value.field == field
    assert words in str(error.value)


def test_a_spec_survives_the_trip_to_the_worker():
    """to_json/from_json round-trip, settings included (the worker rebuilds the same spec)."""
    (spec,) = point_specs(
        {"device": "cpu", "model": "tiny/qwen3", "chunk_size": 7, "memory_limit": "1MiB"}, ["streambp"]
    )
    assert RunSpec.from_json(spec.to_json()) == spec
    assert spec.memory_limit == 2**20


@pytest.mark.parametrize(
    ("values", "said"),
    [
        (
            {"objective": "grpo", "prompt_len": 5000, "seq_len": 64},
            "prompt_len 5000 is over half of T=64: runs with a 32-token prompt",
        ),
        (
            {"objective": "sft", "prompt_len": 10, "seq_len": 64},
            "prompt_len 10 is not used: only grpo and dpo have a prompt",
        ),
    ],
)
def test_a_value_given_that_runs_otherwise_is_said(values, said):
    """No value is changed silently: a prompt over half of T, or one an SFT point has no use for,
    is a SettingChanged notice; the CLI shows it with the flag."""
    with pytest.warns(SettingChanged) as caught:
        point_specs({"device": "cpu", "model": "tiny/qwen3", **values}, ["bp"])
    (notice,) = [w.message for w in caught if isinstance(w.message, SettingChanged)]
    assert str(notice) == said
    line = _one_line_warning(notice, SettingChanged, "", 0)
    assert " ".join(line.split()) == "notice: --" + said.replace("prompt_len", "prompt-len", 1)


class _Stderr:
    def __init__(self, terminal: bool):
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_a_warning_folds_on_a_terminal_and_stays_one_line_in_a_log(monkeypatch):
    """On an 80-column terminal a long warning folds, later lines indented, no word lost (`sbp plan`
    at 1M tokens fits 80 columns, its context warning included); into a pipe it stays one line."""
    monkeypatch.setenv("COLUMNS", "80")
    message = UserWarning("T past Qwen/Qwen3-8B's context of 40,960 tokens (max_position_embeddings): " + "word " * 30)
    monkeypatch.setattr(sys, "stderr", _Stderr(terminal=True))
    text = _one_line_warning(message, UserWarning, "", 0)
    lines = text.splitlines()
    assert len(lines) > 1 and max(map(len, lines)) <= 80 and all(line.startswith("  ") for line in lines[1:])
    assert " ".join(text.split()) == f"warning: {message}".strip()
    monkeypatch.setattr(sys, "stderr", _Stderr(terminal=False))
    assert _one_line_warning(message, UserWarning, "", 0) == f"warning: {message}\n"


def test_a_search_says_which_probes_cut_the_prompt():
    """A max-length search with a long prompt: its shorter probes run with half their T as prompt, said once."""
    with pytest.warns(SettingChanged, match="prompt_len 1000: a probe under T=2000 runs with a prompt of half its T"):
        search_specs({"device": "cpu", "model": "tiny/qwen3", "objective": "grpo", "prompt_len": 1000}, ["bp"])


def test_a_prompt_within_half_of_t_is_not_a_notice(recwarn):
    """A prompt that runs as given says nothing."""
    point_specs({"device": "cpu", "model": "tiny/qwen3", "objective": "dpo", "prompt_len": 32, "seq_len": 64}, ["bp"])
    assert not [w for w in recwarn if isinstance(w.message, SettingChanged)]


def test_a_python_caller_gives_a_byte_count():
    """An int memory_limit is a number of bytes (a caller in Python says what it means); only text needs a unit."""
    (spec,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "memory_limit": 2**30}, ["bp"])
    assert spec.memory_limit == 2**30


def test_a_search_checks_its_ceiling_against_its_first_probe():
    """A max-length search cannot start above the longest length it may try."""
    (base,) = point_specs({"device": "cpu", "model": "tiny/qwen3", "seq_len": 512}, ["bp"])
    with pytest.raises(ConfigError, match="seq_len_ceiling"):
        MaxlenSpec(base=base, seq_len_ceiling=256)
    assert MaxlenSpec(base=base, resolution="5%", seq_len_ceiling=4096).start == 512


def test_a_local_checkpoint_of_another_family_is_refused_before_anything_runs(tmp_path):
    """A BERT directory is not a decoder-only causal LM (refused for every method, naming what runs);
    a GPT-2 one runs under bp and ckpt but not streambp, which says why."""
    from transformers import BertConfig, GPT2Config

    from sbpbench.models import UnsupportedModelError

    BertConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2).save_pretrained(
        tmp_path / "bert"
    )
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match="'bert', not a decoder-only causal LM.*bp and ckpt"):
        point_specs({"device": "cpu", "model": str(tmp_path / "bert"), "seq_len": 16}, ["bp"])
    with pytest.raises(UnsupportedModelError, match=r"streambp cannot run .*no decoder\.layers.*bp and ckpt"):
        point_specs({"device": "cpu", "model": str(tmp_path / "gpt2"), "seq_len": 16})
    gpt2 = {"device": "cpu", "model": str(tmp_path / "gpt2"), "seq_len": 1024}  # GPT-2's whole context
    assert [s.method for s in point_specs(gpt2, ["bp", "ckpt"])] == [
        "bp",
        "ckpt",
    ]


def test_no_method_named_runs_the_papers_three_and_all_runs_every_one():
    """Peers are asked for by name: the default is bp, ckpt, streambp; `all` expands to the registry."""
    from sbpbench.methods import METHODS

    base = {"device": "cpu", "model": "tiny/qwen3"}
    assert [s.method for s in point_specs(base)] == ["bp", "ckpt", "streambp"]
    assert [s.method for s in point_specs(base, ["all"])] == list(METHODS)
    assert point_specs(base, ["tiled", "all"])[0].method == "tiled"
