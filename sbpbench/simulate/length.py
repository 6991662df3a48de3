"""Predicting a long sequence from a few short ones, for the peak that a full fake run at T takes
minutes to an hour to find (its cost is per op, and StreamBP's op count grows with T / chunk).

For fixed model, method, placement and chunk sizes, each op of the step runs at an instant
(instants.py: its phase, its StreamBP chunk counted from the end of the sequence, its order) that
exists at every length whose layer chunks end alike: lengths of one remainder by the layer chunk
(`period`). What is live at such an instant is a sum of blocks whose sizes are polynomials in T:
constant (a chunk's intermediates), linear (checkpoints, the K/V buffers, the dK/dV sums, one
chunk's prefix) or quadratic (HF's (T, T) attention mask, with bp and ckpt's padded batches), and
their count does not depend on T. So the live bytes at each instant, before the allocator rounds
each block up to 512 B, are a polynomial of degree 1 (streambp: no T x T term on any path) or 2
in T, fitted exactly from 2 or 3 sample lengths; the rounding is redone per block for the size
its site (the op that made it) has at T. The peak at T is the largest of these, its phase that
instant's. The chunks between the first and the last three exist at one length and not at another;
an op there holds what the same op holds in the third-to-last chunk (which follows a full chunk
as they do) with a shorter prefix, so it never exceeds it.

Refused (None; the caller runs the step at T), with the reason: when the phase of the peak moves
between the sample lengths (they straddle a change of regime), when a sample's peak is at an
instant the other samples lack, when an instant names different ops at two lengths, or when the
sample lengths are not shorter than T; and for the peers that loop over chunks of their own
(EXTRAPOLATED_METHODS). tests/estimator/test_simulate_length.py compares the prediction with the full run at
T to the byte over grids of T, remainders by each chunk size included.

Depth extrapolation (depth.py) composes with this: its shallow models are each predicted at T from
short samples of that depth. The other order would need the depth fit per instant; this one needs
nothing of depth.py beyond its rows.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np

from ..config import MaxlenSpec, RunSpec
from ..core import Placement
from ..core.internal import kv_heads_per_call
from ..methods import MethodFn
from ..methods.streambp import step_hooks
from ..models import load_config
from ..records.select import PROMPTED_OBJECTIVES
from .estimate import Estimate, StepMemory, assemble_unrun, estimate, granularity_bytes, simulate
from .instants import FIRST, InstantRecorder

GIB = 2**30
Note = Callable[[str], None]  # a line of progress or of why an extrapolation was refused

# Methods whose every op has an instant at every length: no loop over chunks (bp, ckpt and
# ckpt-offload run HF's forward once), or chunks named from the end (StreamBP). The chunked heads and
# tiled MLPs of the other peers number their ops on through a loop whose length follows T: run in full.
EXTRAPOLATED_METHODS = ("bp", "ckpt", "ckpt-offload", "streambp")
# StreamBP has no (T, T) term: its linear fit needs two samples; the others' HF forward
# materialises a padded (B, 1, T, T) mask, quadratic.
LINEAR_METHODS = ("streambp",)
# Lengths a full-sequence kernel rounds to (flash backward: the query length to 128, the
# efficient kernel's workspace to 64), and the 8 an SDPA mask's strides are padded to.
FULL_SEQUENCE_PERIOD = 128
MASK_ALIGNMENT = 8
HEAD_CHUNK = re.compile(r"(head (?:sums )?chunk|backward embedding chunk) (\d+)")


def period(spec: RunSpec) -> int:
    """Lengths this far apart end alike: StreamBP's last layer chunks (counted from the end) are the
    same size; a full-sequence kernel rounds them alike. The logits chunk does not enter: only head
    chunks counted from the first are compared (`_alike`). Chunk sizes must be numbers (not "auto")."""
    if spec.method in LINEAR_METHODS:
        return math.lcm(MASK_ALIGNMENT, spec.settings.chunk_size)
    return FULL_SEQUENCE_PERIOD


def sample_lengths(spec: RunSpec) -> list[int] | None:
    """The short lengths that predict spec.seq_len: of its remainder by `period`, long enough for
    four layer chunks (the first and the last three) and three head chunks with targets whatever
    the padding (under 20% of T: T > 2.5 chunks), prompts whole; None when they would not be
    shorter than spec.seq_len."""
    step = period(spec)
    chunk, logits = spec.settings.chunk_size or 0, spec.settings.logits_chunk_size or 0
    prompt = spec.prompt_len if spec.objective in PROMPTED_OBJECTIVES else 0  # whole from 2 x prompt_len on
    # a stream placement starts the copy of the next chunk under the previous chunk's key (core/placements/sequences.py):
    # one layer chunk and one head chunk more, as `_alike` compares one chunk fewer of each
    streamed = _streamed(spec)
    shortest = max((3 + streamed) * chunk + 1, math.ceil((2.5 + streamed) * logits) + 3 + prompt, 2 * prompt + 1, step)
    # P ranks sharing the sequence: the rule holds for each rank's T_loc = ceil(T / P); the samples
    # keep T's padding to a multiple of P, so their T_loc differ by whole periods (sequence_parallel.py)
    ranks = spec.sp
    local, pad = -(-spec.seq_len // ranks), -spec.seq_len % ranks
    if local < shortest:
        return None
    first = local - (local - shortest) // step * step
    count = 2 if spec.method in LINEAR_METHODS else 3
    lengths = [(first + i * step) * ranks - pad for i in range(count)]
    return lengths if lengths[-1] < spec.seq_len else None


def shared_multiple(search: MaxlenSpec) -> int:
    """Probe lengths of a max-length search that share their samples: multiples of the search's
    multiple_of and of `period` at the chunk sizes the longest probe runs with (the rule's "auto"
    gives the same from T = 3 x its largest layer chunk on)."""
    longest = search.probe(search.seq_len_ceiling)
    return math.lcm(search.multiple_of, period(longest))


@dataclass
class _Sample:
    seq_len: int
    estimate: Estimate
    record: InstantRecorder
    index: dict  # instant key -> op index
    unrounded: list[int]  # per op: live bytes before rounding


_SAMPLES: OrderedDict[tuple, _Sample] = OrderedDict()  # the latest: a search or a plan asks for the same again
KEPT_SAMPLES = 12


def _sample(
    spec: RunSpec, target: str, method: MethodFn | None, note: Note | None = None, sized_for: int | None = None
) -> _Sample:
    """The recorded run of spec (the last KEPT_SAMPLES are kept). sized_for: the length of the point
    it predicts, whose grouping of K/V heads per attention call it runs (core/attention.py)."""
    sized_for = sized_for or spec.seq_len
    key = (spec, target, method, attention_groups(spec, sized_for))
    if key in _SAMPLES:
        _SAMPLES.move_to_end(key)
        return _SAMPLES[key]
    with step_hooks(sized_for=sized_for):
        estimate, record = simulate(spec, target=target, method=method, counter_type=InstantRecorder)
    index = {key: i for i, key in enumerate(record.keys)}
    found = _SAMPLES[key] = _Sample(
        spec.seq_len, estimate, record, index, _unrounded(record, granularity_bytes(target))
    )
    while len(_SAMPLES) > KEPT_SAMPLES:
        _SAMPLES.popitem(last=False)
    if note:
        peak = f"{record.peak_bytes / GIB:.2f} GiB in {record.peak_phase}"
        depth = spec.num_layers or load_config(spec.model).num_hidden_layers
        note(f"sample T={spec.seq_len} ({depth} layers): peak {peak}")
    return found


def _streamed(spec: RunSpec) -> bool:
    """Whether spec runs a stream placement (core/placements/stream_store.py)."""
    return bool(spec.settings.checkpoints) and Placement.parse(spec.settings.checkpoints).stream


def attention_groups(spec: RunSpec, seq_len: int) -> int:
    """K/V heads per attention call of a StreamBP step of seq_len positions on spec's model (0 for
    other methods, which do not group)."""
    if spec.method != "streambp":
        return 0
    config = load_config(spec.model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads_per_call(spec.batch_size, heads, kv_heads, head_dim, spec.torch_dtype.itemsize, seq_len)


def predict(
    spec: RunSpec, *, target: str = "cuda", method: MethodFn | None = None, note: Note | None = None
) -> Estimate:
    """estimate_by_length's Estimate, or where it has none the full run's (estimate.estimate)."""
    return estimate_by_length(spec, target=target, method=method, note=note) or estimate(
        spec, target=target, method=method
    )


def predict_by_phase(
    spec: RunSpec, *, target: str = "cuda", method: MethodFn | None = None, note: Note | None = None
) -> tuple[Estimate, dict[str, int]]:
    """`predict`'s Estimate and the activation peak within each phase label, in the order the step
    enters them (depth.py lifts a shallow model by phase)."""
    found = _by_length(spec, target=target, method=method, note=note)
    if found is not None:
        return found
    result, counter = simulate(spec, target=target, method=method)
    return result, dict(counter.phase_peaks)


def _unrounded(record: InstantRecorder, granularity: int) -> list[int]:
    """Per op, the live bytes without the allocator's rounding of each block."""
    overhead = np.zeros(len(record.values) + 1, dtype=np.int64)
    for block in record.blocks:
        extra = -block.nbytes % granularity
        if extra:
            overhead[block.born] += extra
            overhead[len(record.values) if block.died is None else block.died] -= extra
    rounding = np.cumsum(overhead)[:-1]
    return [value - int(extra) for value, extra in zip(record.values, rounding)]


