"""`sbp estimate --gpus P` and `sbp plan --gpus P`: one rank of P GPUs sharing each sequence, predicted
in this process on torch's fake process group (simulate/sequence_parallel.py). The spawning test
(one `sbp run --nproc 2 --sp 2` point on 2 gloo ranks) is slow-tier, as are the long fake runs."""

from __future__ import annotations

import collections
import re
from dataclasses import replace

import pytest

from sbpbench.config import point_specs
from sbpbench.methods.step import storage_bytes
from sbpbench.simulate import plan as planner
from sbpbench.simulate.estimate import estimate, host_peak_bytes, ranks_per_node, simulate, unrun_step
from sbpbench.simulate.length import estimate_by_length
from sbpbench.simulate.memory_counter import SimulatedMemory
from sbpbench.simulate.plan import meta_model, stream_buffers
from sbpbench.simulate.sequence_parallel import collective_bytes
from sbpbench.simulate.timing import Rates, rebuilt_layers, step_time, work

POINT = {"device": "cpu", "model": "tiny/qwen3", "repeats": 0, "warmup": 0, "threads": 1, "dtype": "fp32"}
POINT |= {"chunk_size": 64, "logits_chunk_size": 100, "step": "train"}  # 2 layers, 4 heads, 2 K/V heads


def _spec(ranks: int, seq_len: int = 1000, method: str = "streambp", **values):
    (spec,) = point_specs({**POINT, "seq_len": seq_len, "nproc": ranks, "sp": ranks, **values}, [method])
    return spec


class _Collectives(SimulatedMemory):
    """The simulator's counter, also summing the bytes of each collective's first tensor (c10d ops)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            tensor = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
            self.first_bytes[name.split(".")[1]] += tensor.numel() * tensor.element_size()
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.slow  # a fake step on 2-4 ranks each: 7-12 s on 2 busy cores
@pytest.mark.parametrize(("ranks", "sp", "placement"), [(2, 2, "gpu"), (4, 4, "recompute:2"), (4, 2, "gpu")])
def test_the_collective_bytes_are_what_the_simulated_step_sends(ranks, sp, placement):
    """collective_bytes (from the shapes) equals what the fake step hands its collectives: each
    all-to-all counted (P - 1)/P of the P ranks sharing the sequence (P above the K/V heads too), each
    all-gather output and reduce-scatter input (N - 1)/N of FSDP2's N ranks."""
    spec = _spec(ranks, sp=sp, checkpoints=placement)
    _, counter = simulate(spec, target="cpu", counter_type=_Collectives)
    sent = counter.first_bytes
    model = meta_model(spec)
    predicted = collective_bytes(spec, model, rebuilt_layers=rebuilt_layers(spec.settings.checkpoints, 2))
    assert predicted.all_to_all == (sp - 1) / sp * sent["alltoall_base_"] > 0
    # the reduce-scatters' first tensor is their output, a 1/N shard of what each sends
    assert (
        predicted.fsdp == (ranks - 1) / ranks * (sent["_allgather_base_"] + ranks * sent["_reduce_scatter_base_"]) > 0
    )


def test_the_rank_holds_its_shards_and_the_node_its_ranks_host_buffers():
    """Weights, gradients and moments are 1/P per rank (AdamW's step counts whole); the host side of a row is per node (P ranks),
    and a stream placement's buffers are what one rank's share of --host-memory holds."""
    one, two = unrun_step(_spec(1), "cpu"), unrun_step(_spec(2), "cpu")  # built, not run
    assert storage_bytes(two.model.parameters()) * 2 == storage_bytes(one.model.parameters())
    assert two.grads_bytes * 2 == one.grads_bytes
    steps = 4 * sum(p.requires_grad for p in dict.fromkeys(meta_model(_spec(1)).parameters()))  # AdamW's 0-dim steps
    assert two.optimizer_state_bytes * 2 - steps == one.optimizer_state_bytes
    spec = _spec(8, seq_len=8192, model="Qwen/Qwen3-8B", dtype="bf16")
    row = planner.ResultRow(nproc=8, sp=8, host_pinned_peak_bytes=2**30)
    assert ranks_per_node(spec) == 8 and host_peak_bytes(row) == 8 * (host_peak_bytes(replace(row, sp=1)))
    layer_input = 8192 // 8 * 4096 * 2  # a rank's layer input: T_loc x d, bf16
    host = 8 * (5 * 2**30 + 10 * layer_input)  # 8 ranks: the process and 10 buffers each
    assert stream_buffers(spec, host) == 10


