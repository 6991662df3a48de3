"""The settings table (sbpbench/settings) is the one torch-free declaration of every setting: its
choices are the registries' names, its names the specs' fields, and every list of settings is
derived from it (a scan of the source fails on one written out by hand)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest

import sbpbench
from sbpbench.config import DTYPES, FIELD_NAMES, MaxlenSpec, RunSpec
from sbpbench.core import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK_SIZE
from sbpbench.data import OBJECTIVES
from sbpbench.methods import METHODS, STEPS, MethodSettings
from sbpbench.methods.settings import DEFAULTS
from sbpbench.records.schema import COLUMNS, METHOD_SETTING_COLUMNS, ResultRow
from sbpbench.settings import (
    AUTO,
    DTYPE_NAMES,
    EVERY_METHOD,
    METHOD_KNOBS,
    METHOD_NAMES,
    POINT_SETTINGS,
    PROTOCOLS,
    SEARCH_SETTINGS,
    SETTINGS,
    ConfigError,
    Setting,
    check,
    default_of,
    knobs_read_by,
)
from sbpbench.settings import OBJECTIVES as SETTING_OBJECTIVES
from sbpbench.settings import STEPS as SETTING_STEPS
from sbpbench.settings.table import UNCHECKED_KNOB, not_estimated


def test_choices_are_the_registries_names():
    """--method lists the method registry's names in its order, --dtype the dtype table's; the
    objectives and steps the data and methods packages use are these very tuples."""
    assert METHOD_NAMES == tuple(METHODS)
    assert SETTINGS["method"].choices == (*METHODS, EVERY_METHOD)
    assert DTYPE_NAMES == tuple(DTYPES) and SETTINGS["dtype"].choices == DTYPE_NAMES
    assert OBJECTIVES is SETTING_OBJECTIVES and STEPS is SETTING_STEPS
    assert SETTINGS["objective"].choices == OBJECTIVES and SETTINGS["protocol"].choices == PROTOCOLS


def test_every_spec_field_has_one_entry():
    """The point settings are RunSpec's fields with MethodSettings' in place of `settings` (and
    auto_settings, what the rule chose of them); the search settings are MaxlenSpec's own fields
    (besides its base point)."""
    spec_fields = [f.name for f in fields(RunSpec) if f.name not in ("settings", "auto_settings")] + [
        f.name for f in fields(MethodSettings)
    ]
    assert sorted(spec_fields) == sorted(POINT_SETTINGS) and FIELD_NAMES == POINT_SETTINGS
    assert set(SEARCH_SETTINGS) == {f.name for f in fields(MaxlenSpec)} - {"base"}


def test_derived_lists_are_the_table():
    """MethodSettings' fields and DEFAULTS, the results' method-setting columns (one run of them, in
    the row) and each method's knobs are the table's method knobs and their `read_by`."""
    assert tuple(f.name for f in fields(MethodSettings)) == METHOD_KNOBS == METHOD_SETTING_COLUMNS
    assert {n: str(v) if n == "checkpoints" else v for n, v in DEFAULTS.items()} == {
        name: SETTINGS[name].default for name in METHOD_KNOBS
    }
    start = COLUMNS.index(METHOD_KNOBS[0])
    assert COLUMNS[start : start + len(METHOD_KNOBS)] == METHOD_KNOBS
    assert {reader for name in METHOD_KNOBS for reader in SETTINGS[name].read_by} <= set(METHODS)
    tiled = knobs_read_by("tiled")  # among others a new knob may add: its own and the head's chunk
    assert {"logits_chunk_size", "mlp_tile_size", "offload_checkpoints"} <= set(tiled)
    assert list(tiled) == sorted(tiled, key=METHOD_KNOBS.index) and "chunk_size" not in tiled
    assert knobs_read_by("bp") == ()


def _kinds(annotation: str) -> set[str]:
    return {word.strip() for word in annotation.split("|")}


def test_knob_fields_and_columns_take_the_tables_values():
    """MethodSettings and ResultRow make a field of each knob from the table, in its order: each
    MethodSettings field takes what its setting takes (or None), each column the first of those
    (text: ""), as the CSV reader decodes it."""
    knob_fields = {f.name: f for f in fields(MethodSettings)}
    columns = {f.name: f for f in fields(ResultRow)}
    for name in METHOD_KNOBS:
        kind = SETTINGS[name].kind
        kinds = [k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,))]
        assert set(kinds) | {"None"} <= _kinds(knob_fields[name].type), name
        assert knob_fields[name].default is None, name
        column = columns[name]
        expected = ("str", "") if kinds[0] == "str" else (f"{kinds[0]} | None", None)
        assert (column.type, column.default) == expected, name


def test_core_defaults_are_the_tables():
    """core's chunk defaults (a library of its own: it imports nothing of ours) equal the table's."""
    assert DEFAULT_CHUNK_SIZE == SETTINGS["chunk_size"].default
    assert DEFAULT_LOGITS_CHUNK_SIZE == SETTINGS["logits_chunk_size"].default


def _spoken(value) -> str | None:
    """A default as a help text says it (None: nothing to say)."""
    if value is None or value is False:
        return None
    if value is True:
        return "on"
    return " ".join(value) if isinstance(value, tuple) else str(value)


def test_each_help_says_its_default():
    """A setting's help names its default (a point's: "auto" where chosen per point), per device and
    per objective where it has those, so the help cannot drift from the value."""
    for name, setting in SETTINGS.items():
        point_default = AUTO if setting.auto else setting.default
        for value in (point_default, *setting.by_device.values(), *setting.by_objective.values()):
            said = _spoken(value)
            assert said is None or said in setting.help, f"{name}'s help does not say its default {said}"


def test_a_declared_check_applies_to_any_setting(monkeypatch):
    """`check` enforces what an entry declares (choices, an integer minimum, a bool), so a new
    setting is checked without code of its own."""
    monkeypatch.setitem(SETTINGS, "toy_count", Setting(int, "Toys (default: 3).", default=3, minimum=2))
    monkeypatch.setitem(SETTINGS, "toy_color", Setting(str, "Color (default: red).", ("red", "blue"), default="red"))
    check("toy_count", 2)
    check("toy_color", "blue")
    with pytest.raises(ConfigError, match="toy_count must be at least 2, got 1"):
        check("toy_count", 1)
    with pytest.raises(ConfigError, match="toy_count must be an integer >= 2, got True"):
        check("toy_count", True)
    with pytest.raises(ConfigError, match="unknown toy_color 'green'; choose from red, blue"):
        check("toy_color", "green")
    with pytest.raises(ConfigError, match="lora_alpha must be at least 1"):
        RunSpec(model="tiny/qwen3", method="bp", seq_len=8, lora_alpha=0)
    assert default_of("batch_size", objective="grpo") == 8 and default_of("seq_len", "cuda", search=True) == 1024


def test_the_table_imports_no_torch():
    """Importing the settings table in a fresh interpreter loads neither torch nor transformers."""
    code = "import sys, sbpbench.settings; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_each_entry_says_whether_the_estimator_models_it(monkeypatch):
    """`estimator` is True or why not; unsaid, a method's knob is not modelled (the estimator's
    extrapolations are checked per knob) and any other setting is."""
    knob = Setting(bool, "Toy (default: on).", default=True, read_by=("streambp",))
    monkeypatch.setitem(SETTINGS, "toy_knob", knob)
    monkeypatch.setitem(SETTINGS, "toy_modelled_knob", Setting(**{**vars(knob), "estimator": True}))
    monkeypatch.setitem(SETTINGS, "toy_count", Setting(int, "Toys (default: 3).", default=3))
    assert not_estimated("toy_knob") == UNCHECKED_KNOB
    assert not_estimated("toy_modelled_knob") == not_estimated("toy_count") == not_estimated("seq_len") == ""
    assert not_estimated("chunk_attention") == SETTINGS["chunk_attention"].estimator != ""


# The knob experiment: a boolean knob that StreamBP reads, declared in a copy of the settings table
# and nowhere else, before the table derives its first list (as an entry of SETTINGS would be).
STAND_IN = (
    'SETTINGS["stand_in"] = Setting(bool, "StreamBP: a stand-in (default: on).", default=True, read_by=("streambp",))'
)
FIRST_DERIVED = "\nPOINT_SETTINGS = "


@pytest.fixture(scope="module")
def stand_in_copy(tmp_path_factory) -> Path:
    """A copy of the sbpbench package whose settings table alone holds one more knob (STAND_IN)."""
    root = tmp_path_factory.mktemp("stand_in")
    shutil.copytree(Path(sbpbench.__file__).parent, root / "sbpbench", ignore=shutil.ignore_patterns("__pycache__"))
    table = root / "sbpbench" / "settings" / "table.py"
    source = table.read_text()
    assert source.count(FIRST_DERIVED) == 1, "the table derives its lists from POINT_SETTINGS on"
    table.write_text(source.replace(FIRST_DERIVED, f"\n{STAND_IN}\n{FIRST_DERIVED}"))
    return root


def _with_stand_in(root: Path, code: str) -> dict:
    """The JSON that `code` prints last, run in a fresh interpreter on the copy with the stand-in."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


