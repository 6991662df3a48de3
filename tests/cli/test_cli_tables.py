"""Every table a command prints is readable at 80 columns (no cell cut to "…"), and a results
table's caption explains exactly the columns and title terms it shows."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from sbpbench.cli.check_cmd import exactness_table
from sbpbench.cli.env_cmd import env_table
from sbpbench.cli.models_cmd import models_table
from sbpbench.cli.plan_cmd import plan_table, summary_table
from sbpbench.cli.tables import estimate_table, maxlen_table, point_title, points_table, print_table, results_table
from sbpbench.config import RunSpec
from sbpbench.core.placements.placement import Placement
from sbpbench.methods.exactness import MethodComparison, TensorDiff
from sbpbench.records import ResultRow
from sbpbench.simulate import MARGIN_NOTE
from sbpbench.simulate.depth import StoreCounts
from sbpbench.simulate.plan import Candidate, PlanOutcome
from sbpbench.simulate.timing import Rates, StepTime

GIB = 2**30
ALL_METHODS = ("bp", "ckpt", "streambp", "ckpt-offload", "ckpt-chunked-ce", "tiled", "liger", "official")


def _row(method: str, **values) -> ResultRow:
    """A row as a long point gives it: big numbers, every column a table may show filled."""
    chunked = method in ("streambp", "official")
    point = dict(
        model="Qwen/Qwen3-8B", num_layers=36, objective="sft", step="bp", dtype="bf16", batch_size=1,
        seq_len=110_000, protocol="steady", device="cuda:0", device_name="NVIDIA H100 80GB HBM3",
        memory_source="torch.cuda", repeats=3, warmup_steps=1, num_threads=16, kind="point", source="measured",
        chunk_size=500 if chunked else None, logits_chunk_size=100 if chunked or method == "tiled" else None,
    )  # fmt: skip
    measured = dict(
        method=method, status="ok", peak_allocated_bytes=int(71.23 * GIB), peak_reserved_bytes=int(75.5 * GIB),
        nvml_peak_used_bytes=int(78.9 * GIB), nvml_idle_used_bytes=int(0.5 * GIB),
        activation_peak_bytes=int(40.01 * GIB), time_median_s=123.456, time_min_s=120.0, time_max_s=130.0,
        tokens_per_s=891.0, tflops_per_s=187.3, weights_bytes=int(15.26 * GIB), grads_bytes=int(15.26 * GIB),
        optimizer_state_bytes=int(30.52 * GIB), peak_phase="backward embedding", attention_kernel="efficient",
        margin_bytes=int(2.75 * GIB), max_seq_len=1_048_576, oom_seq_len=1_056_768, num_probes=23,
        memory_limit_bytes=80 * GIB, device_total_memory_bytes=80 * GIB,
    )  # fmt: skip
    return ResultRow(**{**point, **measured, **values})


def _cpu_row(method: str, **values) -> ResultRow:
    """A CPU row: no reserved or NVML memory (the tracker counts tensors)."""
    cpu = dict(device="cpu", device_name="AMD EPYC 7B13", memory_source="tensor-tracker", peak_reserved_bytes=None,
               nvml_peak_used_bytes=None, nvml_idle_used_bytes=None, dtype="fp32", seq_len=2048)  # fmt: skip
    return _row(method, **{**cpu, **values})


def _render(table, *, fit: bool = True) -> str:
    """The table as a command prints it at 80 columns: through print_table (fit), or as is."""
    console = Console(width=80, record=True, file=io.StringIO())
    print_table(console, table) if fit else console.print(table)
    return console.export_text()


def _plan_outcomes() -> list[PlanOutcome]:
    placements = ("gpu", "cpu", "recompute:4", "cpu+recompute:4", "cpu+recompute:4+spill")
    time = StepTime(3012.3, 1234.5, 2345.6, 12.3, 4.5, 38.6)
    counts = StoreCounts(10, 45, 2, 2)
    return [
        PlanOutcome(Candidate(Placement.parse(name), 4096, time, counts), _row("streambp", status=status), bound)
        for name, status, bound in zip(
            placements, ("oom", "oom", "oom", "oom", "ok"), ("needs over 300 GiB", "", "", "", ""), strict=True
        )
    ]


def _plan_summary() -> list:
    """The summary's rows at their widest: a GPU and a host bound, an estimate, a candidate not tried."""
    time, counts = StepTime(30123.4, 1234.5, 2345.6, 12.3, 4.5, 38.6), StoreCounts(35, 80, 0, 0)
    bound = "GPU: needs over 683.4 GiB (37 layer inputs), of 80.0"
    rows = [
        PlanOutcome(Candidate(Placement(), 4096, time, counts), _row("streambp", status="oom"), bound, True),
        PlanOutcome(Candidate(Placement.parse("cpu+recompute:12+spill"), 500, time, counts),
                    _row("streambp", status="oom"), "host: needs 581.0 GiB (36 layer inputs), of 120.0", True),
        PlanOutcome(Candidate(Placement.parse("stream:7"), 4096, time, counts), _row("streambp", status="ok")),
    ]  # fmt: skip
    return [*rows, Candidate(Placement.parse("cpu+recompute:12"), 1000, time, counts)]


