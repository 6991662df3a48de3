"""The results-row columns a spec fixes before anything runs, the key of its row, and the columns
the environment it ran in fills."""

from __future__ import annotations

from dataclasses import fields
from functools import cache

from ..config.run import RunSpec
from ..data import prompt_length
from ..measure.environment import Environment
from ..methods import METHODS
from ..records import ResultRow, row_key

_ROW_FIELDS = {f.name for f in fields(ResultRow)}


@cache
def _full_depth(model: str) -> int | None:
    from ..models import load_config

    try:
        return load_config(model).num_hidden_layers
    except (OSError, ValueError):  # a model that cannot be built: its row says why elsewhere
        return None


def spec_fields(spec: RunSpec) -> dict:
    """The row columns a spec fixes before anything runs. num_layers is the depth that will be
    built (a full model's from its config), so a row keyed before running equals the measured one."""
    return {
        "model": spec.model,
        "num_layers": spec.num_layers or _full_depth(spec.model),
        "method": spec.method,
        "objective": spec.objective,
        "step": spec.step,
        "lora_rank": spec.lora_rank,
        "lora_alpha": spec.lora_alpha if spec.lora_rank else None,
        "prompt_len": prompt_length(spec.seq_len, spec.prompt_len) if spec.objective != "sft" else None,
        "seq_len": spec.seq_len,
        "batch_size": spec.batch_size,
        "nproc": spec.nproc,
        "sp": spec.sp,
        "dtype": spec.dtype,
        "device": spec.device,
        "protocol": spec.protocol,
        **spec.settings.as_dict(),  # None where the method does not read it; "auto" as the number chosen
        "auto_settings": ";".join(spec.auto_settings),
        "attn_implementation": METHODS[spec.method].attn_implementation,
        "sdpa_backend": spec.sdpa_backend,
        "memory_limit_bytes": spec.memory_limit,
        "seed": spec.seed,
        "weights": "real" if spec.weights else "random",
        "warmup_steps": spec.warmup,
        "repeats": spec.repeats,
        "memory_source": "torch.cuda" if spec.device.startswith("cuda") else "tensor-tracker",
    }


def spec_key(spec: RunSpec, *, device_name: str, source: str = "measured", kind: str = "point") -> tuple[str, ...]:
    """The results-CSV key of the row this spec will give on a device called device_name (a
    maxlen answer row: kind maxlen, no seq_len)."""
    values = {**spec_fields(spec), "kind": kind, "source": source, "device_name": device_name}
    if kind == "maxlen":
        values["seq_len"] = None
    return row_key(values)


def provenance(env: Environment) -> dict:
    """The row columns an environment fills (all but `device`, which the spec sets)."""
    values = env.as_dict()
    return {k: v for k, v in values.items() if k in _ROW_FIELDS and k != "device"}
