"""The planner (simulate/plan.py) and its time model (simulate/timing.py): what each placement and
chunk size costs, the rates from measured rows, the bounds that rule a candidate out unsimulated."""

from __future__ import annotations

import pytest

from sbpbench.config import RunSpec
from sbpbench.core.placements.placement import Placement
from sbpbench.records import ResultRow, upsert_rows
from sbpbench.simulate import plan as planner
from sbpbench.simulate.depth import store_counts
from sbpbench.simulate.plan import candidates, meta_model, plan
from sbpbench.simulate.timing import COMPUTE_RATES, Rates, Work, fitted_rates, step_time, work

SPEC = RunSpec(model="Qwen/Qwen3-8B", method="streambp", seq_len=131_072, dtype="bf16")
MODEL = meta_model(SPEC)


def _work(placement: Placement | None = None, chunk_size: int = 2000, method: str = "streambp", seq_len=131_072):
    return work(
        MODEL,
        method=method,
        batch_size=1,
        seq_len=seq_len,
        placement=placement,
        chunk_size=chunk_size,
        logits_chunk_size=500,
    )


def test_recompute_adds_one_forward_of_the_rebuilt_layers():
    """recompute:4 on 36 layers rebuilds 27: 27/36 of a layer stack's forward, matmuls and attention."""
    gpu, rebuilt = _work(), _work(Placement(recompute_every=4))
    layer_attention = gpu.attention_forward_flops / 2 / 36  # StreamBP's two forwards of 36 layers
    layer_matmuls = gpu.layer_forward_flops - layer_attention
    assert rebuilt.matmul_flops - gpu.matmul_flops == pytest.approx(27 * layer_matmuls)
    assert rebuilt.attention_backward_flops == gpu.attention_backward_flops
    assert rebuilt.attention_forward_flops / gpu.attention_forward_flops == pytest.approx((2 + 27 / 36) / 2)


def test_streambp_forwards_twice_and_flash_backward_is_two_and_a_half():
    """StreamBP runs attention forward twice (checkpoint pass, chunk forward) against bp's once; the
    backward is FlashAttention's 2.5 forwards for both."""
    stream, bp = _work(), _work(method="bp")
    assert stream.attention_forward_flops == 2 * bp.attention_forward_flops
    assert stream.attention_backward_flops == bp.attention_backward_flops == 2.5 * bp.attention_forward_flops


def test_a_smaller_chunk_costs_its_gradient_sums_and_launches():
    """Layer chunks of 2000, 1000, 500 at T = 132,000 (66, 132, 264 a layer): the same FLOPs; the fp32
    sums' traffic and the launches grow by a fixed amount per layer chunk."""
    large, middle, small = (_work(chunk_size=c, seq_len=132_000) for c in (2000, 1000, 500))
    assert small.matmul_flops == large.matmul_flops
    assert small.chunk_layers == 2 * middle.chunk_layers == 4 * large.chunk_layers
    for name in ("sum_bytes", "launches"):
        a, b, c = (getattr(w, name) for w in (large, middle, small))
        assert c - b == pytest.approx(2 * (b - a)) and b > a > 0, name
    rates = Rates()
    assert step_time(small, rates).chunks_s > step_time(large, rates).chunks_s > 0


def test_offload_costs_only_what_the_compute_does_not_hide():
    """Attention-bound: cpu adds one copy back (nothing overlaps it); copy-bound: every copy shows."""
    rates, layer_bytes = Rates(), 2**30
    counts = store_counts(Placement(offload=True), 36)
    copies = {"copies_out": 36, "copies_back": counts.transfers - 36, "layer_input_bytes": layer_bytes}
    busy = step_time(_work(), rates, **copies).host_copies_s
    assert busy == pytest.approx(layer_bytes / rates.host_copy_bytes_s)
    idle = step_time(Work(0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0), rates, **copies).host_copies_s
    assert idle == pytest.approx(72 * layer_bytes / rates.host_copy_bytes_s)