def _comparisons() -> tuple[list[RunSpec], list[MethodComparison]]:
    """An fp32 check of every method (the widest: a reference row and the vs-bp column)."""
    name = "base_model.model.model.layers.35.self_attn.q_proj.lora_A.default.weight"
    diff = TensorDiff(name, 3.2e-7, 1e-9, (3, 7), 0.5, 0.5, 1e-5)
    specs = [RunSpec(model="Qwen/Qwen3-8B", method=m, seq_len=300, dtype="fp32", lora_rank=8) for m in ALL_METHODS]
    results = [MethodComparison(m, "bp fp64", diff, [diff], versus_baseline=1.5e-6) for m in ALL_METHODS]
    return specs, results


def _gemma3_fp64() -> tuple[list[RunSpec], list[MethodComparison]]:
    """An fp64 check of Gemma-3: its norm weights judged at float32's 1e-5, every other tensor at 1e-10."""
    norm = TensorDiff("model.layers.1.self_attn.k_norm.weight", 2.06e-7, 1e-9, (3,), 0.5, 0.5, 1e-5)
    other = TensorDiff("model.layers.1.mlp.down_proj.weight", 1.1e-15, 1e-17, (3, 7), 0.5, 0.5, 1e-10)
    specs = [RunSpec(model="tiny/gemma3", method=m, seq_len=64, dtype="fp64") for m in ("bp", "ckpt", "streambp")]
    results = [MethodComparison(m, "bp", other, [norm, other]) for m in ("ckpt", "streambp")]
    return specs, results


def _run_table(rows: list[ResultRow]):
    """`sbp run`'s table of these rows, titled as the command titles it."""
    return results_table(rows, *_titled(rows))


def _titled(rows: list[ResultRow]) -> tuple[str, list[str]]:
    point, notes = point_title(rows)
    return f"{point}, limit 80.00 GiB\n{rows[0].device_name} ({rows[0].memory_source}, 16 thread(s))", notes


TABLES = {
    "run, 3 methods on cuda": lambda: _run_table([_row(m) for m in ALL_METHODS[:3]]),
    "run, every method on cuda": lambda: _run_table([_row(m) for m in ALL_METHODS]),
    "run on cpu": lambda: _run_table([_cpu_row(m) for m in ALL_METHODS[:3]]),
    "estimate, 3 methods": lambda: estimate_table([_row(m) for m in ALL_METHODS[:3]], 80 * GIB, MARGIN_NOTE),
    "estimate, every method": lambda: estimate_table([_row(m) for m in ALL_METHODS], 80 * GIB, MARGIN_NOTE),
    "maxlen": lambda: maxlen_table([_row(m, kind="maxlen") for m in ALL_METHODS[:3]]),
    "maxlen, seeded": lambda: maxlen_table(
        [_row(m, kind="maxlen", seed_seq_len=1_040_384 if m != "bp" else None) for m in ALL_METHODS[:3]]
    ),
    "maxlen, grpo simulated": lambda: maxlen_table(
        [_row(m, kind="maxlen", objective="grpo", prompt_len=1000, source="simulated") for m in ALL_METHODS]
    ),
    "sweep, several models": lambda: points_table(
        "smoke: every point", [_row(m, model=f"meta-llama/Llama-3.1-{n}B") for m in ALL_METHODS for n in (8, 70)]
    ),
    "plan": lambda: plan_table(
        RunSpec(model="Qwen/Qwen3-8B", method="streambp", seq_len=1_048_576),
        _plan_outcomes(),
        80 * GIB,
        2000 * GIB,
        Rates(),
    ),
    "plan, fastest of each placement": lambda: summary_table(
        RunSpec(model="Qwen/Qwen3-8B", method="streambp", seq_len=2_097_152),
        _plan_summary(),
        None,
        80 * GIB,
        120 * GIB,
        Rates(),
    ),
    "check, fp32, every method": lambda: exactness_table(*_comparisons()),
    "check, fp64 gemma3": lambda: exactness_table(*_gemma3_fp64()),
}
PRINTED_AS_IS = {  # commands that print with console.print: their long cells fold
    "env": lambda: env_table({"cpu_model": "AMD EPYC 7B13 64-Core Processor " * 3, "git_commit": "8cd840e" * 6}),
    "models": models_table,
}


