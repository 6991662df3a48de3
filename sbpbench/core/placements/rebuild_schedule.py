"""Which layer inputs the `stream:N` placement keeps in host memory, and which it rebuilds: binomial
checkpointing (Griewank's revolve, ACM TOMS 26(1), 2000), with StreamBP's order of work.

The backward of layer l reads its input X_l whole, chunk by chunk. With N host buffers of one layer
input each (B x T x d), one is the gradient's (dZ, written in place over Z_L by the head) and N - 1
hold layer inputs. X_0 needs none: it is the embedding of the input ids, recomputed chunk by chunk.
A layer's forward runs chunk by chunk and reads each input chunk before it writes that output
chunk, so X_{l+1} can overwrite X_l in its buffer: advancing m layers from a kept input X_j fills
one buffer, which then keeps X_{j+m}.

`extra_forwards(n, free)`: the fewest layer forwards that give the backward of layers [j, j + n)
their inputs, top layer first, when X_j is kept and `free` buffers are free. One layer needs none.
Otherwise advance m layers into a free buffer (X_{j+m} kept there), serve [j + m, j + n) with one
buffer fewer, free X_{j+m}'s buffer after its backward, then serve [j, j + m) with as many as before:

    F(1, c) = 0,   F(n, 0) = inf (n > 1),   F(n, c) = min over 1 <= m < n of m + F(n - m, c - 1) + F(m, c)

The checkpoint pass is the first advance: it runs every layer once (the head needs Z_L), keeping the
inputs this recursion keeps on its way up, and its last forward writes Z_L into the gradient's
buffer. So a step of L layers with N buffers runs F(L, N - 2) + 1 layer forwards, L of them the
pass's (`rebuilt_layers`: the rest). With N >= L every input stays (nothing rebuilt); with N = 2
each input is rebuilt from X_0 when its layer needs it, L (L - 1) / 2 - L + 1 forwards more.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

NEVER = 1 << 62  # F(n, 0) for n > 1: no buffer to advance into


@cache
def extra_forwards(layers: int, free: int) -> int:
    """F(layers, free) of the module docstring."""
    return _best(layers, free)[0]


@cache
def _best(layers: int, free: int) -> tuple[int, int]:
    """(F(layers, free), the advance m that gives it: the largest of the best)."""
    if layers <= 1:
        return 0, 0
    if free <= 0:
        return NEVER, 0
    if free >= layers - 1:  # a buffer for every input: one layer at a time
        return layers - 1, 1
    best, advance = NEVER, 0
    for m in range(1, layers):
        cost = m + extra_forwards(layers - m, free - 1) + extra_forwards(m, free)
        if cost <= best:
            best, advance = cost, m
    return best, advance


def advance(layers: int, free: int) -> int:
    """How far to advance from a kept X_j when layers [j, j + layers) need their inputs and `free`
    buffers are free (layers >= 2, free >= 1)."""
    assert layers >= 2 and free >= 1, (layers, free)
    return _best(layers, free)[1]


@dataclass(frozen=True)
class Schedule:
    """One step's plan. pass_kept: the inputs the checkpoint pass keeps (X_0 is always at hand);
    advances[l]: what the get of X_l runs first, (from, to) pairs, each advancing from the kept
    X_from to X_to in one fresh buffer, which keeps X_to."""

    num_layers: int
    num_buffers: int
    pass_kept: frozenset[int]
    advances: dict[int, tuple[tuple[int, int], ...]]

    @property
    def rebuilt(self) -> int:
        """Layer forwards beyond the checkpoint pass's."""
        return sum(end - start for steps in self.advances.values() for start, end in steps)

    @property
    def rebuilt_from_embedding(self) -> int:
        """Of those, the ones that read X_0 (the embedding, computed on the device: no host copy)."""
        return sum(1 for steps in self.advances.values() for start, _ in steps if start == 0)


@lru_cache(maxsize=64)
def schedule(num_layers: int, num_buffers: int) -> Schedule:
    """The plan of a step with num_layers layers and num_buffers host buffers (>= 2, or 1 for one
    layer): the pass advances as the recursion does from X_0 to X_{L-1}; then the gets of X_{L-1}
    down to X_0, each advancing from the nearest kept input below while it is not kept, each layer's
    input freed after its backward."""
    assert num_buffers >= min(2, every_input_buffers(num_layers)), (num_layers, num_buffers)
    kept, below, free = {0}, 0, input_buffers(num_buffers)
    while below < num_layers - 1:
        below += advance(num_layers - below, free)
        kept.add(below)
        free -= 1
    pass_kept = frozenset(kept - {0})
    advances = {}
    for index in reversed(range(num_layers)):
        below = max(k for k in kept if k <= index)
        free = input_buffers(num_buffers) - (len(kept) - 1)  # X_0 takes no buffer
        steps = []
        while below < index:
            step = advance(index + 1 - below, free)
            steps.append((below, below + step))
            below += step
            kept.add(below)
            free -= 1
        advances[index] = tuple(steps)
        kept.discard(index)
    return Schedule(num_layers, num_buffers, pass_kept, advances)


def input_buffers(num_buffers: int) -> int:
    """Of N host buffers, those for layer inputs: one is the gradient's."""
    return num_buffers - 1


def rebuilt_layers(num_layers: int, num_buffers: int) -> int:
    """Layer forwards a step of stream:N runs beyond the checkpoint pass's L (num_buffers >= 2):
    F(L, N - 2) + 1 - L, since the pass advances to X_{L-1} as the recursion does (F counts those
    L - 1 forwards) and then once more, to Z_L."""
    if num_layers <= 1:
        return 0
    return extra_forwards(num_layers, input_buffers(num_buffers)) + 1 - num_layers


def every_input_buffers(num_layers: int) -> int:
    """The N at which nothing is rebuilt (`stream`): X_1 .. X_{L-1} and the gradient's."""
    return max(1, num_layers)