STAND_IN_TORCH_FREE = """
    import json, sys
    from typer.testing import CliRunner
    import sbpbench
    from sbpbench.cli import app
    from sbpbench.cli.docs_page import page
    from sbpbench.records.schema import KEY_COLUMNS, METHOD_SETTING_COLUMNS, ResultRow, upgrade
    from sbpbench.records.store import encode_row

    sbp = lambda *argv: " ".join(CliRunner().invoke(app, list(argv)).output.split())
    print(json.dumps({
        "package": sbpbench.__file__,
        "columns": METHOD_SETTING_COLUMNS,
        "in_key": "stand_in" in KEY_COLUMNS,
        "written": encode_row(ResultRow(method="streambp", stand_in=False))["stand_in"],
        "read_back": [upgrade({"schema_version": "14", "method": m})["stand_in"] for m in ("streambp", "bp")],
        "set_help": {command: sbp(command, "--set", "help") for command in ("run", "estimate", "plan")},
        "bad_value": sbp("run", "--set", "stand_in=maybe"),
        "refused": sbp("estimate", "--set", "stand_in=off"),
        "at_default": sbp("estimate", "--set", "stand_in=on", "--gpu-memory", "80"),
        "commands_page": page(),
        "torch": "torch" in sys.modules,
    }))
"""


