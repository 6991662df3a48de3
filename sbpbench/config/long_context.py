"""How many steps a long point runs: the long-context protocol (how long a point may run: runner/timeout.py).

Long context: a point of T >= LONG_CONTEXT_SEQ_LEN defaults to LONG_CONTEXT_PROTOCOL, one memory step
then one timed step (no warm-up: on a GPU the memory step warms the kernels and caches for the timed
one; on the CPU it runs first anyway). At 32k a Qwen3-8B StreamBP step already takes seconds on an
H100 and minutes at 262k, so the default 1 + 1 + 3 steps would make a sweep 2.5x longer for a spread
of three; a warm-up or repeats given explicitly win.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

LONG_CONTEXT_SEQ_LEN = 32_768
LONG_CONTEXT_PROTOCOL = {"warmup": 0, "repeats": 1}


def long_context_defaults(given: MutableMapping[str, Any]) -> None:
    """Fill warm-up and repeats of a long point (T >= LONG_CONTEXT_SEQ_LEN) not given explicitly."""
    seq_len = given.get("seq_len")
    if isinstance(seq_len, int) and seq_len >= LONG_CONTEXT_SEQ_LEN:
        for name, value in LONG_CONTEXT_PROTOCOL.items():
            given.setdefault(name, value)