def _extrapolate(values: list[int], k: int) -> int:
    """The polynomial of degree len(values) - 1 through values at 0, 1, ..., evaluated at k (exact:
    Newton's forward differences, integer binomial coefficients)."""
    total, differences = 0, list(values)
    for order in range(len(values)):
        total += math.comb(k, order) * differences[0]
        differences = [b - a for a, b in pairwise(differences)]
    return total


def estimate_by_length(
    spec: RunSpec, *, target: str = "cuda", method: MethodFn | None = None, note: Note | None = None
) -> Estimate | None:
    """The Estimate of spec at its seq_len, from fake runs at `sample_lengths(spec)`; None when
    there are no shorter samples or the extrapolation is refused (note says why). Chunk sizes left
    to the rule ("auto") are the ones it gives at spec.seq_len, at every sample length too."""
    found = _by_length(spec, target=target, method=method, note=note)
    return None if found is None else found[0]


def _by_length(
    spec: RunSpec, *, target: str, method: MethodFn | None, note: Note | None
) -> tuple[Estimate, dict[str, int]] | None:
    """estimate_by_length's Estimate and its peak per phase label, or None."""
    if spec.method not in EXTRAPOLATED_METHODS:
        return None
    fixed = spec  # replace(spec, seq_len=...) keeps its chunk sizes
    lengths = sample_lengths(fixed)
    if lengths is None:
        return None
    granularity = granularity_bytes(target)
    samples = [_sample(replace(fixed, seq_len=seq_len), target, method, note, spec.seq_len) for seq_len in lengths]
    memory, why = _fit(samples, spec.seq_len, granularity, _streamed(fixed))
    if memory is None:
        if note:
            note(f"T={spec.seq_len} not extrapolated ({why}): running the step at T")
        return None
    last = samples[-1].estimate
    result = assemble_unrun(spec, memory, target)
    # the optimizer's state is counted after the step (under protocol first, made in it), as estimate() does
    result = result if spec.nproc > 1 else replace(result, optimizer_state_bytes=last.optimizer_state_bytes)
    return result, memory.phase_peaks