def test_a_rank_does_its_share_of_the_compute_and_waits_for_what_it_sends():
    """work(ranks=P): 1/P of the matmuls and of the attention, chunks of T_loc; step_time adds the bytes
    sent at the interconnect rate, outside the compute."""
    model = meta_model(_spec(8, seq_len=8192, model="Qwen/Qwen3-8B", dtype="bf16"))
    knobs = {"method": "streambp", "batch_size": 1, "seq_len": 1 << 20, "chunk_size": 4096, "logits_chunk_size": 1024}
    one, eight = work(model, **knobs), work(model, **knobs, ranks=8)
    assert eight.matmul_flops == pytest.approx(one.matmul_flops / 8)
    assert eight.attention_backward_flops == pytest.approx(one.attention_backward_flops / 8)
    assert eight.chunk_layers * 8 == one.chunk_layers
    rates = Rates(interconnect_bytes_s=100e9)
    alone, talking = step_time(eight, rates), step_time(eight, rates, sent_bytes=50e9)
    assert talking.communication_s == 0.5 and talking.total_s == pytest.approx(alone.total_s + 0.5)


@pytest.mark.slow  # three fake runs of a few seconds each
@pytest.mark.parametrize(("ranks", "seq_len", "placement"), [(2, 2000, "gpu"), (4, 3001, "stream")])
def test_a_long_rank_is_extrapolated_to_the_full_runs_byte(ranks, seq_len, placement):
    """From two short runs whose T_loc ends alike (length.py, sequence_parallel.SequenceChunks) to a
    longer T, T not a multiple of P included: the full fake run's peak, phase, host and copies."""
    spec = _spec(ranks, seq_len=seq_len, checkpoints=placement)
    fitted, (full, _) = estimate_by_length(spec, target="cuda"), simulate(spec, target="cuda")
    assert fitted is not None
    assert fitted.peak_allocated_bytes == full.peak_allocated_bytes and fitted.peak_phase == full.peak_phase
    assert (fitted.host_pinned_bytes, fitted.transfer_bytes) == (full.host_pinned_bytes, full.transfer_bytes)


@pytest.mark.slow  # four spawns of gloo ranks (10-15 s each on 2 cores)
@pytest.mark.parametrize(
    ("ranks", "seq_len", "values"),
    [
        (2, 1001, {"checkpoints": "stream"}),  # T not a multiple of 2, the layer inputs on the host
        (4, 4096, {"chunk_size": None, "logits_chunk_size": None}),  # the default point of --nproc 4 --sp 4
        (4, 1001, {"sp": 2, "checkpoints": "recompute:1"}),  # 2 data-parallel groups of 2
        (2, 1000, {"method": "ulysses"}),  # the ALST peer: DeepSpeed's attention, tiled MLP and loss, offload
    ],
)
def test_each_rank_sharing_a_sequence_peaks_at_the_prediction_to_the_byte(ranks, seq_len, values):
    """`sbp run --nproc N --sp P` on gloo ranks (FSDP2 over all N, Ulysses over each P), measured by the
    tensor tracker, against `sbp estimate --gpus N --sp P --target cpu` of the same point: the resident
    bytes and every rank's peak equal, StreamBP's and the ulysses peer's. The tracker runs collectives on copies, so gloo's worker threads
    never free a counted buffer late (measure/tensor_tracker.py)."""
    from sbpbench.runner.isolated import run_isolated

    if values.get("method") == "ulysses":
        pytest.importorskip("deepspeed")  # the peer's optional extra
    spec = _spec(ranks, seq_len=seq_len, **values)
    row = run_isolated(spec)
    assert (row.status, row.error) == ("ok", ""), row.error
    predicted = estimate(spec, target="cpu")
    assert row.baseline_bytes == predicted.baseline_bytes
    assert row.rank_peak_bytes == ";".join([str(predicted.peak_allocated_bytes)] * ranks)


