"""Any Hub model (`--model ORG/NAME`): its config.json from a Hugging Face cache laid out as
huggingface_hub lays it out (no network), random weights unless asked, never a repository's code."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import huggingface_hub
import pytest
import torch
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.config import point_specs
from sbpbench.config.experiment import load_experiment
from sbpbench.models import UnsupportedModelError, build_model, config_dict, full_depth, load_config
from sbpbench.records import KEY_COLUMNS, read_rows
from sbpbench.settings import model_names
from sbpbench.workload.rows import spec_fields

from ..conftest import cli_env

runner = CliRunner()
HUB_ID = "acme/tiny-qwen2"  # a made-up repository: only the cache below has it
SHA = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(cache: Path, repo_id: str, config: dict, files: dict[str, str] | None = None) -> Path:
    """A model in the HF cache as huggingface_hub leaves it: models--ORG--NAME/refs/main names the
    snapshot, snapshots/<sha>/config.json (blobs and symlinks left out: readers follow the snapshot);
    returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(SHA)
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (snapshot / name).write_text(text)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty HF cache for this process (huggingface_hub reads HF_HUB_CACHE at import, so its
    constant is set too) and for subprocesses; offline, as every test is (conftest)."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def tiny_hub_model(hub_cache) -> Path:
    """HUB_ID in the cache: tiny/qwen2's config.json, as if published on the Hub; its snapshot folder."""
    return lay_out_cache(hub_cache, HUB_ID, config_dict("tiny/qwen2"))