def test_candidates_come_fastest_first_with_gpu_first():
    """gpu (no extra work) leads; a cpu+recompute candidate never precedes its recompute-only twin, nor
    a larger chunk the smaller one of its placement; no spill below K = 4."""
    found = candidates(SPEC, MODEL, Rates())
    assert found[0].placement == Placement()
    order = [(c.placement, c.chunk_size) for c in found]
    for k in (2, 4):
        assert order.index((Placement(recompute_every=k), 2000)) < order.index(
            (Placement(offload=True, recompute_every=k), 2000)
        )
    assert order.index((Placement(), 2000)) < order.index((Placement(), 500))
    assert (Placement(offload=True, recompute_every=3, spill=True), 2000) not in order


def _measured(tmp_path, rates: Rates, seq_lens, device="NVIDIA H100 80GB HBM3", **values) -> None:
    """Synthetic measured rows whose times the time model gives at `rates` (a test's results folder,
    never the project's results)."""
    rows = []
    for method, seq_len in seq_lens:
        step = _work(method=method, seq_len=seq_len)
        row = ResultRow(
            model="Qwen/Qwen3-8B", num_layers=36, method=method, seq_len=seq_len, batch_size=1, dtype="bf16",
            device="cuda:0", device_name=device, status="ok", source="measured", kind="point", objective="sft",
            chunk_size=2000 if method == "streambp" else None, logits_chunk_size=500 if method == "streambp" else None,
            checkpoints="gpu" if method == "streambp" else "", nproc=1, time_median_s=step_time(step, rates).total_s,
            lora_rank=0, **values,
        )  # fmt: skip
        rows.append(row)
    upsert_rows(tmp_path / "measured.csv", rows)


def test_rates_are_fitted_to_the_measured_rows_of_the_device(tmp_path):
    """Rows timed at known rates give those rates back (matmul, attention forward and backward), said
    said to be fitted to those rows of that device; another GPU's rows, or none, leave the defaults,
    said to be assumed."""
    truth = Rates(matmul_flop_s=600e12, attention_forward_flop_s=300e12, attention_backward_flop_s=200e12)
    points = [("bp", 4096), ("ckpt", 16384), ("streambp", 32768), ("streambp", 131072)]
    _measured(tmp_path, truth, points)
    fitted = fitted_rates(tmp_path, "H100", meta_model)
    for name in COMPUTE_RATES:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert fitted.measured == COMPUTE_RATES
    described = fitted.describe()
    assert "attention backward 200 TFLOP/s: fitted to 4 rows of NVIDIA H100 80GB HBM3" in described
    assert "host copies 64 GB/s, page-locking 2 GB/s: assumed (H100" in described and "measured" not in described
    assert fitted_rates(tmp_path, "A100", meta_model) == Rates()
    assert "fitted" not in Rates().describe() and "attention forward 335 TFLOP/s," in Rates().describe()


def test_rows_of_every_placement_fit_the_rates_with_their_own_work(tmp_path):
    """A recompute placement's row is fitted on its own work (one forward more per rebuilt layer), so
    two of them beside two gpu rows give the true rates back; no row is left out for its placement."""
    truth = Rates(matmul_flop_s=500e12, attention_forward_flop_s=650e12, attention_backward_flop_s=400e12)
    rows = []
    for seq_len, placement in ((9000, "gpu"), (32768, "gpu"), (65536, "recompute:4"), (131072, "recompute:2")):
        step = work(meta_model(ResultRow(model="Qwen/Qwen3-8B", num_layers=36, dtype="bf16", lora_rank=0)),
                    method="streambp", batch_size=1, seq_len=seq_len, chunk_size=2000, logits_chunk_size=500,
                    placement=Placement.parse(placement))  # fmt: skip
        rows.append(ResultRow(
            model="Qwen/Qwen3-8B", num_layers=36, method="streambp", seq_len=seq_len, batch_size=1, dtype="bf16",
            device="cuda:0", device_name="NVIDIA H100 80GB HBM3", status="ok", source="measured", kind="point",
            objective="sft", chunk_size=2000, logits_chunk_size=500, checkpoints=placement, nproc=1, lora_rank=0,
            time_median_s=step_time(step, truth).total_s,
        ))  # fmt: skip
    upsert_rows(tmp_path / "measured.csv", rows)
    fitted = fitted_rates(tmp_path, "H100", meta_model)
    assert "fitted to 4 rows of" in fitted.describe() and "one factor" not in fitted.describe()
    for name in COMPUTE_RATES:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