@pytest.mark.parametrize("name", [*TABLES, *PRINTED_AS_IS])
def test_every_table_is_whole_at_80_columns(name):
    """Rendered at 80 columns as its command prints it: no line wider, no cell cut to "…"."""
    text = _render(TABLES[name]()) if name in TABLES else _render(PRINTED_AS_IS[name](), fit=False)
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text


def test_estimate_table_fits_80_columns_by_transposing():
    """`sbp estimate`'s three methods (113 columns wide as built) become a column each at 80, with
    every value whole."""
    text = _render(TABLES["estimate, 3 methods"]())
    header = next(line for line in text.splitlines() if "streambp" in line)
    assert "bp" in header and "ckpt" in header
    for value in ("71.23", "backward embedding", "efficient", "fits 80.00 GiB"):
        assert value in text


def test_run_caption_explains_exactly_the_columns_and_title_terms_shown():
    """On a CPU the caption leaves out reserved and NVML memory (no such column), and explains
    tok/s, TFLOP/s, the protocol and the chunk sizes of the title; on a GPU it explains resv and nvml."""
    cpu = _render(TABLES["run on cpu"]())
    for term in ("tok/s:", "TFLOP/s:", "steady protocol:", "chunks 500/100:", "time s:", "act GiB:", "B: rows"):
        assert term in " ".join(cpu.split()), term
    assert "resv" not in cpu and "nvml" not in cpu
    gpu = " ".join(_render(TABLES["run, 3 methods on cuda"]()).split())
    assert "resv GiB:" in gpu and "nvml GiB:" in gpu and "median of 3 timed step(s) after 1 warm-up" in gpu
    timed_out = results_table([_cpu_row("bp", time_median_s=None, tokens_per_s=None, tflops_per_s=None)], "t")
    assert "tok/s" not in _render(timed_out) and "TFLOP/s" not in _render(timed_out)


def test_a_several_rank_point_says_its_ranks_in_the_title():
    """--nproc 2: the run table's title says "2 ranks" and the caption that B and the memory are per rank."""
    title, notes = point_title([_cpu_row("bp", nproc=2)])
    assert title.endswith(", 2 ranks, steady protocol") or ", 2 ranks" in title
    assert any(note.startswith("2 ranks: data-parallel processes (FSDP2), B rows each") for note in notes)
    assert "ranks" not in point_title([_cpu_row("bp", nproc=1)])[0]


def test_the_title_says_streambps_placement_as_it_is_on_the_device():
    """The run title names the checkpoint placement; `gpu` on a CPU reads as the CPU's memory, on a GPU as gpu."""
    cpu = point_title([_cpu_row("bp", checkpoints=None), _cpu_row("streambp", checkpoints="gpu", chunk_size=500)])[0]
    assert "checkpoints in the CPU's memory (gpu: on the device)" in cpu and "checkpoints gpu" not in cpu
    assert ", checkpoints gpu," in point_title([_row("streambp", checkpoints="gpu", chunk_size=500)])[0]
    assert ", checkpoints stream:4," in point_title([_cpu_row("streambp", checkpoints="stream:4", chunk_size=500)])[0]


def test_a_points_file_names_say_a_placement_other_than_the_default():
    """Timeline and trace folders: streambp__T16 for the default placement (no `-gpu`), streambp-cpu__T16 for cpu."""
    from sbpbench.config import point_specs
    from sbpbench.workload.timeline import timeline_stem

    base = {"model": "tiny/qwen3", "seq_len": 16, "device": "cpu"}
    (default,) = point_specs(base, ["streambp"])
    (offloaded,) = point_specs({**base, "checkpoints": "cpu"}, ["streambp"])
    assert "__streambp__T16__" in timeline_stem(default) and "__streambp-cpu__T16__" in timeline_stem(offloaded)


def test_check_says_why_gemma3_fp64_is_judged_at_1e5_and_never_breaks_a_name():
    """fp64 Gemma-3: the note under the table says its modules compute in float32 (1e-5 there) and
    gives every other tensor's largest error against 1e-10; tensor names break only after a dot."""
    text = _render(exactness_table(*_gemma3_fp64()))
    flat = " ".join(text.split())
    assert "fp64: 1 tensor(s) judged at 1e-05, such as model.layers.1.self_attn.k_norm.weight" in flat
    assert "their modules compute in float32 inside a float64 model (found in a forward)" in flat
    assert "Every other gradient is judged at 1e-10: its largest error here is 1.1e-15" in flat
    for spec, results in (_gemma3_fp64(), _comparisons()):
        table = _render(exactness_table(spec, results))
        for part in results[0].worst.name.split("."):
            assert part in table, (part, table)