def _fit(
    samples: list[_Sample], seq_len: int, granularity: int, streamed: bool = False
) -> tuple[StepMemory | None, str]:
    """The step's memory at seq_len from the samples (equally spaced), or (None, why not). streamed:
    a stream placement's step (`_alike`)."""
    phases = {s.record.peak_phase for s in samples}
    if len(phases) > 1:
        return None, f"the peak moves between {' and '.join(sorted(phases))} across the sample lengths"
    kernels = {s.estimate.attention_kernel for s in samples}
    if len(kernels) > 1:
        return None, "the attention kernels differ across the sample lengths"
    last = samples[-1]
    alike = _alike(samples, streamed)
    shared = [key for key in last.record.keys if alike(key) and all(key in s.index for s in samples)]
    for s in samples:
        if max(s.record.values[s.index[key]] for key in shared) != s.record.peak_bytes:
            return None, f"the peak at T={s.seq_len} is in a chunk the other sample lengths lack"
        if any(s.record.ops[s.index[key]] is not last.record.ops[last.index[key]] for key in shared):
            return None, f"an instant names different ops at T={s.seq_len} and T={last.seq_len}"
    step = samples[1].seq_len - samples[0].seq_len
    k = (seq_len - samples[0].seq_len) // step
    overhead = _rounding_at(samples, k, granularity, alike)
    best, best_key, peaks = -1, None, {}
    for key in shared:
        value = _extrapolate([s.unrounded[s.index[key]] for s in samples], k) + int(overhead[last.index[key]])
        if value > best:
            best, best_key = value, key
        if value > peaks.get(key[0], -1):
            peaks[key[0]] = value

    def fitted(column: str) -> int:
        return _extrapolate([getattr(s.estimate, column) for s in samples], k)

    return StepMemory(
        activation_peak_bytes=best,
        peak_phase=best_key[0],
        attention_kernel=last.estimate.attention_kernel,
        host_pinned_bytes=fitted("host_pinned_bytes"),
        transfer_bytes=fitted("transfer_bytes"),
        phase_peaks=peaks,
    ), ""