def test_a_knob_in_the_table_alone_reaches_the_cli_and_the_results(stand_in_copy):
    """With the stand-in declared in the table and nothing else edited: a results column in the key
    (read back from an older file at its default for StreamBP), `--set` on every point command, one
    line for a bad value, refused by `sbp estimate` (not said to be modelled) but at its default, and
    every command's help, so docs/commands.md, unchanged. No torch is loaded for any of it."""
    from sbpbench.cli.docs_page import page

    got = _with_stand_in(stand_in_copy, STAND_IN_TORCH_FREE)
    assert got["package"].startswith(str(stand_in_copy)) and not got["torch"]
    assert got["columns"] == [*METHOD_KNOBS, "stand_in"] and got["in_key"]
    assert got["written"] == "false" and got["read_back"] == ["true", ""]
    line = "stand_in=true|false StreamBP: a stand-in (default: on)."
    assert all(line in text for text in got["set_help"].values()), got["set_help"]
    assert f"{line} Not modelled by the estimator: default only." in got["set_help"]["estimate"]
    assert "error: invalid input: --set stand_in must be true or false, got 'maybe'" == got["bad_value"]
    assert f"error: invalid input: --set stand_in is not modelled by the estimator: {UNCHECKED_KNOB}" == got["refused"]
    assert "--gpu-memory '80' has no unit" in got["at_default"]  # past the knob: refused further on
    assert got["commands_page"] == page()


STAND_IN_CONFIG = """
    import json
    from dataclasses import fields
    from pathlib import Path
    from sbpbench.config import point_specs
    from sbpbench.config.experiment import load_experiment
    from sbpbench.methods import MethodSettings
    from sbpbench.records import ResultRow
    from sbpbench.workload.rows import spec_fields

    point = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 64}
    given = {spec.method: spec for spec in point_specs({**point, "stand_in": False}, ["streambp", "bp"])}
    (unset,) = point_specs(point, ["streambp"])
    entry = '[[points]]\\nmodel = "tiny/qwen3"\\nmethod = "streambp"\\nseq_len = 64\\nstand_in = '
    Path("grid.toml").write_text(entry + "false\\n")
    (from_file,) = load_experiment("grid.toml", device="cpu").grid
    Path("bad.toml").write_text(entry + "3\\n")
    try:
        load_experiment("bad.toml", device="cpu")
    except ValueError as error:
        bad = str(error)
    print(json.dumps({
        "field": [f.name for f in fields(MethodSettings)][-1],
        "streambp": given["streambp"].settings.stand_in,
        "bp": given["bp"].settings.stand_in,
        "unset": unset.settings.stand_in,
        "row": ResultRow(**spec_fields(given["streambp"])).stand_in,
        "from_file": from_file.settings.stand_in,
        "bad_file": bad,
    }))
"""


