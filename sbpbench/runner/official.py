"""The `official` method: the official StreamBP code (`streambp` 1.0, code at github.com/Ledzy/StreamBP)
as an external worker. It pins transformers 4.51.3, which cannot share
this project's environment, so it runs in a virtualenv of its own that `sbp peers setup official`
creates, through official_driver.py, with the same protocol as the project's worker: one spec in
(as a job: this project's registry config, batch and, for `sbp check`, weights), one row out.

What is refused (status unsupported, with the reason): no virtualenv yet; objectives other than
SFT (the official GRPO/DPO paths are TRL trainers, not a step function); LoRA (peft is not in its
environment); step train; families other than Llama/Qwen2/Qwen3/Mistral (StreamModel assumes
their layer; Gemma has a separate class not driven here). Measured points use the driver's own
seeded initialisation (time and memory do not depend on the values); `sbp check` loads this
project's weights so the gradients can be compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..config import RunSpec
from ..config.run import DTYPES
from ..measure.environment import Environment
from ..records import ResultRow
from ..workload.build import make_spec_batch
from ..workload.rows import provenance, spec_fields
from .timeout import point_timeout_s

VENV_VARIABLE = "SBP_OFFICIAL_VENV"  # where the virtualenv is (default below)
DEFAULT_VENV = Path.home() / ".cache" / "sbpbench" / "peers" / "official"
# What the virtualenv installs, with what transformers 4.51.3 needs (numpy, huggingface-hub < 1.0,
# tokenizers < 0.22, ...). Of this environment it sees torch and torch's requirements alone, linked
# in (parent_torch.py): the same torch build, not a second copy. streambp 1.0 declares no
# dependencies; its __init__ imports its TRL trainers, which the driver skips (official_driver.py
# stream_model_class), so neither trl nor datasets is needed.
REQUIREMENTS = ("streambp==1.0", "transformers==4.51.3")
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
DRIVER = Path(__file__).with_name("official_driver.py")
REPOSITORY = Path(__file__).resolve().parents[2]  # the driver imports sbpbench.measure from here


def venv_dir() -> Path:
    return Path(os.environ.get(VENV_VARIABLE) or DEFAULT_VENV).expanduser()


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def setup_commands(path: Path, wheels: Path | None = None) -> list[list[str]]:
    """The commands `sbp peers setup official` runs, in order; wheels: a directory to install
    from instead of the package index (pip --no-index --find-links)."""
    python = str(path / "bin" / "python")
    source = ["--no-index", "--find-links", str(wheels)] if wheels is not None else []
    # the driver's imports, with this torch: transformers' Trainer is the import a leaked package breaks
    check = (
        "import importlib.metadata as m, torch, transformers; from transformers import Trainer; "
        f"assert torch.__version__ == {torch.__version__!r}, torch.__file__; "
        "print('streambp', m.version('streambp'), 'transformers', transformers.__version__, 'torch', torch.__version__)"
    )
    return [
        [sys.executable, "-m", "venv", str(path)],
        [sys.executable, "-m", "sbpbench.runner.parent_torch", str(path)],
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-warn-conflicts", *source, *REQUIREMENTS],
        [python, "-c", check],
    ]


def unsupported_reason(spec: RunSpec, model_type: str) -> str:
    """Why this point cannot run through the official code, or "" if it can."""
    if not venv_python().exists():
        return f"the official StreamBP code runs in its own virtualenv: create it with `sbp peers setup official` (looked in {venv_dir()}, ${VENV_VARIABLE})"
    if spec.objective != "sft":
        return f"the official code's {spec.objective} path is a TRL trainer, not a step this driver runs"
    if spec.lora_rank:
        return "LoRA is not driven through the official code (peft is not in its environment)"
    if spec.step != "bp":
        return "only step bp (forward + backward) is driven through the official code"
    if model_type not in FAMILIES:
        return f"the official StreamModel handles {', '.join(FAMILIES)} layers, not {model_type}"
    if spec.sdpa_backend != "auto":
        return "--sdpa-backend is not forced inside the official code's environment: run it with auto"
    return ""


def _job(spec: RunSpec, tmp: Path, config, *, mode: str, weights: dict | None = None) -> dict:
    batch = make_spec_batch(spec, config)
    batch_path, weights_path = tmp / "batch.pt", None
    torch.save({k: getattr(batch, k) for k in ("input_ids", "attention_mask", "labels")}, batch_path)
    if weights is not None:
        weights_path = tmp / "weights.pt"
        torch.save(weights, weights_path)
    return {
        "mode": mode,
        "config": config.to_dict(),
        "weights_path": None if weights_path is None else str(weights_path),
        "batch_path": str(batch_path),
        "grads_path": str(tmp / "grads.pt"),
        "dtype": spec.dtype,
        "device": spec.device,
        "seed": spec.seed,
        "chunk_size": spec.settings.chunk_size,
        "logits_chunk_size": spec.settings.logits_chunk_size,
        "warmup": spec.warmup,
        "repeats": spec.repeats,
        "memory_limit": spec.memory_limit,
        "protocol": spec.protocol,
        "num_tokens": batch.num_tokens,
    }


def run_driver(job: dict, tmp: Path, timeout_s: float) -> dict:
    """One job through the driver in the official virtualenv; its result, or an error result."""
    result_path = tmp / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    try:
        done = subprocess.run(
            [str(venv_python()), str(DRIVER), str(result_path)],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no result after {timeout_s:g} s (--timeout)"}
    if result_path.exists():
        return json.loads(result_path.read_text())
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return {"status": "error", "error": f"driver exited with code {done.returncode}: {lines[-1] if lines else ''}"}


def _config(spec: RunSpec):
    from ..models import load_config

    return load_config(spec.model, **({"num_hidden_layers": spec.num_layers} if spec.num_layers else {}))


def run_official(spec: RunSpec, env: Environment) -> ResultRow:
    """Measure one point through the official code; the row as the project's worker writes it,
    with the official environment's transformers version."""
    row = ResultRow(**spec_fields(spec))
    row.weights = "random"  # the driver builds the config's model itself, never a checkpoint's weights
    for name, value in provenance(env).items():
        setattr(row, name, value)
    config = _config(spec)
    reason = unsupported_reason(spec, config.model_type)
    if reason:
        row.status, row.error = "unsupported", reason
        return row
    with tempfile.TemporaryDirectory(prefix="sbp-official-") as tmp:
        job = _job(spec, Path(tmp), config, mode="measure")
        result = run_driver(job, Path(tmp), point_timeout_s(spec))
    row.num_tokens, row.timeout_s = job["num_tokens"], point_timeout_s(spec)
    _count_model(spec, config, row)
    row.transformers_version = result.pop("transformers_version", "")
    result.pop("streambp_version", None)
    for name, value in result.items():
        setattr(row, name, value)
    if row.status == "ok" and row.time_median_s:
        row.tokens_per_s = spec.batch_size * spec.seq_len / row.time_median_s
        row.tflops_per_s = row.model_flops / row.time_median_s / 1e12
    return row