def _head_chunk(label: str) -> tuple[str, int]:
    """("head chunk", k) of a "head chunk k" label (methods/phase_labels.py; or "head sums chunk",
    "backward embedding chunk": chunks numbered from the first as the head's are), ("", -1) for another."""
    match = HEAD_CHUNK.fullmatch(label)
    return (match.group(1), int(match.group(2))) if match else ("", -1)


def _alike(samples: list[_Sample], streamed: bool = False) -> Callable[[tuple], bool]:
    """Whether an instant key may name the same op in every sample. StreamBP's head chunks are
    numbered from the first processed one, and how many there are depends on the padding: a
    sample's last may be short and is followed by the head's closing ops, so of each pass only chunk
    numbers below every sample's last are alike. streamed: a chunk's ops before its lm_head call run
    under the previous chunk's label, and there the copy of the next chunk starts unless it is the
    last, so only numbers below every sample's last but one; likewise in a layer the chunk the
    shortest sample runs just before its last (the farthest from the end of its kind there) is not
    compared."""
    farthest: dict[str, int] = {}
    if streamed:
        shortest = min(samples, key=lambda s: s.seq_len)
        for key in shortest.record.keys:
            chunk = key[1]
            if chunk is not None and chunk[1] != FIRST:
                farthest[chunk[0]] = max(farthest.get(chunk[0], 0), chunk[1])
    below: dict[str, int] = {}
    for s in samples:
        last: dict[str, int] = {}
        for key in s.record.keys:
            family, number = _head_chunk(key[0])
            last[family] = max(last.get(family, -1), number)
        for family, number in last.items():
            below[family] = min(below.get(family, number), number)

    def alike(key: tuple) -> bool:
        family, number = _head_chunk(key[0])
        chunk = key[1]
        if chunk is not None and chunk[1] != FIRST and chunk[1] >= farthest.get(chunk[0], chunk[1] + 1):
            return False
        return not family or number < below.get(family, 0) - streamed

    return alike


def _rounding_at(samples: list[_Sample], k: int, granularity: int, alike: Callable[[tuple], bool]) -> np.ndarray:
    """Per op of the last sample: the allocator's rounding of its live blocks at the predicted
    length, each block's size fitted across the samples by its site. A block made where the other
    samples have no op (a chunk in the middle, a head chunk past the first ones) and still live at
    an instant they share is what that chunk left behind, sized by the chunk size and not by T: it
    is rounded as it is."""
    sizes = [{} for _ in samples]
    for table, s in zip(sizes, samples):
        for block in s.record.blocks:
            table[block.site] = block.nbytes
    last = samples[-1].record
    num_ops = len(last.values)
    overhead = np.zeros(num_ops + 1, dtype=np.int64)
    for block in last.blocks:
        shared = alike(block.site[0]) and all(block.site in table for table in sizes)
        nbytes = _extrapolate([table[block.site] for table in sizes], k) if shared else block.nbytes
        extra = -nbytes % granularity
        if extra:
            overhead[block.born] += extra
            overhead[num_ops if block.died is None else block.died] -= extra
    return np.cumsum(overhead)[:-1]
