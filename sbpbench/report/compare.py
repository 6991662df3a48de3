"""Pairing rows of a results table with the paper's numbers, and estimates with measurements.

A paper number (a row of experiments/reference/streambp_paper.csv) is met by every measured row
of the same model, method, objective, LoRA or not, step, dtype, batch size (and seq_len where the
paper gives one) on a comparable device: memory and max-T numbers need a CUDA device whose capacity
is within 10% of the paper's 80 GB (records.select.is_paper_capacity), times any CUDA device. A model
built with fewer layers (--num-layers) is not the paper's model. Reruns: the latest row wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..records.select import (
    ESTIMATE_KEY,
    MAXLEN_TABLE,
    PROMPTED_OBJECTIVES,
    cell,
    device_label,
    is_cuda,
    is_oom,
    is_paper_capacity,
    is_truncated,
    natural_key,
    number,
    paper_rows,
    present,
    prompt_offset,
    where,
)

# paper metric -> the kind of row that measures it
METRIC_KIND = {
    "max_seq_len": "maxlen",
    "weights_grads_bytes": "point",
    "peak_allocated_bytes": "point",
    "time_s": "point",
    "time_per_sample_s": "point",
}
MEMORY_METRICS = ("max_seq_len", "weights_grads_bytes", "peak_allocated_bytes")  # need an 80 GiB device
# A row met only by weights + grads has not had its own numbers (peak, time) compared.
SECONDARY_METRICS = ("weights_grads_bytes",)


@dataclass(frozen=True)
class Comparison:
    """One of our numbers beside a reference number (None: OOM on that side)."""

    table: str  # the paper's table, or "" for an estimate beside a measurement
    metric: str
    model: str
    method: str
    setting: str  # "sft, full, bp, bf16, B=1, T=6000"
    run: str  # where ours ran: "NVIDIA H200, limit 80 GiB, steady"
    reference: float | None
    ours: float | None
    at_ceiling: bool = False  # a max-length search that never ran out of memory: ours is a lower bound
    no_reference: bool = False  # nothing to compare with (reference is None but not an OOM)

    @property
    def ratio(self) -> float | None:
        if self.no_reference or self.reference is None or self.ours is None or self.reference == 0:
            return None
        return self.ours / self.reference


def setting(row, *, seq_len: bool, method_chunks: bool = True) -> str:
    """The row's setting in words; StreamBP's chunk sizes where they apply."""
    rank = int(number(row.get("lora_rank")) or 0)
    parts = [row["objective"], f"LoRA r{rank}" if rank else "full", row["step"], row["dtype"]]
    parts.append(f"B={cell(row['batch_size'])}")
    if seq_len and present(row.get("seq_len")):
        parts.append(f"T={cell(row['seq_len'])}")
    if row["objective"] in PROMPTED_OBJECTIVES and present(row.get("prompt_len")):
        parts.append(f"prompt {cell(row['prompt_len'])}")
    if method_chunks and row["method"] == "streambp" and present(row.get("chunk_size")):
        logits = f"/{cell(row['logits_chunk_size'])}" if present(row.get("logits_chunk_size")) else ""
        parts.append(f"chunks {cell(row['chunk_size'])}{logits}")
    placement = row.get("checkpoints")
    if method_chunks and row["method"] == "streambp" and present(placement) and placement != "gpu":
        parts.append(f"checkpoints {placement}")
    return ", ".join(parts)


def run(row) -> str:
    return f"{device_label(row)}, {row['protocol'] or '?'}"


def paper_comparisons(table, reference) -> tuple[list[Comparison], set, list[tuple[str, int, int]]]:
    """Each paper number beside every comparable measured row; the indices of the rows whose own
    numbers were compared; per paper table (numbers compared, numbers it has) in reference order."""
    measured = table[table["source"] == "measured"]
    comparisons, matched, coverage = [], set(), {}
    for _, paper in reference.iterrows():
        if paper["metric"] not in METRIC_KIND or number(paper["num_gpus"]) != 1:
            continue
        found = []
        for index, row in _candidates(measured, paper).iterrows():
            ours = _our_value(row, paper["metric"])
            if ours is False:
                continue
            found.append((row, ours))
            if paper["metric"] not in SECONDARY_METRICS:
                matched.add(index)
        done, total = coverage.get(paper["table"], (0, 0))
        coverage[paper["table"]] = (done + bool(found), total + 1)
        comparisons += _latest(_compare(paper, row, ours) for row, ours in found)
    return comparisons, matched, [(name, done, total) for name, (done, total) in coverage.items()]


def _candidates(measured, paper):
    metric = paper["metric"]
    keep = (
        (measured["kind"] == METRIC_KIND[metric])
        & (measured["model"] == paper["model"])
        & (measured["objective"] == paper["objective"])
        & ((measured["lora_rank"].fillna(0) > 0) == paper["lora"])
        & (measured["step"] == paper["step"])
        & (measured["dtype"] == paper["dtype"])
        & (measured["batch_size"] == paper["batch_size"])
    )
    if paper["method"]:  # "" = the same for every method (weights + grads)
        keep &= measured["method"] == paper["method"]
    if present(paper["seq_len"]):
        keep &= measured["seq_len"] == paper["seq_len"]
    rows = measured[keep]
    comparable = is_paper_capacity if metric in MEMORY_METRICS else is_cuda
    return where(rows, (comparable(row) and not is_truncated(row) for _, row in rows.iterrows()))


def _our_value(row, metric: str):
    """Our number for a paper metric: a float, None for an OOM, False if the row has none."""
    if row["kind"] == "maxlen":
        max_t = number(row["max_seq_len"])
        if max_t is not None:
            return max_t - prompt_offset(row)
        return None if is_oom(row) or row["status"] == "ok" else False  # ok with no length: not even the first fit
    if metric == "weights_grads_bytes":  # known before the step runs, so an OOM row has it too
        weights, grads = number(row["weights_bytes"]), number(row["grads_bytes"])
        return False if weights is None or grads is None else weights + grads
    if is_oom(row):
        return None
    if row["status"] != "ok":
        return False
    column = "time_median_s" if metric in ("time_s", "time_per_sample_s") else metric
    value = number(row[column])
    if value is None:
        return False
    return value / number(row["batch_size"]) if metric == "time_per_sample_s" else value


def _compare(paper, row, ours) -> tuple[str, Comparison]:
    every_method = not paper["method"]
    comparison = Comparison(
        table=paper["table"],
        metric=paper["metric"],
        model=paper["model"],
        method=paper["method"] or "all",
        setting=setting(row, seq_len=present(paper["seq_len"]), method_chunks=not every_method),
        run=run(row),
        reference=None if paper["status"] == "oom" else float(paper["value"]),
        ours=ours,
        at_ceiling=row["kind"] == "maxlen" and ours is not None and not present(row["oom_seq_len"]),
    )
    return row["timestamp_utc"], comparison


def _latest(stamped) -> list[Comparison]:
    """One comparison per model, method, setting and run: the latest row's; in natural order."""
    chosen = {}
    for _, c in sorted(stamped, key=lambda stamp_comparison: stamp_comparison[0]):
        chosen[(c.model, c.method, c.setting, c.run)] = c
    return [chosen[key] for key in sorted(chosen, key=lambda key: tuple(natural_key(part) for part in key))]


