"""The knobs a method may read. Each method declares which (`Method.uses` in the registry); in a
spec and its results row the others are None, so a method's key holds only what changes it
(two `bp` rows never differ by a StreamBP chunk size)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ..core import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK_SIZE

DEFAULTS = {
    "chunk_size": DEFAULT_CHUNK_SIZE,  # positions per chunk in the layer backward
    "logits_chunk_size": DEFAULT_LOGITS_CHUNK_SIZE,  # positions per chunk in the head and loss
    "fp32_grad_accumulation": True,  # sum bf16 chunk gradients in fp32
    # tiled (ALST): positions per MLP tile; DeepSpeed's TiledMLP example uses tiles of about
    # hidden_size positions (2560 for Qwen3-4B, 4096 for Qwen3-8B), 2048 is that order
    "mlp_tile_size": 2048,
    "offload_checkpoints": True,  # tiled: layer checkpoints in host memory, as ALST does
    "checkpoints": "gpu",  # where the layer inputs live: gpu | cpu | recompute:K | cpu+recompute:K[+spill]
}


@dataclass(frozen=True, kw_only=True)
class MethodSettings:
    """None: the method's default (DEFAULTS) if it reads the knob, absent if it does not. Checked
    by the run config (sbpbench.config) and, for library callers, by stream_backward itself."""

    chunk_size: int | str | None = None  # "auto" in a run config: chosen per point (methods/chunk_sizes.py)
    logits_chunk_size: int | str | None = None
    fp32_grad_accumulation: bool | None = None
    mlp_tile_size: int | None = None
    offload_checkpoints: bool | None = None
    checkpoints: str | None = None  # a checkpoint placement's name (core/placement.py)

    def for_method(self, uses: tuple[str, ...]) -> MethodSettings:
        """The knobs in `uses` set (given or default), every other one None."""
        values = {f.name: None for f in fields(self)}
        for name in uses:
            given = getattr(self, name)
            values[name] = DEFAULTS[name] if given is None else given
        return replace(self, **values)

    def as_dict(self) -> dict:
        return asdict(self)


SETTING_NAMES = tuple(f.name for f in fields(MethodSettings))