def test_one_measured_row_scales_the_default_compute_rates(tmp_path):
    """One row cannot separate matmul from attention: one factor on all three, which reproduces its time."""
    _measured(tmp_path, Rates(matmul_flop_s=400e12), [("streambp", 65536)])
    fitted = fitted_rates(tmp_path, "h100", meta_model)
    step = _work(seq_len=65536)
    target = step_time(step, Rates(matmul_flop_s=400e12)).total_s
    assert step_time(step, fitted).total_s == pytest.approx(target)
    assert "one factor" in fitted.describe()


def test_the_page_locking_rate_is_measured_where_rows_record_it(tmp_path):
    """host_register_s of measured rows gives the pinning rate: their pinned bytes over their seconds."""
    _measured(tmp_path, Rates(), [("streambp", 65536)], host_pinned_peak_bytes=18 * 2**30, host_register_s=9.0)
    fitted = fitted_rates(tmp_path, "H100", meta_model)
    assert fitted.pinning_bytes_s == pytest.approx(2 * 2**30)
    assert "pinning_bytes_s" in fitted.measured


@pytest.mark.slow  # over 3 s on 2 cores
def test_bounds_rule_out_what_cannot_fit_without_a_simulation(monkeypatch):
    """Qwen3-8B at T = 1M on 80 GiB and 100 GiB of host: every candidate whose resident bytes plus the
    layer inputs it holds at once exceed the GPU, or whose host copies exceed the host, is ruled out
    unsimulated, each with its reason; the first candidate left is the first estimated."""
    spec = RunSpec(model="Qwen/Qwen3-8B", method="streambp", seq_len=1_048_576, dtype="bf16", lora_rank=64)
    estimated = []

    def estimate(spec, **_):
        estimated.append(spec.settings)
        return ResultRow(status="oom", error="needs more", logits_chunk_size=spec.settings.logits_chunk_size)

    monkeypatch.setattr(planner, "estimate_point_by_depth", estimate)
    chosen, decided = plan(spec, gpu_memory_bytes=80 * 2**30, host_memory_bytes=100 * 2**30, max_estimates=1)
    assert chosen is None and len(estimated) == 1
    bounds = {o.candidate.placement.name: o.bound for o in decided if o.bound}
    assert bounds["gpu"].startswith("GPU: needs over") and bounds["cpu"].startswith("host:")
    assert bounds["cpu+recompute:3"].startswith("host:") and bounds["recompute:3"].startswith("GPU: needs over")
    first = Placement.parse(estimated[0].checkpoints)
    assert first.name not in bounds and first == Placement(stream=True, host_buffers=11)  # (100 - 5) // 8 GiB