def estimate_comparisons(table) -> tuple[list[Comparison], int]:
    """Each simulated point beside the measured CUDA rows of the same point (peak memory); and how
    many simulated points have no measured counterpart."""
    simulated = table[(table["source"] == "simulated") & (table["kind"] == "point")]
    measured = table[(table["source"] == "measured") & (table["kind"] == "point")]
    measured = where(measured, (is_cuda(row) for _, row in measured.iterrows()))
    index = {}
    for _, row in measured.iterrows():
        index.setdefault(tuple(cell(row[c]) for c in ESTIMATE_KEY), []).append(row)
    stamped, unmatched = [], 0
    for _, estimate in simulated.iterrows():
        twins = index.get(tuple(cell(estimate[c]) for c in ESTIMATE_KEY), [])
        unmatched += not twins
        for row in twins:
            comparison = Comparison(
                table="",
                metric="peak_allocated_bytes",
                model=estimate["model"],
                method=estimate["method"],
                setting=setting(estimate, seq_len=True),
                run=run(row),
                reference=_peak(row),
                ours=_peak(estimate),
            )
            stamped.append((row["timestamp_utc"] + estimate["timestamp_utc"], comparison))
    return _latest(stamped), unmatched


def _peak(row) -> float | None:
    return None if is_oom(row) else number(row["peak_allocated_bytes"])


def estimates_vs_paper(table, reference) -> list[Comparison]:
    """Each simulated max-length search beside the paper's max T (Figure 3 for step bp, Table 3 for
    train) where the simulated device stands in for the paper's 80 GB GPU."""
    stamped = []
    for _, row in table[(table["source"] == "simulated") & (table["kind"] == "maxlen")].iterrows():
        ours = _our_value(row, "max_seq_len")
        if ours is False:
            continue
        paper = reference.iloc[0:0]
        if is_paper_capacity(row) and not is_truncated(row) and row["step"] in MAXLEN_TABLE:
            paper = paper_rows(reference, table=MAXLEN_TABLE[row["step"]], metric="max_seq_len", like=row)
        comparison = Comparison(
            table=paper["table"].iloc[0] if len(paper) else "",
            metric="max_seq_len",
            model=row["model"],
            method=row["method"],
            setting=setting(row, seq_len=False),
            run=run(row),
            reference=float(paper["value"].iloc[0]) if len(paper) else None,
            ours=ours,
            at_ceiling=ours is not None and not present(row["oom_seq_len"]),
            no_reference=not len(paper),
        )
        stamped.append((row["timestamp_utc"], comparison))
    return _latest(stamped)