@pytest.mark.slow
def test_a_knob_in_the_table_alone_reaches_the_specs_and_experiment_files(stand_in_copy):
    """With the stand-in declared in the table and nothing else edited: a MethodSettings field that a
    StreamBP spec holds (its default when not given) and a bp spec leaves None, its row's column, and
    an experiment-file key with the table's type check."""
    got = _with_stand_in(stand_in_copy, STAND_IN_CONFIG)
    assert got["field"] == "stand_in" and (got["streambp"], got["bp"], got["unset"]) == (False, None, True)
    assert got["row"] is False and got["from_file"] is False
    assert "stand_in: expected true/false" in got["bad_file"] and got["bad_file"].endswith("got 3")


# A literal of this many setting names written outside sbpbench/settings/ is a hand-kept copy of a
# settings list, unless it is one of the selections below.
LIST_THRESHOLD = 3
# Literals that choose settings or columns for one purpose (a command's options, a figure's fixed
# columns, a row's key): no table property says which, so each is written where it is used.
# "path::owner" (owner: the module-level name assigned, or the function, that holds the literal).
SELECTIONS = {
    "cli/check_cmd.py::UNTIMED": "the point options `sbp check` does not take (nothing is timed)",
    "cli/check_cmd.py::check": "`sbp check`'s help for its options",
    "cli/maxlen_cmd.py::maxlen": "`sbp maxlen`'s help for the point options a search reads its own way",
    "cli/options.py::FORMER_KNOB_FLAGS": "the knobs' own flags from before --set, kept hidden for one release",
    "cli/options.py::PREDICTED_POINT": "what `sbp estimate` and `sbp plan` fix in the point they predict",
    "cli/options.py::predicted_gpu_point_helps": "`sbp estimate`'s and `sbp plan`'s help for a GPU point's defaults",
    "cli/plan_cmd.py::PLANNED": "what `sbp plan` decides itself: StreamBP on one GPU, its chunk size and placement",
    "plot/common.py::POINT_GROUP": "the columns a memory figure holds fixed",
    "plot/maxlen.py::MAXLEN_GROUP": "the columns a max-length figure holds fixed",
    "plot/predicted.py::SHARED": "the columns a measured-on-predicted figure holds fixed",
    "plot/timeline.py::FIGURE_KEYS": "the columns a memory-timeline figure holds fixed",
    "workload/timeline.py::POINT_COLUMNS": "the row columns a timeline file repeats",
    "workload/rows.py::spec_fields": "a spec's values as results columns, each converted for its column",
    "records/reference.py::REQUIRED_COLUMNS": "the paper's reference table's columns",
    "records/schema.py::KEY_COLUMNS": "a results row's key: columns, several of them not settings",
    "records/schema.py::PROVENANCE_COLUMNS": "the columns that say where a row was measured",
    "records/schema.py::UPGRADES": "what an old schema's rows meant (history, fixed)",
    "report/markdown.py::PEERS_GROUP": "the columns a report's peers table holds fixed",
    "report/markdown.py::exactness_section": "the exactness table's columns",
    "report/placements.py::GROUP": "the columns a placements table holds fixed",
    "report/points.py::SETTING": "the columns a points table holds fixed",
    "runner/official.py::_job": "the official code's job file: its own keys",
    "simulate/plan.py::describe": "the numbers `sbp plan` prints",
    "simulate/cost.py::predicted_max_t": "what a simulated search shares with the search it prices",
}


