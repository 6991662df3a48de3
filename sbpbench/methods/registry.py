"""The registry of compared methods by name, and `run_method`, the one entry every step goes through.

Each method is (model, batch, settings) -> loss: one forward and backward step that leaves .grad on
the trainable parameters (accumulating, like backward) and returns the detached loss. The names are
what the CLI and the results files use.

Adding a method: a module with its step function, one `Method` entry below, its name in
settings/choices.py METHOD_NAMES (the CLI lists the names without importing torch) and in the
`read_by` of each knob it reads (settings/table.py); experiment files, runner and results key follow.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

from ..core.internal import ATTENTION_NAME, count_targets, shift_labels
from ..data import Batch
from ..settings import EVERY_METHOD, SETTINGS, knobs_read_by
from .chunked_ce import ckpt_chunked_ce
from .hf_baseline import bp, ckpt
from .liger import liger
from .official import official
from .offload import ckpt_offload
from .settings import MethodSettings
from .streambp import streambp
from .tiled import tiled
from .trl_default import trl_default

MethodFn = Callable[[torch.nn.Module, Batch, MethodSettings], torch.Tensor]


class Method(NamedTuple):
    # the knobs it reads are those whose setting names it in `read_by` (settings.knobs_read_by)
    fn: MethodFn
    summary: str
    attn_implementation: str = "sdpa"  # what its rows record: transformers' name for the attention it runs
    external: bool = False  # runs in an environment of its own (runner/official.py), never in this process
    data_parallel: bool = False  # runs on several ranks with the model sharded by FSDP2 (--nproc > 1)


# keys: settings METHOD_NAMES (the CLI lists those without importing this module)
METHODS: dict[str, Method] = {
    "bp": Method(bp, "standard backpropagation: HF forward with full logits, no checkpointing", data_parallel=True),
    "ckpt": Method(ckpt, "the same with HF gradient checkpointing of every decoder layer", data_parallel=True),
    "streambp": Method(
        streambp,
        "exact StreamBP (sbpbench.core)",
        ATTENTION_NAME,
        data_parallel=True,
    ),
    # peers: what users reach for instead
    "ckpt-offload": Method(ckpt_offload, "ckpt with the layer checkpoints in host memory (transformers' offload=True)"),
    "ckpt-chunked-ce": Method(
        ckpt_chunked_ce,
        "ckpt + a chunked linear+loss head recomputed in backward (no B x T x V logits)",
    ),
    "tiled": Method(
        tiled,
        "ALST: offloaded ckpt + chunked loss head + tiled MLP (DeepSpeed TiledMLP), in PyTorch",
    ),
    "liger": Method(
        liger,
        "ckpt + liger-kernel's LigerFusedLinearCrossEntropyLoss (Triton, CUDA only; pip install -e .[peers])",
    ),
    "trl-default": Method(
        trl_default,
        "what TRL's trainers run by default: ckpt + TRL's fused LM head (log-probs in vocabulary tiles; pip install -e .[trl])",
    ),
    "official": Method(
        official,
        "the official StreamBP code (streambp 1.0, transformers 4.51.3) in its own virtualenv",
        external=True,
    ),
}


# What a command runs when no method is named (the settings table's default): the paper's
# comparison. Peers are asked for by name (`--method tiled`) or all at once (`--method all`).
DEFAULT_METHODS: tuple[str, ...] = SETTINGS["method"].default


def method_names(names) -> tuple[str, ...]:
    """The methods to run: DEFAULT_METHODS when none is named; "all" expands to every method."""
    if not names:
        return DEFAULT_METHODS
    expanded = [m for name in names for m in (METHODS if name == EVERY_METHOD else (name,))]
    return tuple(dict.fromkeys(expanded))


def data_parallel_unsupported(name: str, nproc: int) -> str | None:
    """Why `name` cannot run on `nproc` ranks, or None when it can (one rank: every method)."""
    if nproc == 1 or METHODS[name].data_parallel:
        return None
    runs = ", ".join(n for n, m in METHODS.items() if m.data_parallel)
    return f"{name} does not run data-parallel under FSDP2 here (--nproc {nproc}); methods that do: {runs}"


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def prepared_method(name: str, batch: Batch, settings: MethodSettings | None = None) -> partial:
    """The method's step function with the settings it reads (unset ones at their defaults), for
    steps on `batch`, which is checked here the same way for every method."""
    method = get_method(name)
    count_targets(shift_labels(batch.labels))  # every method refuses a batch with nothing to predict
    return partial(method.fn, settings=(settings or MethodSettings()).for_method(knobs_read_by(name)))


def run_method(name: str, model, batch: Batch, settings: MethodSettings | None = None) -> torch.Tensor:
    """One step of the method (prepared_method's checks and settings, then the step)."""
    return prepared_method(name, batch, settings)(model, batch)