@pytest.mark.slow  # over 3 s on 2 cores
def test_a_spill_twin_is_estimated_first_and_bounds_its_placement(monkeypatch):
    """Without stream placements, cpu+recompute:4 needs an estimate: its spill twin (fewer layer
    inputs on the device) is estimated first; its peak in the top layer's backward plus the two more layer inputs the twin
    does not hold there exceeds the GPU, so cpu+recompute:4 is ruled out unsimulated and the twin,
    which fits, is the plan."""
    spec = RunSpec(model="Qwen/Qwen3-8B", method="streambp", seq_len=1_048_576, dtype="bf16", lora_rank=64)
    estimated = []

    def estimate(spec, **_):
        estimated.append(spec.settings.checkpoints.name)
        return ResultRow(
            status="ok", peak_allocated_bytes=70 * 2**30, margin_bytes=2**30, peak_phase="backward layer 35",
            logits_chunk_size=spec.settings.logits_chunk_size, checkpoints=spec.settings.checkpoints.name,
        )  # fmt: skip

    monkeypatch.setattr(planner, "estimate_point_by_depth", estimate)
    classic = planner.placements
    monkeypatch.setattr(planner, "placements", lambda *args: [p for p in classic(*args) if not p.stream])
    chosen, decided = plan(spec, gpu_memory_bytes=80 * 2**30, host_memory_bytes=100 * 2**30)
    assert estimated == ["cpu+recompute:4+spill"]
    assert chosen.candidate.placement == Placement(offload=True, recompute_every=4, spill=True)
    (bound,) = [o.bound for o in decided if o.candidate.placement == Placement(offload=True, recompute_every=4)]
    assert "top layer (estimated) with 4 layer inputs" in bound