def test_a_hub_id_in_the_cache_builds_with_random_weights(tiny_hub_model):
    """A Hub id not in the registry loads its cached config.json and builds seeded random weights."""
    config = load_config(HUB_ID)
    expected = json.loads((tiny_hub_model / "config.json").read_text())
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == (
        "qwen2",
        expected["hidden_size"],
        expected["num_hidden_layers"],
    )
    a, b = build_model(HUB_ID, seed=3), build_model(HUB_ID, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert full_depth(HUB_ID) == expected["num_hidden_layers"]  # plots mark truncated rows of Hub models too


def test_sbp_estimate_and_plan_take_a_hub_id(tiny_hub_model, tmp_path):
    """The estimator paths need only the config: `sbp estimate` predicts a Hub model's point and
    writes its row; `sbp plan` plans it."""
    out = tmp_path / "e.csv"
    args = ["--model", HUB_ID, "--seq", "64", "--dtype", "fp32"]
    result = runner.invoke(app, ["estimate", *args, "--method", "streambp", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (row,) = read_rows(out)
    assert (row["model"], row["status"], row["source"], row["weights"]) == (HUB_ID, "ok", "simulated", "random")
    result = runner.invoke(app, ["plan", *args, "--gpu-memory", "80GiB", "--host-memory", "64GiB"])
    assert result.exit_code == 0, result.output
    assert f"sbp run --model {HUB_ID} --seq 64" in result.output and "--checkpoints" in result.output


def test_an_experiment_file_takes_a_hub_id(tiny_hub_model, tmp_path):
    """An experiment point may name a Hub id that the cache has."""
    path = tmp_path / "hub.toml"
    path.write_text(f'description = "x"\n[[points]]\nmodel = "{HUB_ID}"\nmethod = "bp"\nseq_len = 32\n')
    (spec,) = load_experiment(path, device="cpu").grid
    assert spec.model == HUB_ID


def test_a_hub_id_missing_from_the_cache_says_what_to_do(hub_cache):
    """Neither registry nor cache (offline: no download tried): one line naming both and how to get it."""
    result = runner.invoke(app, ["run", "--model", "acme/absent", "--seq", "16", "--device", "cpu"])
    assert result.exit_code == 2
    line = " ".join(result.output.split())
    assert "unknown model 'acme/absent': not in the registry" in line and str(hub_cache) in line
    assert "`hf download acme/absent config.json`" in line and "local checkpoint directory" in line
    assert "HF_HUB_OFFLINE" in line and "Traceback" not in result.output


def test_a_model_that_needs_its_repository_code_is_refused_and_none_runs(hub_cache, tmp_path):
    """A config.json with auto_map (remote code) is refused in one line; the repository's module is never imported."""
    marker = tmp_path / "ran"
    config = {**config_dict("tiny/qwen2"), "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}
    code = f"open({str(marker)!r}, 'w').close()\n"
    lay_out_cache(hub_cache, "acme/custom", config, {"configuration_acme.py": code, "modeling_acme.py": code})
    for command in (["run", "--device", "cpu"], ["estimate"]):
        result = runner.invoke(app, [*command, "--model", "acme/custom", "--seq", "16"])
        assert result.exit_code == 2, result.output
        assert "unsupported model: acme/custom needs code from its repository" in " ".join(result.output.split())
    with pytest.raises(UnsupportedModelError, match="never runs remote code"):
        build_model("acme/custom")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (
            {"model_type": "acme-net", "hidden_size": 8},
            "model_type 'acme-net', which this transformers does not implement",
        ),
        (
            {
                "model_type": "bert",
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "vocab_size": 64,
            },
            "not a decoder-only causal LM",
        ),
    ],
)
def test_a_hub_model_that_is_not_a_known_causal_lm_is_refused(hub_cache, config, words):
    """An unknown model_type, or an encoder (BERT): one line, before anything runs."""
    lay_out_cache(hub_cache, "acme/other", config)
    result = runner.invoke(app, ["run", "--model", "acme/other", "--seq", "16", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.output.split()) and "Traceback" not in result.output


def test_real_weights_come_from_the_cache_only_when_asked(tiny_hub_model):
    """weights=True loads the cached snapshot's weights; by default they are random."""
    saved = build_model("tiny/qwen2", seed=11)
    saved.save_pretrained(tiny_hub_model)
    loaded = build_model(HUB_ID, weights=True)
    for (name, p), q in zip(saved.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(build_model(HUB_ID, seed=0).lm_head.weight, saved.lm_head.weight)


def test_weights_that_are_not_there_are_refused_before_any_work(tiny_hub_model, tmp_path):
    """--weights with no weights in the cache, a shard missing, or a registry test shape: one line
    that says how to get them (never a download), before any process starts."""
    with pytest.raises(
        FileNotFoundError, match=r"not in the Hugging Face cache; download them \(`hf download acme/tiny-qwen2`\)"
    ):
        point_specs({"model": HUB_ID, "seq_len": 16, "weights": True, "device": "cpu"}, ["bp"])
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tiny_hub_model / "model.safetensors.index.json").write_text(json.dumps(index))
    (tiny_hub_model / "model-00001-of-00002.safetensors").write_text("")
    with pytest.raises(FileNotFoundError, match="1 of 2 weight shards"):
        point_specs({"model": HUB_ID, "seq_len": 16, "weights": True, "device": "cpu"}, ["bp"])
    result = runner.invoke(app, ["run", "--model", "tiny/qwen3", "--weights", "--seq", "16", "--device", "cpu"])
    assert result.exit_code == 2 and "no published weights; drop --weights" in " ".join(result.output.split())


def test_a_row_records_whether_its_weights_were_real_outside_its_key(tiny_hub_model):
    """weights is a row column (real | random), not a key column: the same point either way."""
    (random,) = point_specs({"model": "tiny/qwen3", "seq_len": 16, "device": "cpu"}, ["bp"])
    real = replace(random, weights=True)
    assert (spec_fields(random)["weights"], spec_fields(real)["weights"]) == ("random", "real")
    assert "weights" not in KEY_COLUMNS


def test_sbp_models_says_hub_ids_work():
    """`sbp models` says that any Hub id works, where its config comes from and --weights."""
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "Any other Hub id works too (--model ORG/NAME)" in text and "--weights" in text


@pytest.mark.slow
def test_sbp_run_measures_a_hub_model_from_a_cache_under_hf_home(tmp_path):
    """The installed `sbp run` in a fresh process, HF_HOME pointing at a cache laid out by hand and
    HF_HUB_OFFLINE=1: bp and streambp measured on the Hub id, rows marked random weights."""
    lay_out_cache(tmp_path / "home" / "hub", HUB_ID, config_dict("tiny/qwen2"))
    out = tmp_path / "r.csv"
    env = {**cli_env(), "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    args = ["--model", HUB_ID, "--seq", "32", "--method", "bp", "streambp", "--repeats", "1", "--warmup", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "sbpbench", "run", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = read_rows(out)
    assert [(r["model"], r["method"], r["status"], r["weights"]) for r in rows] == [
        (HUB_ID, "bp", "ok", "random"),
        (HUB_ID, "streambp", "ok", "random"),
    ]


def test_a_config_missing_from_the_cache_is_fetched_unless_offline(hub_cache, tmp_path, monkeypatch):
    """Online, a config.json the cache lacks comes from hf_hub_download (a stand-in here: no network);
    a failed fetch says why in a few words; offline, or with the Hub unreachable, nothing is fetched."""
    fetched = tmp_path / "fetched" / "config.json"
    fetched.parent.mkdir()
    fetched.write_text(json.dumps(config_dict("tiny/qwen2")))
    calls = []

    def download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename))
        if repo_id == "acme/gone":
            raise huggingface_hub.errors.LocalEntryNotFoundError("a long paragraph about connections")
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_names, "hub_reachable", lambda: True)  # as if the network were there
    assert load_config("acme/online").hidden_size == json.loads(fetched.read_text())["hidden_size"]
    with pytest.raises(ValueError, match=r"not in the Hugging Face cache \(.*; the Hub could not be reached\)"):
        load_config("acme/gone")
    assert calls == [("acme/online", "config.json"), ("acme/gone", "config.json")]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
        load_config("acme/online")
    assert len(calls) == 2
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_names, "hub_reachable", lambda: False)  # no network: said without a download's retries
    with pytest.raises(ValueError, match="the Hub could not be reached"):
        load_config("acme/online")
    assert len(calls) == 2
