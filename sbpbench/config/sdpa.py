"""`--sdpa-backend`: one scaled-dot-product-attention kernel forced for every method of a point;
`--set chunk_attention=KERNEL`: StreamBP's kernel for a chunk's attention over its prefix (core/kernels/kernel_choice.py).

bp and ckpt reach SDPA through transformers' sdpa attention, streambp through its own attention
function (core/attention.py); both call torch's SDPA, so `torch.nn.attention.sdpa_kernel` around the
step (measure/sdpa.py) holds for all of them, StreamBP's lower-right causal bias included (torch's
CausalBias dispatch checks the same enabled flags, and materialises the mask for math or cuDNN).
The names are settings/choices.py's (the CLI lists them without torch).
"""

from __future__ import annotations

from ..settings import ConfigError
from ..settings.choices import CPU_CHUNK_ATTENTION, CPU_SDPA_BACKENDS, SDPA_BACKENDS


def check_sdpa_backend(name: str, device: str) -> None:
    """Refuse, before anything runs, a backend unknown or absent on the device kind."""
    if name not in SDPA_BACKENDS:
        raise ConfigError("sdpa_backend", f"unknown {{field}} {name!r}; choose from {', '.join(SDPA_BACKENDS)}")
    if not device.startswith("cuda") and name not in CPU_SDPA_BACKENDS:
        raise ConfigError(
            "sdpa_backend",
            f"{name} has no CPU kernel; on {device} choose from {', '.join(CPU_SDPA_BACKENDS)} (or run on a GPU)",
        )


def check_chunk_attention(name: str | None, device: str, sdpa_backend: str) -> None:
    """Refuse, before anything runs, a StreamBP chunk kernel absent on the device kind, or one
    forced beside a forced SDPA kernel (which asked for that kernel everywhere). None: a method
    that does not read it. Whether a GPU has the kernel is core's check, at the step's start."""
    if name is None or name in ("auto", "lower-right"):
        return
    if not device.startswith("cuda") and name not in CPU_CHUNK_ATTENTION:
        raise ConfigError(
            "chunk_attention", f"{name} has no CPU kernel; on {device} choose from {', '.join(CPU_CHUNK_ATTENTION)}"
        )
    if sdpa_backend != "auto":
        raise ConfigError(
            "chunk_attention",
            f"{name} is its own kernel, but --sdpa-backend {sdpa_backend} forces SDPA's; give one of the two",
        )