@pytest.mark.filterwarnings("ignore::sbpbench.config.run.BeyondContextWarning")  # T past Qwen3-8B's 40,960
@pytest.mark.parametrize(
    ("sp", "said", "ranks"),
    [
        ([], "on 8 GPUs sharing it (GPU: per GPU; host: per node)", "--nproc 8 --sp 8"),
        (["--sp", "4"], "on 8 GPUs in groups of 4 sharing each row (GPU: per GPU; host: per node)", "--sp 4 --nproc 8"),
    ],
)
def test_sbp_plan_on_eight_gpus_ends_with_their_sbp_run_line(monkeypatch, sp, said, ranks):
    """`sbp plan --gpus 8 [--sp 4]`: per-GPU memory and per-node host named, the step's communication
    at the interconnect given, tokens/s of every group, and the pasteable `sbp run` line with the ranks."""
    from typer.testing import CliRunner

    from sbpbench.cli import app

    def fits(spec, **_):
        row = planner.ResultRow(model=spec.model, method="streambp", seq_len=spec.seq_len, nproc=8, sp=spec.sp)
        row.status, row.error, row.num_layers = "ok", "", 36
        row.peak_allocated_bytes, row.margin_bytes, row.host_pinned_peak_bytes = 50 * 2**30, 2**30, 0
        row.logits_chunk_size = spec.settings.logits_chunk_size
        return row

    monkeypatch.setattr(planner, "estimate_point_by_depth", fits)
    args = ["plan", "--gpus", "8", *sp, "--model", "Qwen/Qwen3-8B", "--seq", "1048576", "--host-memory", "1TiB"]
    result = CliRunner().invoke(app, [*args, "--interconnect", "300GB/s"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    command = result.output.splitlines()[-1]
    assert said in result.output and "at 300 GB/s each way (--interconnect)" in result.output
    assert command.startswith(f"sbp run --model Qwen/Qwen3-8B --seq 1048576 {ranks} --device cuda"), command
    plan = next(line for line in result.output.splitlines() if line.startswith("plan: "))
    seconds, tokens_per_s = (
        int(n.replace(",", "")) for n in re.search(r"predicted ([\d,]+) s .*\(([\d,]+) tokens/s", plan).groups()
    )
    assert tokens_per_s == pytest.approx((2 if sp else 1) * 1048576 / seconds, rel=0.01)
    assert ("over the 2 groups" in plan) == bool(sp)


def test_estimate_on_gpus_sharing_a_sequence_predicts_streambp_and_ulysses(tmp_path):
    """`sbp estimate --gpus 2 --method streambp ulysses`: a row each, for two model shapes in one process
    (DeepSpeed's groups, made in each step's fake process group, are let go after it, so the next
    shape registers afresh); bp is refused in one line."""
    from typer.testing import CliRunner

    from sbpbench.cli import app
    from sbpbench.records import read_rows

    pytest.importorskip("deepspeed")
    args = ["estimate", "--gpus", "2", "--method", "streambp", "ulysses", "--model", "tiny/qwen3", "--seq", "256"]
    for out, depth in ((tmp_path / "a.csv", []), (tmp_path / "b.csv", ["--num-layers", "1"])):  # two shapes
        result = CliRunner().invoke(app, [*args, *depth, "--target", "cpu", "--out", str(out)])
        assert result.exit_code == 0, result.output
        rows = read_rows(out)
        assert [(r["method"], r["status"], r["sp"]) for r in rows] == [("streambp", "ok", "2"), ("ulysses", "ok", "2")]
    assert int(read_rows(tmp_path / "a.csv")[1]["peak_allocated_bytes"]) > int(rows[1]["peak_allocated_bytes"])
    refused = CliRunner().invoke(app, ["estimate", "--gpus", "2", "--method", "bp", "--model", "tiny/qwen3"])
    assert refused.exit_code == 2 and "bp is not modelled so" in refused.output
