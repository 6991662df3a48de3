"""How StreamBP cuts a sequence: into chunks (`chunk_bounds`, a layer's arguments sliced to a chunk:
`chunk_kwargs`), and which keys each query sees, by the padding and the packed documents of a
batch (core/README.md, "Batch layouts").

One rule for every phase: the checkpoint pass and the layer backward cut [0, T) into chunks of
`chunk_size`, the head into chunks of `logits_chunk_size`. The last chunk is shorter when
chunk_size does not divide T; chunk_size >= T gives a single chunk. A layer run on a chunk gets
the arguments the model passed it (checkpoints.py records them) sliced to the chunk's positions.

Each row of the batch is cut into segments [start, end), and a query attends, causally and within
the sliding window, to the keys of its own segment only:
- left padding (TRL's GRPO prompts: `attention_mask` 0...0 1...1, no position_ids): [0, o) is a
  segment of its own, so no real query sees a pad key, as under transformers' padding mask. The
  positions stay those transformers gives that call, arange(T) pads included (its decoder's
  default), so RoPE and the window are the model's own;
- packed documents (`position_ids` 0, 1, ..., restarting at 0 for each document: TRL's
  padding-free rows, the layout transformers' FlashAttention varlen path reads): a segment per
  document, so a row is what BP gives on each document run on its own;
- right padding: trailing pads join the segment before them; they come after it causally and
  change nothing it computes.
A segment without a counted target is dead: no counted prediction depends on its positions (no
other segment reads its keys), so its queries' attention is zeros instead of computed, and its
gradient is zero as standard BP's is there.

A chunk [start, end) of queries becomes, per row, pieces cut at the segment boundaries, each
attending to one contiguous key range that ends where its queries end (`ChunkPlan`): the attention
function runs SDPA per piece with the lower-right causal alignment, never a (c, n) mask beyond the
sliding window's. Consecutive rows with the same pieces share one SDPA call.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import pairwise

import torch


def chunk_bounds(seq_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """[(start, end), ...] covering [0, seq_len) in order, each end - start <= chunk_size."""
    return [(start, min(start + chunk_size, seq_len)) for start in range(0, seq_len, chunk_size)]


def chunk_kwargs(kwargs: dict, start: int, end: int) -> dict:
    """Slice a layer's per-position arguments to positions [start, end)."""
    sliced = {}
    for name, value in kwargs.items():
        if value is None:  # an argument the model leaves unset (no RoPE: position_embeddings None)
            pass
        elif name.startswith("position_embeddings"):  # (cos, sin), each (B or 1, T, head_dim)
            value = tuple(t[:, start:end] for t in value) if isinstance(value, tuple) else value[:, start:end]
        elif name == "position_ids":  # (B or 1, T)
            value = value[..., start:end]
        elif name == "cache_position":  # (T,)
            value = value[start:end]
        elif isinstance(value, torch.Tensor):
            raise NotImplementedError(
                f"StreamBP does not know how to slice the decoder-layer argument {name!r} along the sequence"
            )
        sliced[name] = value
    return sliced


def window_start(start: int, sliding_window: int | None) -> int:
    """First key position that a query at `start` sees (HF: attend iff q - k < window)."""
    return 0 if sliding_window is None else max(0, start - sliding_window + 1)


@dataclass(frozen=True)
class Piece:
    """Queries [start, end) of one segment attend to keys [key_start, end); key_start None: a dead
    segment, whose attention output is zeros."""

    start: int
    end: int
    key_start: int | None


@dataclass(frozen=True)
class RowGroup:
    rows: slice  # consecutive rows whose chunk has the same pieces
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class ChunkPlan:
    """The attention of one chunk of queries. key_start: the first key any of its queries sees
    (at most the chunk's start: the keys handed to the attention are [key_start, end)). groups None:
    every row attends as one piece over [key_start, end), one SDPA call for the batch."""

    key_start: int
    groups: tuple[RowGroup, ...] | None = None


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    live: bool  # holds a counted target


class SequenceLayout:
    """Per row, the segments covering [0, T) in order (module docstring)."""

    def __init__(self, rows: list[list[Segment]]):
        self.rows = rows
        self._starts = [[segment.start for segment in row] for row in rows]
        self._plans: dict[tuple[int, int, int | None], ChunkPlan] = {}

    def plan(self, start: int, end: int, sliding_window: int | None) -> ChunkPlan:
        """The pieces of queries [start, end) in every row (cached: each chunk is planned once per
        window, though every layer runs it)."""
        key = (start, end, sliding_window)
        if key not in self._plans:
            self._plans[key] = self._make_plan(start, end, sliding_window)
        return self._plans[key]

    def _make_plan(self, start: int, end: int, sliding_window: int | None) -> ChunkPlan:
        per_row = [self._row_pieces(index, start, end, sliding_window) for index in range(len(self.rows))]
        key_starts = [p.key_start for pieces in per_row for p in pieces if p.key_start is not None]
        key_start = min([start, *key_starts])
        first = per_row[0]
        if all(pieces == first for pieces in per_row) and first == (Piece(start, end, key_start),):
            return ChunkPlan(key_start)  # one piece, the same for every row: one call, no row loop
        groups, row = [], 0
        for index in range(1, len(per_row) + 1):
            if index == len(per_row) or per_row[index] != per_row[row]:
                groups.append(RowGroup(slice(row, index), per_row[row]))
                row = index
        return ChunkPlan(key_start, tuple(groups))

    def _row_pieces(self, row: int, start: int, end: int, sliding_window: int | None) -> tuple[Piece, ...]:
        segments, first = self.rows[row], bisect_right(self._starts[row], start) - 1
        pieces = []
        for segment in segments[first:]:
            if segment.start >= end:
                break
            query_start, query_end = max(segment.start, start), min(segment.end, end)
            keys = max(segment.start, window_start(query_start, sliding_window)) if segment.live else None
            pieces.append(Piece(query_start, query_end, keys))
        return tuple(pieces)


