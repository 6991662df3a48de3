"""The external worker of the `official` method: the official StreamBP code (`streambp` 1.0,
github.com/Ledzy/StreamBP) in its own virtualenv, which pins transformers 4.51.3.

    <venv>/bin/python sbpbench/runner/official_driver.py RESULT.json < JOB.json

Run as a script, not as a module of the package: the virtualenv's transformers cannot import the
rest of sbpbench. It imports only sbpbench.measure (torch-only; the parent puts the repository on
PYTHONPATH), so time and memory are measured as the project's own worker measures them.

JOB (written by runner/official.py):
  mode          "measure" (one point: memory step, warm-up, timed steps) or "grads" (one step,
                gradients saved to grads_path for `sbp check`)
  config        the model config as a dict (this project's registry config, depth applied)
  weights_path  a state_dict to load (grads mode), or null: seeded random init (time and memory
                do not depend on the values)
  batch_path    {input_ids, attention_mask, labels} saved by the parent: this project's batch
  dtype, device, seed, chunk_size, logits_chunk_size, warmup, repeats, memory_limit
RESULT: the measured columns of a results row, plus status and error.

The official usage (its README): wrap the HF model in StreamModel, enable its gradient
checkpointing, and call the model with labels in training mode: the forward runs the backward too.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def _config(values: dict):
    """This project's config dict (transformers 5) as transformers 4.51 reads it: rope settings
    under rope_theta / rope_scaling instead of rope_parameters."""
    from transformers import AutoConfig

    values = dict(values)
    rope = values.pop("rope_parameters", None)
    if rope:
        rope = dict(rope)
        values["rope_theta"] = rope.pop("rope_theta", values.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            values["rope_scaling"] = rope
    for key in ("transformers_version", "architectures", "dtype", "torch_dtype"):
        values.pop(key, None)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def stream_model_class():
    """streambp's StreamModel, from its module file alone: the package's __init__ also imports its
    TRL trainers (trl, and through it datasets), which this driver never uses and which a machine
    without a package index would have to be carried. stream_model.py imports only torch and
    transformers."""
    import importlib.util
    from pathlib import Path

    package = importlib.util.find_spec("streambp")  # found, not run
    if package is None or not package.submodule_search_locations:
        raise ImportError("streambp is not installed in this virtualenv: run `sbp peers setup official`")
    path = Path(next(iter(package.submodule_search_locations))) / "stream_model.py"
    spec = importlib.util.spec_from_file_location("streambp_stream_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StreamModel


def build(job: dict):
    from transformers import AutoModelForCausalLM

    stream_model = stream_model_class()

    torch.manual_seed(job["seed"])
    dtype, device = DTYPES[job["dtype"]], torch.device(job["device"])
    model = AutoModelForCausalLM.from_config(_config(job["config"]), torch_dtype=dtype, attn_implementation="sdpa")
    if job.get("weights_path"):
        state = torch.load(job["weights_path"], map_location="cpu")
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.to(device)
    names = {id(p): n for n, p in model.named_parameters()}  # before StreamModel wraps the layers
    stream = stream_model(
        model,
        gradient_accumulation_steps=1,
        logits_chunk_size=job["logits_chunk_size"],
        stream_checkpoint=True,
        checkpoint_chunk_size=job["chunk_size"],
    )
    stream.gradient_checkpointing_enable()
    stream.train()
    batch = {k: v.to(device) for k, v in torch.load(job["batch_path"]).items()}
    return model, stream, batch, names


def prepare(model, protocol: str) -> None:
    """Gradients before a step, as the project's protocols say: steady = resident and zeroed in
    place, first = None. Either way they start at zero, which StreamModel needs: it divides every
    .grad by the token count at the end of its step."""
    for p in model.parameters():
        if protocol == "steady":
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
        else:
            p.grad = None


def step(model, stream, batch) -> float:
    """One official step: its forward runs the backward too; the loss back."""
    out = stream(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    return float(out.loss)


def measure(job: dict, model, stream, batch, result: dict) -> None:
    from sbpbench.measure.host_memory import peak_rss_bytes, reset_peak_rss, total_ram_bytes
    from sbpbench.measure.memory_cap import memory_cap
    from sbpbench.measure.tensor_tracker import LiveTensorTracker
    from sbpbench.measure.timing import time_steps

    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    protocol = job.get("protocol", "steady")
    prepare(model, protocol)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    resident += sum(t.numel() * t.element_size() for t in batch.values())
    if protocol == "steady":
        resident += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    capacity = torch.cuda.get_device_properties(device).total_memory if cuda else total_ram_bytes()
    cap = result["memory_limit_effective_bytes"] = memory_cap(job.get("memory_limit"), capacity)
    if cuda:
        if cap is not None and cap < capacity:
            torch.cuda.set_per_process_memory_fraction(cap / capacity, device)
        for _ in range(job["warmup"]):
            prepare(model, protocol)
            step(model, stream, batch)
        prepare(model, protocol)
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        result["baseline_bytes"] = torch.cuda.memory_allocated(device)
        result["loss"] = step(model, stream, batch)
        sync()
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        result["activation_peak_bytes"] = result["peak_allocated_bytes"] - result["baseline_bytes"]
    else:
        tracker = LiveTensorTracker(limit_bytes=None if cap is None else cap - resident)
        reset_peak_rss()
        try:
            with tracker:
                result["loss"] = step(model, stream, batch)
        finally:
            result["baseline_bytes"] = resident
            result["activation_peak_bytes"] = tracker.peak_bytes
            result["peak_allocated_bytes"] = resident + tracker.peak_bytes
            result["cpu_peak_rss_bytes"] = peak_rss_bytes()
        for _ in range(job["warmup"]):
            prepare(model, protocol)
            step(model, stream, batch)
    if job["repeats"]:
        timing = time_steps(
            lambda: step(model, stream, batch),
            repeats=job["repeats"],
            synchronize=sync,
            before_each=lambda: prepare(model, protocol),
        )
        result.update(time_median_s=timing.median_s, time_min_s=timing.min_s, time_max_s=timing.max_s)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python official_driver.py RESULT.json < JOB.json", file=sys.stderr)
        return 2
    from importlib.metadata import version

    import transformers

    job = json.loads(sys.stdin.read())
    result = {
        "status": "ok",
        "error": "",
        "transformers_version": transformers.__version__,
        "streambp_version": version("streambp"),
    }
    try:
        model, stream, batch, names = build(job)
        if job["mode"] == "grads":
            prepare(model, "first")
            result["loss"] = step(model, stream, batch)
            grads = {names[id(p)]: p.grad.detach().cpu() for p in model.parameters() if p.grad is not None}
            torch.save(grads, job["grads_path"])
        else:
            measure(job, model, stream, batch, result)
    except Exception as error:
        traceback.print_exc()
        name = type(error).__name__
        oom = isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "TrackedOutOfMemoryError" in name
        result["status"] = "oom" if oom or "out of memory" in str(error) else "error"
        result["error"] = f"{name}: {error}".splitlines()[0][:500]
    tmp = argv[0] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