def setting_lists(source: str, names) -> list[tuple[int, str, list[str]]]:
    """(line, owner, setting names) of every tuple, list, set or dict literal in `source` that holds
    LIST_THRESHOLD or more of `names` as string constants (a dict: among its keys). The owner is
    the module-level name assigned, or the module-level function or class, the literal lies in."""
    found = []
    for statement in ast.parse(source).body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            owner = statement.name
        else:
            targets = getattr(statement, "targets", None) or [getattr(statement, "target", None)]
            owner = next((t.id for t in targets if isinstance(t, ast.Name)), "")
        for node in ast.walk(statement):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                items = node.elts
            elif isinstance(node, ast.Dict):
                items = [key for key in node.keys if key is not None]
            else:
                continue
            named = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
            if len(named) >= LIST_THRESHOLD:
                found.append((node.lineno, owner, named))
    return found


def _hand_kept_lists() -> dict[str, list[str]]:
    """'path::owner' -> 'line: names' of every setting list written out under sbpbench/ but settings/."""
    root = Path(sbpbench.__file__).parent
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("settings/"):
            continue
        for line, owner, named in setting_lists(path.read_text(), SETTINGS):
            found.setdefault(f"{relative}::{owner}", []).append(f"{line}: {', '.join(named)}")
    return found


def test_no_module_writes_out_a_settings_list():
    """Outside sbpbench/settings/ no literal names 3 or more settings, except the listed selections
    (and each listed selection still exists): a list of settings is derived from the table."""
    found = _hand_kept_lists()
    copies = {where: lines for where, lines in found.items() if where not in SELECTIONS}
    assert not copies, f"derive these from sbpbench/settings/table.py (docs/settings.md): {copies}"
    assert not set(SELECTIONS) - set(found), "a listed selection is gone: remove it from SELECTIONS"


def test_the_list_check_catches_a_copy():
    """The scan finds a hand-written knob list, a dict of defaults and a set in a function, and
    names their owners; two names or unrelated strings are not a list of settings."""
    sample = textwrap.dedent(
        """
        KNOBS = ("chunk_size", "logits_chunk_size", "mlp_tile_size")
        DEFAULTS = {"seq_len": 2048, "dtype": "fp32", "model": "small/qwen3", "other": 1}
        def uses(name):
            return name in {"warmup", "repeats", "seed"}
        PAIR = ("chunk_size", "logits_chunk_size")
        WORDS = ("alpha", "beta", "gamma")
        """
    )
    found = setting_lists(sample, SETTINGS)
    assert [(owner, len(named)) for _, owner, named in found] == [("KNOBS", 3), ("DEFAULTS", 3), ("uses", 3)]


def _option_help(command: str, flag: str) -> str:
    """The help text of one option of `sbp <command> --help`, its wrapped lines joined."""
    from sbpbench.cli.docs_page import render_help

    text = render_help(command)
    start = re.search(rf"^ +(-\w, )?{flag}[ ,]", text, flags=re.MULTILINE).start()
    lines = [text[start:].splitlines()[0]]
    for line in text[start:].splitlines()[1:]:
        if line.lstrip().startswith("-") or not line.strip():
            break
        lines.append(line)
    return " ".join(" ".join(lines).split())


def test_command_helps_name_the_defaults_their_command_uses():
    """`sbp check`'s help names its own point's values (EXACTNESS_DEFAULTS), `sbp estimate`'s and
    `sbp plan`'s a GPU point's, `sbp maxlen`'s a search's: read from where the command takes them."""
    from sbpbench.settings import EXACTNESS_DEFAULTS, default_of

    for flag, name in (("--seq", "seq_len"), ("--batch", "batch_size"), ("--chunk-size", "chunk_size")):
        assert f"(default: {EXACTNESS_DEFAULTS[name]})" in _option_help("check", flag)
    assert f"(default: {EXACTNESS_DEFAULTS['dtype']})" in _option_help("check", "--dtype")
    for command in ("estimate", "plan"):
        assert f"(default: {default_of('seq_len', 'cuda')})" in _option_help(command, "--seq")
        assert f"default: {default_of('model', 'cuda')})" in _option_help(command, "--model")
    first = _option_help("maxlen", "--seq")
    assert (
        f"{default_of('seq_len', 'cuda', search=True)} cuda, {default_of('seq_len', 'cpu', search=True)} cpu" in first
    )
