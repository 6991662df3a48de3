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
from .ulysses import deepspeed_missing, ulysses

MethodFn = Callable[[torch.nn.Module, Batch, MethodSettings], torch.Tensor]


class Method(NamedTuple):
    # the knobs it reads are those whose setting names it in `read_by` (settings.knobs_read_by)
    fn: MethodFn
    summary: str
    attn_implementation: str = "sdpa"  # what its rows record: transformers' name for the attention it runs
    external: bool = False  # runs in an environment of its own (runner/official.py), never in this process
    data_parallel: bool = False  # runs on several ranks with the model sharded by FSDP2 (--nproc > 1)
    # runs with ranks sharing each sequence (--sp > 1): takes a `sequence_parallel` keyword (a
    # core SequenceParallel) and leaves the whole sequence's gradient, as data_parallel methods do
    sequence_parallel: bool = False
    sequence_parallel_only: bool = False  # runs only so (--sp 1 gives a row saying why)
    equal_shares: bool = False  # cuts each sequence into sp equal shares: T a multiple of sp
    # why it cannot run in this environment (a library not installed), checked before any work where
    # it is named; None: it can
    unavailable: Callable[[], str | None] | None = None


# keys: settings METHOD_NAMES (the CLI lists those without importing this module)
METHODS: dict[str, Method] = {
    "bp": Method(bp, "standard backpropagation: HF forward with full logits, no checkpointing", data_parallel=True),
    "ckpt": Method(ckpt, "the same with HF gradient checkpointing of every decoder layer", data_parallel=True),
    "streambp": Method(
        streambp,
        "exact StreamBP (sbpbench.core)",
        ATTENTION_NAME,
        data_parallel=True,
        sequence_parallel=True,
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
    "ulysses": Method(
        ulysses,
        "ALST on several GPUs: DeepSpeed's Ulysses attention, TiledMLP and tiled loss, checkpointing "
        "(pip install -e .[deepspeed]; --sp 2 or more)",
        data_parallel=True,
        sequence_parallel=True,
        sequence_parallel_only=True,
        equal_shares=True,
        unavailable=deepspeed_missing,
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


# What runs when no method is named and ranks share each sequence (--sp above 1): the methods that can.
SEQUENCE_PARALLEL_METHODS: tuple[str, ...] = tuple(n for n, m in METHODS.items() if m.sequence_parallel)


def method_names(names, sp: int = 1) -> tuple[str, ...]:
    """The methods to run: DEFAULT_METHODS when none is named (SEQUENCE_PARALLEL_METHODS with sp
    above 1); "all" expands to every method (with sp above 1, every one that can share a sequence)."""
    if not names:
        return DEFAULT_METHODS if sp == 1 else SEQUENCE_PARALLEL_METHODS
    every = METHODS if sp == 1 else SEQUENCE_PARALLEL_METHODS
    expanded = [m for name in names for m in (every if name == EVERY_METHOD else (name,))]
    return tuple(dict.fromkeys(expanded))


def data_parallel_unsupported(name: str, nproc: int) -> str | None:
    """Why `name` cannot run on `nproc` ranks, or None when it can (one rank: every method)."""
    if nproc == 1 or METHODS[name].data_parallel:
        return None
    runs = ", ".join(n for n, m in METHODS.items() if m.data_parallel)
    return f"{name} does not run data-parallel under FSDP2 here (--nproc {nproc}); methods that do: {runs}"


def sequence_parallel_refusal(names, sp: int) -> str:
    """One line for methods that cannot share a sequence over sp ranks."""
    return (
        f"{', '.join(names)} cannot share a sequence over ranks (--sp {sp}); the methods that can: "
        f"{', '.join(SEQUENCE_PARALLEL_METHODS)}; name those, or give --sp 1"
    )


def sequence_parallel_unsupported(name: str, sp: int, seq_len: int) -> str | None:
    """Why `name` cannot run a T of seq_len over sp ranks sharing it, or None when it can (sp 1: every method)."""
    method = METHODS[name]
    if sp == 1:
        return None
    if not method.sequence_parallel:
        return sequence_parallel_refusal([name], sp)
    if method.equal_shares and seq_len % sp:
        return (
            f"{seq_len} is not a multiple of --sp {sp}: {name} cuts each sequence into {sp} equal shares; "
            f"give --seq {seq_len + sp - seq_len % sp}"
        )
    return None


def method_unavailable(name: str, sp: int = 1) -> str | None:
    """Why `name` cannot run here at all (before any work), or None: a sequence-parallel-only method
    at sp 1, a library that is not installed."""
    method = METHODS[name]
    if method.sequence_parallel_only and sp == 1:
        return f"{name} runs only on ranks sharing each sequence: give --sp 2 or more, and --nproc a multiple of it"
    return method.unavailable() if method.unavailable is not None else None


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def prepared_method(name: str, batch: Batch, settings: MethodSettings | None = None, sequence_parallel=None) -> partial:
    """The method's step function with the settings it reads (unset ones at their defaults), for
    steps on `batch`, which is checked here the same way for every method. sequence_parallel: the
    core SequenceParallel of the ranks sharing each sequence (a method that takes it, or ValueError)."""
    method = get_method(name)
    count_targets(shift_labels(batch.labels))  # every method refuses a batch with nothing to predict
    shared = {}
    if sequence_parallel is not None:
        if not method.sequence_parallel:
            raise ValueError(sequence_parallel_refusal([name], sequence_parallel.world))
        shared = {"sequence_parallel": sequence_parallel}
    return partial(method.fn, settings=(settings or MethodSettings()).for_method(knobs_read_by(name)), **shared)


def run_method(
    name: str, model, batch: Batch, settings: MethodSettings | None = None, sequence_parallel=None
) -> torch.Tensor:
    """One step of the method (prepared_method's checks and settings, then the step)."""
    return prepared_method(name, batch, settings, sequence_parallel)(model, batch)