def build_layout(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    counted: torch.Tensor,
    *,
    packing_refused: str | None = None,
) -> SequenceLayout | None:
    """The segments of a (B, T) batch, or None when every row is one segment from position 0
    (no padding, or right padding only: the attention needs no plan). counted (B, T) bool: the
    objective's counted targets, counted[b, t] when position t predicts a counted label.
    packing_refused: why the objective cannot take packed rows (None: it can). Raises ValueError,
    before any work, for a layout StreamBP cannot make exact."""
    batch, seq_len = counted.shape
    counted = counted.cpu()  # read row by row below: one copy, not one device sync per read
    real = _real_spans(attention_mask, batch, seq_len)
    starts = _document_starts(position_ids, real, batch, seq_len)
    if packing_refused is not None and any(len(row) > 1 for row in starts):
        raise ValueError(f"packed rows (position_ids restarting at 0) are refused: {packing_refused}; pack SFT only")
    for row, (first, last) in enumerate(real):
        pad_predicts = (counted[row, :first].any() or counted[row, last:].any()) if first < last else counted[row].any()
        if bool(pad_predicts):
            raise ValueError("labels must be -100 where a padded position would predict them (the token after a pad)")
        for doc_start in starts[row][1:]:
            if bool(counted[row, doc_start - 1]):
                raise ValueError(
                    f"labels[{row}, {doc_start}] is counted but starts a packed document: the previous document "
                    "would predict it; set the first label of each document to -100 (TRL's padding-free collator does)"
                )
    rows = [_row_segments(counted[row], real[row], starts[row], seq_len) for row in range(batch)]
    if all(len(segments) == 1 for segments in rows):
        return None
    return SequenceLayout(rows)


def _real_spans(attention_mask: torch.Tensor | None, batch: int, seq_len: int) -> list[tuple[int, int]]:
    """Per row, the real tokens [first, last): the ones of attention_mask, which must be one run."""
    if attention_mask is None:
        return [(0, seq_len)] * batch
    if attention_mask.shape != (batch, seq_len):
        raise ValueError(f"attention_mask must be {(batch, seq_len)}, got {tuple(attention_mask.shape)}")
    mask = attention_mask.bool().cpu()
    first = mask.int().argmax(dim=1)  # the first 1 (0 for a row of pads)
    last = torch.where(mask.any(dim=1), seq_len - mask.flip(1).int().argmax(dim=1), first)
    holes = (mask.sum(dim=1) != last - first).nonzero().flatten().tolist()
    if holes:
        raise ValueError(
            f"attention_mask row {holes[0]} has padding between real tokens; StreamBP takes left and/or right "
            "padding (each row 0...0 1...1 0...0); pass packed documents as position_ids restarting at 0"
        )
    return list(zip(first.tolist(), last.tolist()))


def _document_starts(position_ids, real, batch: int, seq_len: int) -> list[list[int]]:
    """Per row, the first position of each document among the real tokens: where position_ids
    restart at 0 (transformers' rule for packed rows); [first] when position_ids is None."""
    if position_ids is None:
        return [[first] for first, _ in real]
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq_len:
        raise ValueError(
            f"position_ids must be {(batch, seq_len)} (or (1, {seq_len})), got {tuple(position_ids.shape)}"
        )
    positions = position_ids.expand(batch, seq_len).cpu()
    starts = []
    for row, (first, last) in enumerate(real):
        ids = positions[row, first:last]
        follows = ids[1:] == ids[:-1] + 1
        restarts = ids[1:] == 0
        if last > first and (int(ids[0]) != 0 or not bool((follows | restarts).all())):
            raise ValueError(
                f"position_ids of row {row} must count 0, 1, 2, ... within each packed document and restart at 0 "
                "for the next (over the real tokens)"
            )
        starts.append([first] + [first + 1 + int(t) for t in restarts.nonzero().flatten()])
    return starts


def _row_segments(counted: torch.Tensor, real: tuple[int, int], starts: list[int], seq_len: int) -> list[Segment]:
    """One row's segments: the leading pads, each document (the last one taking the trailing pads);
    consecutive dead segments merged (their outputs are zeros either way)."""
    first, last = real
    if first == last:
        return [Segment(0, seq_len, False)]
    bounds = ([0] if first > 0 else []) + starts + [seq_len]
    segments: list[Segment] = []
    for start, end in pairwise(bounds):
        live = bool(counted[start:end].any())
        if segments and not live and not segments[-1].live:
            segments[-1] = Segment(segments[-1].start, end, False)
        else:
            segments.append(Segment(start, end, live))
    return segments