@pytest.mark.slow
def test_the_top_layer_of_one_placement_gives_every_other_placements_peak_there():
    """tiny/qwen3, 8 layers, T = 1500: where each placement's peak is in the top layer's backward, it
    is the spill placement's plus the difference in layer inputs on the device then (the store's
    count): the bound the planner takes from an estimate of another placement is exact there."""
    from sbpbench.methods import MethodSettings
    from sbpbench.simulate.depth import estimate_point_by_depth, layer_input_bytes

    def peak(checkpoints: str):
        settings = MethodSettings(chunk_size=48, logits_chunk_size=32, checkpoints=checkpoints)
        point = RunSpec(model="tiny/qwen3", method="streambp", seq_len=1500, dtype="bf16", num_layers=8,
                        settings=settings, repeats=0, warmup=0)  # fmt: skip
        row = estimate_point_by_depth(point, gpu_memory_bytes=80 * 2**30)
        assert row.peak_phase == "backward layer 7", checkpoints
        return row.peak_allocated_bytes, -(-layer_input_bytes(point) // 512) * 512

    spill, layer_input = peak("cpu+recompute:4+spill")
    for name in ("gpu", "cpu", "recompute:4", "cpu+recompute:2", "cpu+recompute:4"):
        more = store_counts(Placement.parse(name), 8).top_device_inputs - 2  # spill holds two there
        assert peak(name)[0] == spill + more * layer_input, name


def test_stream_adds_its_rebuilt_layers_and_the_copies_beyond_their_compute():
    """stream:7 on Qwen3-8B rebuilds 37 layers: 37 layer forwards of matmuls more than gpu; copy-bound
    (no compute to hide them) its copy time is the whole step's stream traffic, layer inputs counted
    as depth.stream_transfers counts them; attention-bound at 2M tokens only the head's and the
    embedding's copies show."""
    from sbpbench.simulate.depth import stream_transfers
    from sbpbench.simulate.timing import stream_copies_s

    stream = Placement(stream=True, host_buffers=7)
    gpu, streamed = _work(), _work(stream)
    layer_attention = gpu.attention_forward_flops / 2 / 36
    assert streamed.matmul_flops - gpu.matmul_flops == pytest.approx(37 * (gpu.layer_forward_flops - layer_attention))
    rates, layer_bytes = Rates(), 2**30
    idle = Work(0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0)
    copies = {"placement": stream, "num_layers": 36, "layer_input_bytes": layer_bytes, "embedding_trains": True}
    moved = stream_transfers(36, 7) * layer_bytes
    assert stream_copies_s(idle, rates, **copies) * rates.host_copy_bytes_s == pytest.approx(moved)
    busy = stream_copies_s(_work(stream, 4096, seq_len=2_097_152), rates, **copies)
    assert busy == pytest.approx(3 * layer_bytes / rates.host_copy_bytes_s)


def _fits_when_streamed(estimated):
    def estimate(spec, **_):
        placement = Placement.parse(spec.settings.checkpoints)
        estimated.append(placement.name)
        streamed = placement.stream
        return ResultRow(
            status="ok" if streamed else "oom", error="" if streamed else "needs more",
            peak_allocated_bytes=62 * 2**30, margin_bytes=2**30, peak_phase="backward layer 35",
            logits_chunk_size=spec.settings.logits_chunk_size, checkpoints=placement.name,
            host_pinned_peak_bytes=7 * 16 * 2**30,
        )  # fmt: skip

    return estimate


def test_at_two_million_tokens_only_the_stream_placement_is_estimated(monkeypatch):
    """Qwen3-8B full fine-tuning at T = 2M on 80 GiB and 120 GiB of host: every other placement is
    ruled out by its bound (GPU: the inputs it holds, dZ, the K/V buffers and their sums; host: its
    copies), and stream with the most buffers the host holds, (120 - 5) // 16 = 7, is the one
    estimate and the plan, at the largest chunk."""
    spec = RunSpec(model="Qwen/Qwen3-8B", method="streambp", seq_len=2_097_152, dtype="bf16")
    estimated = []
    monkeypatch.setattr(planner, "estimate_point_by_depth", _fits_when_streamed(estimated))
    chosen, decided = plan(spec, gpu_memory_bytes=80 * 2**30, host_memory_bytes=120 * 2**30)
    assert estimated == ["stream:7"]
    assert (chosen.candidate.placement.name, chosen.candidate.chunk_size) == ("stream:7", 4096)
    assert all(o.bound for o in decided if o is not chosen)


@pytest.mark.slow
def test_the_bound_is_below_the_estimated_peak():
    """What the planner's bound counts at the top layer's backward (K/V buffers, their fp32 sums, one
    attention call's key gradients, dZ unless streamed) is below the estimator's peak, so it never
    rules out what fits: tiny/qwen3, 4 layers, T = 1500, gpu and stream:2."""
    from sbpbench.methods import MethodSettings
    from sbpbench.simulate.depth import estimate_point_by_depth, layer_input_bytes

    for checkpoints in ("gpu", "stream:2"):
        settings = MethodSettings(chunk_size=256, logits_chunk_size=128, checkpoints=checkpoints)
        point = RunSpec(model="tiny/qwen3", method="streambp", seq_len=1500, dtype="bf16", num_layers=4,
                        settings=settings)  # fmt: skip
        row = estimate_point_by_depth(point, gpu_memory_bytes=80 * 2**30, exact=True)
        bound = planner._layer_backward_bytes(point) + (0 if checkpoints != "gpu" else 4 * layer_input_bytes(point))
        assert row.activation_peak_bytes >= bound > 0, checkpoints


@pytest.mark.filterwarnings("ignore::sbpbench.config.run.BeyondContextWarning")  # T past Qwen3-8B's 40,960
def test_sbp_plan_prints_the_choice_and_the_fastest_of_each_placement_in_30_lines(monkeypatch):
    """`sbp plan` at 2M: within 30 lines of 80 columns, a row per kind of placement, the plan and why,
    the layer count and chunk named where they are meant; --all adds every candidate, each ruled-out
    one with the chunk sizes its reason covers."""
    from typer.testing import CliRunner

    from sbpbench.cli import app

    monkeypatch.setattr(planner, "estimate_point_by_depth", _fits_when_streamed([]))
    args = ["plan", "--model", "Qwen/Qwen3-8B", "--seq", "2097152", "--gpu-memory", "80GiB", "--host-memory", "120GiB"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    *lines, command = result.output.splitlines()
    assert len(lines) <= 30 and max(map(len, lines)) <= 80, result.output
    assert "plan: stream:7, chunk 4096: predicted " in result.output and "None" not in result.output
    assert command.startswith("sbp run --model Qwen/Qwen3-8B --seq 2097152 "), command
    for kind in ("gpu", "cpu ", "recompute:2", "cpu+recompute:2", "stream:7"):
        assert kind in result.output, kind
    every = CliRunner().invoke(app, [*args, "--all"], env={"COLUMNS": "80"})
    assert every.exit_code == 0 and len(every.output.splitlines()) > len(lines)
    assert "cpu+recompute:12+spill, any chunk: host: needs" in every.output


@pytest.mark.filterwarnings("ignore::sbpbench.config.run.BeyondContextWarning")  # T past Qwen3-8B's 40,960
@pytest.mark.parametrize("extra", [[], pytest.param(["--lora-rank", "64"], marks=pytest.mark.slow)])
def test_the_plan_ends_with_the_sbp_run_command_that_starts_its_point(monkeypatch, tmp_path, extra):
    """`sbp plan`'s last line is an `sbp run` command; pasted (model, length and device swapped for
    a CPU check) it starts streambp with the planned placement and chunks and every option given."""
    import shlex

    from typer.testing import CliRunner

    import sbpbench.runner
    from sbpbench.cli import app

    monkeypatch.setattr(planner, "estimate_point_by_depth", _fits_when_streamed([]))
    args = ["plan", "--model", "Qwen/Qwen3-8B", "--seq", "2097152", "--host-memory", "120GiB", *extra]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.output.splitlines()[-1])
    assert argv[:2] == ["sbp", "run"] and " ".join(extra) in " ".join(argv), argv
    swapped = {"--model": "tiny/qwen3", "--seq": "256", "--device": "cpu"}
    argv = [swapped.get(before, word) for before, word in zip(["", *argv], argv)]
    started = []

    def run_points(specs, out, **recordings):
        started.extend(specs)
        raise SystemExit(0)

    monkeypatch.setattr(sbpbench.runner, "run_points", run_points)
    CliRunner().invoke(app, [*argv[1:], "--out", str(tmp_path / "runs.csv")])
    (spec,) = started
    assert (spec.model, spec.seq_len, spec.device, spec.method) == ("tiny/qwen3", 256, "cpu", "streambp")
    chosen = result.output.split("plan: ")[1].split(": predicted")[0]  # "stream:7, chunk 4096"
    assert f"{spec.settings.checkpoints.name}, chunk {spec.settings.chunk_size}" == chosen
    assert spec.settings.logits_chunk_size == int(argv[-1]) and spec.lora_rank == (64 if extra else 0)


@pytest.mark.filterwarnings("ignore::sbpbench.config.run.BeyondContextWarning")  # T past Qwen3-8B's 40,960
def test_sbp_plan_names_what_it_assumed_and_advises_on_what_ruled_out_every_candidate(monkeypatch, tmp_path):
    """Without --host-memory a notice names the flag and this machine's RAM; --results without rows
    of --gpu says the rates are assumed; where only the GPU ruled candidates out, the advice is more
    --gpu-memory, never more host memory."""
    from typer.testing import CliRunner

    from sbpbench.cli import app
    from sbpbench.measure.host_memory import total_ram_bytes

    def too_small(spec, **_):
        return ResultRow(status="oom", error="needs more", peak_allocated_bytes=62 * 2**30, margin_bytes=2**30,
                         peak_phase="backward layer 35", checkpoints=spec.settings.checkpoints.name)  # fmt: skip

    monkeypatch.setattr(planner, "estimate_point_by_depth", too_small)
    args = ["plan", "--model", "Qwen/Qwen3-8B", "--seq", "1048576", "--gpu-memory", "1GiB", "--gpu", "A100"]
    result = CliRunner().invoke(app, [*args, "--results", str(tmp_path / "none")], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    ram = f"{total_ram_bytes() / 2**30:.1f} GiB"
    assert f"notice: --host-memory not given: planning for this machine's RAM, {ram}" in result.output
    assert f"notice: --results {tmp_path / 'none'}: no such file or folder; the rates are assumed" in result.output
    assert "nothing fits: " in result.output and "--gpu-memory" in result.output
    assert "host memory" not in result.output.split("nothing fits")[1]
    result = CliRunner().invoke(app, [*args, "--host-memory", "1TiB"], env={"COLUMNS": "200"})
    assert "--host-memory not given" not in result.output and "no measured rows of --gpu A100" in result.output