def _count_model(spec: RunSpec, config, row: ResultRow) -> None:
    """The model columns the project's worker fills, from this project's model built without
    storage (meta tensors): the same shapes the driver builds."""
    from transformers import AutoModelForCausalLM

    from ..measure.flops import training_flops

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    row.num_layers = config.num_hidden_layers
    row.num_params = row.trainable_params = sum(p.numel() for p in model.parameters())
    row.model_flops = training_flops(model, batch_size=spec.batch_size, seq_len=spec.seq_len)
    bytes_per = torch.finfo(DTYPES[spec.dtype]).bits // 8
    row.weights_bytes = row.grads_bytes = row.num_params * bytes_per


def official_gradients(spec: RunSpec, model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step of the official code on `model`'s weights and the spec's batch: (loss, {name:
    grad}) for `sbp check`. Raises RuntimeError with the reason when it cannot run."""
    reason = unsupported_reason(spec, model.config.model_type)
    if reason:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory(prefix="sbp-official-") as tmp:
        weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        job = _job(spec, Path(tmp), model.config, mode="grads", weights=weights)
        result = run_driver(job, Path(tmp), point_timeout_s(spec))
        if result["status"] != "ok":
            raise RuntimeError(result["error"])
        grads = torch.load(job["grads_path"])
    return torch.tensor(result["loss"], dtype=torch.float64), grads
