"""StreamBP's chunk sizes chosen from the point: `--chunk-size auto` / `--logits-chunk-size auto`.

One rule, `auto_chunk_sizes`, a pure function of the point (T, batch, dtype, the model's shape and
the memory budget), so that the run config (a row's key holds the numbers it gives, before the
point runs) and the planner (simulate/plan.py) get the same numbers. core/README.md, "Chunk
sizes", says why; in short:

- Layer chunk c. Short T: T/3, at least 500 (the paper's timing and max-length settings at
  T = 9000). Each chunk re-reads and re-writes a layer's fp32 weight-gradient sums (about 1.9 GB
  per layer on Qwen3-8B) and a small chunk leaves SMs idle in its attention, so c grows with T up
  to LAYER_CHUNK_MAX, where the sums' traffic is about 5% of the chunk's matmul time on an
  H100-class GPU (12 B per weight against 8 FLOPs per weight per position: 224 / c of it).
- Logits chunk: per chunk the lm_head's fp32 gradient sum moves once too (240 / c of the head's
  matmul time by the same count), so as large as memory allows up to LOGITS_CHUNK_MAX (the paper
  used 100).
- Memory first: a chunk's activations grow with it, so each chunk stays within MEMORY_SHARE of the
  memory budget (the point's memory limit, else the paper's 80 GiB GPU), per-token bytes
  estimated from the shape (`layer_bytes_per_token`, `logits_bytes_per_token`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..settings import SETTINGS

PAPER_CHUNK: int = SETTINGS["chunk_size"].default  # the paper's layer chunk at T = 9000 for max length (appendix D)
LAYER_CHUNK_MAX = 4096  # sums' traffic ~5% of a chunk's matmul time (module docstring)
LOGITS_CHUNK_MAX = 1024  # the same ~25% of the head's, and the head is O(T) of an O(T^2) step
MIN_CHUNK = 16  # a floor for a budget so small that the memory share allows less
MEMORY_SHARE = 0.02  # of the memory budget, for one chunk's activations (layer or head)
DEFAULT_MEMORY_BYTES = 80 * 2**30  # the paper's GPU, when the point has no memory limit


class ChunkSizes(NamedTuple):
    chunk_size: int  # positions per layer chunk
    logits_chunk_size: int  # positions per head and loss chunk


def layer_bytes_per_token(config, dtype_bytes: int) -> int:
    """One decoder layer's activations per position while its chunk runs forward and backward: what
    it saves (norm outputs, q/k/v, attention output, the MLP's gate, up, act and product: about
    6 d + 4 I values) and, in backward, gradients of the same size. A config without
    intermediate_size (GPT-2's n_inner, a family bp and ckpt run) is taken as I = 4 d."""
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    return 2 * (6 * hidden + 4 * intermediate) * dtype_bytes


def logits_bytes_per_token(config, dtype_bytes: int) -> int:
    """The head's chunk per position: the log-softmax saved for backward and its incoming and
    outgoing gradients in the loss dtype (fp32, fp64 for a float64 model): 12 x V (core/README.md,
    "Memory per phase")."""
    return 3 * max(4, dtype_bytes) * config.vocab_size


def auto_chunk_sizes(
    config, *, seq_len: int, batch_size: int, dtype_bytes: int, memory_bytes: int | None = None
) -> ChunkSizes:
    """The chunk sizes for a point (module docstring); memory_bytes None: DEFAULT_MEMORY_BYTES."""
    share = MEMORY_SHARE * (memory_bytes or DEFAULT_MEMORY_BYTES)
    layer_fits = int(share // (batch_size * layer_bytes_per_token(config, dtype_bytes)))
    logits_fits = int(share // (batch_size * logits_bytes_per_token(config, dtype_bytes)))
    by_length = min(max(math.ceil(seq_len / 3), PAPER_CHUNK), LAYER_CHUNK_MAX)
    chunk = max(MIN_CHUNK, min(by_length, layer_fits))
    logits = max(MIN_CHUNK, min(LOGITS_CHUNK_MAX, logits_fits))
    return ChunkSizes(chunk, logits)
