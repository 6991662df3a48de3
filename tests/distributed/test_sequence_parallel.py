"""StreamBP inside Ulysses sequence parallelism (core/parallel/sequence_*.py) on CPU gloo ranks, fp64:
every rank's loss and gradients equal one process's standard BP on the whole sequence.

Every rank gets the same whole (B, T) batch; the reference is `objective.full_loss(model(ids).logits)`
backpropagated in one process (the test process, after the spawn). The grid runs in one spawn of 2
ranks and one of 4 (P = 2 and P = 4; the 4-rank one also holds FSDP2 on a 2 x 2 dp_shard x sp mesh);
rank 0 sends full gradients and every rank's loss back to the parent (ranks.py).
"""

from __future__ import annotations

import functools
import math
import os
import traceback
from types import SimpleNamespace

import pytest
import torch

from sbpbench.core import DPO, GRPO, SFT, StreamConfig, stream_backward
from sbpbench.core.objectives import token_logps
from sbpbench.data import make_dpo_batch, make_grpo_batch

from ..conftest import tiny_model
from .ranks import run_distributed, serve_cases

TOLERANCE = 1e-10  # fp64: the chunked, sharded sums differ from one process's by rounding only
VOCAB = 101
SHAPE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=VOCAB)


def _case(
    name,
    *,
    world,
    seq=33,
    chunks=3,
    layout="contiguous",
    kv=2,
    family="tiny/qwen3",
    objective="sft",
    ignored=None,
    lora=False,
    tied=True,
    checkpoints="gpu",
    accumulate=False,
    fsdp=False,
    mismatch=False,
):
    """chunks: local chunks per rank (1: chunk_size >= T_loc). ignored: (ranks, [start, end)): the SFT
    labels all -100 there, so that those ranks (contiguous layout) have no target. accumulate: .grad holds a seeded
    tensor before the step. fsdp: FSDP2 on a (2, 2) dp_shard x sp mesh, a batch per data rank.
    mismatch: rank 0 runs chunk_size 2, rank 1 chunk_size 3."""
    return dict(
        name=name, world=world, seq=seq, chunks=chunks, layout=layout, kv=kv, family=family, objective=objective,
        ignored=ignored, lora=lora, tied=tied, checkpoints=checkpoints, accumulate=accumulate, fsdp=fsdp,
        mismatch=mismatch,
    )  # fmt: skip


def _grid(world):
    """Layouts x chunk counts x (T, K/V heads): T never a multiple of P x chunk; K/V heads below P
    (each repeated on P / h_kv ranks) and, at P = 2, equal to it."""
    shapes = [(33, 2), (37, 1)] if world == 2 else [(33, 1), (37, 2)]
    return [
        _case(
            f"p{world}_{layout}_chunks{chunks}_t{seq}_kv{kv}", world=world, seq=seq, chunks=chunks, layout=layout, kv=kv
        )
        for layout in ("contiguous", "interleaved")
        for chunks in (1, 3)
        for seq, kv in shapes
    ]


def _more(world, layout):
    """Objectives, LoRA, a second family, rank-empty labels and gradient accumulation at P = world."""
    p = f"p{world}"
    return [
        _case(f"{p}_grpo_token", world=world, layout=layout, objective="grpo_token", kv=1, seq=37),
        _case(f"{p}_grpo_sequence", world=world, layout=layout, objective="grpo_sequence", kv=1, seq=37),
        _case(f"{p}_dpo", world=world, layout=layout, objective="dpo", kv=1, seq=37),
        _case(f"{p}_lora", world=world, layout=layout, lora=True),
        _case(f"{p}_llama", world=world, layout=layout, family="tiny/llama", kv=1, seq=37),
        _case(f"{p}_accumulate", world=world, layout=layout, accumulate=True),
        _case(f"{p}_accumulate_lora_grpo_sequence", world=world, lora=True, accumulate=True, objective="grpo_sequence"),
        _case(f"{p}_second_half_ignored", world=world, seq=32, ignored=(tuple(range(world // 2, world)), (16, 32))),
        _case(
            f"{p}_second_half_ignored_interleaved", world=world, seq=32, ignored=((), (16, 32)), layout="interleaved"
        ),
    ]


CASES_2 = [
    *_grid(2),
    *_more(2, "interleaved"),
    _case("p2_first_half_ignored", world=2, seq=32, ignored=((0,), (0, 17))),
    _case("p2_first_half_ignored_one_chunk", world=2, seq=32, ignored=((0,), (0, 17)), chunks=1),
    _case("p2_untied", world=2, tied=False, layout="interleaved"),
    _case("p2_checkpoints_cpu", world=2, checkpoints="cpu"),
    _case("p2_checkpoints_recompute1", world=2, checkpoints="recompute:1"),
    _case("p2_checkpoints_recompute2", world=2, checkpoints="recompute:2", layout="interleaved"),
    _case("p2_checkpoints_cpu_recompute2", world=2, checkpoints="cpu+recompute:2", seq=37, kv=1),
    _case("p2_checkpoints_stream", world=2, checkpoints="stream", layout="interleaved"),
    _case("p2_checkpoints_stream2", world=2, checkpoints="stream:2"),
    _case("p2_mismatched_chunks", world=2, mismatch=True),
]
CASES_4 = [
    *_grid(4),
    *_more(4, "contiguous"),
    _case("p4_middle_rank_ignored", world=4, seq=32, ignored=((1,), (9, 17))),  # rank 1 holds positions [8, 16)
    _case("p4_checkpoints_recompute2", world=4, checkpoints="recompute:2", layout="interleaved", kv=1),
    _case("p4_fsdp2_mesh_sft", world=4, fsdp=True),
    _case("p4_fsdp2_mesh_grpo_sequence", world=4, fsdp=True, objective="grpo_sequence", layout="interleaved", kv=1),
    _case("p4_fsdp2_mesh_dpo_lora", world=4, fsdp=True, objective="dpo", lora=True),
]
EXACT = [case for case in CASES_2 + CASES_4 if not case["mismatch"]]


def _model(case):
    kv = {"num_key_value_heads": case["kv"], "head_dim": 16}
    model = tiny_model(case["family"], torch.float64, **SHAPE, **kv, tie_word_embeddings=case["tied"])
    if case["lora"]:
        from sbpbench.models import apply_lora

        model = apply_lora(model, rank=4, alpha=8, init_nonzero_seed=0)  # lora_B nonzero: every adapter gets a gradient
    return model


def _sp_size(case) -> int:
    """Ranks sharing one sequence: 2 on the (2, 2) mesh, else the world."""
    return 2 if case["fsdp"] else case["world"]


def _batch(case, model, data_rank=0):
    """(input_ids (B, T), objective) of one data rank; the same on every rank of a sequence group."""
    seed, seq = 10 + data_rank, case["seq"]
    if case["objective"] == "dpo":
        batch = make_dpo_batch(batch_size=2, seq_len=seq, vocab_size=VOCAB, prompt_len=6, seed=seed)
        return batch.input_ids, DPO(batch.labels, ref_logps=batch.ref_logps, beta=0.1)
    if case["objective"].startswith("grpo"):
        batch = make_grpo_batch(group_size=3, seq_len=seq, vocab_size=VOCAB, prompt_len=6, seed=seed)
        with torch.no_grad():  # old log-probs near the current ones, some ratios outside [0.8, 1.2]
            current = token_logps(model(input_ids=batch.input_ids).logits, SFT(batch.labels).targets)
        noise = 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(seed), dtype=current.dtype)
        level = case["objective"].removeprefix("grpo_")
        return batch.input_ids, GRPO(
            batch.labels, advantages=batch.advantages, ref_logps=batch.ref_logps, old_logps=current + noise,
            importance_sampling_level=level, loss_type="grpo" if level == "token" else "bnpo",
        )  # fmt: skip
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :5] = -100  # rows with different numbers of targets
    if case["ignored"] is not None:
        start, end = case["ignored"][1]
        labels[:, start:end] = -100  # position t predicts labels[t + 1]: positions [start - 1, end - 1) count nothing
    return ids, SFT(labels)


def _config(case, rank: int) -> StreamConfig:
    local = math.ceil(case["seq"] / _sp_size(case))  # T_loc
    chunk = local if case["chunks"] == 1 else math.ceil(local / case["chunks"])
    if case["mismatch"]:
        chunk = 2 + rank  # rank 0: 2, rank 1: 3
    return StreamConfig(chunk_size=chunk, logits_chunk_size=max(chunk - 1, 1), checkpoints=case["checkpoints"])


def _seeded_grads(model) -> dict:
    """What .grad holds before an accumulation step: seeded, the same on every rank."""
    generator = torch.Generator().manual_seed(7)
    return {
        name: 0.01
        * torch.randn(p.shape, dtype=p.dtype, generator=generator)  # the gradients' size: little cancellation
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _fsdp_wrap(model):
    """FSDP2 over the flattened (dp_shard, sp) mesh, each decoder layer its own unit (torchtitan's
    layout); the sequence-parallel group is the mesh's "sp" dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "sp"))
    flat = mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    return model, mesh


def _run_case(case, rank):
    import torch.distributed as dist

    from sbpbench.core.parallel.sequence_group import SequenceParallel

    model = _model(case)
    if case["fsdp"]:
        model, mesh = _fsdp_wrap(model)
        group = SequenceParallel.from_mesh(mesh, "sp", layout=case["layout"])
        data_rank = mesh.get_local_rank("dp_shard")
    else:
        group, data_rank = SequenceParallel(layout=case["layout"]), 0
    ids, objective = _batch(case, model, data_rank)
    before = _seeded_grads(model) if case["accumulate"] else {}
    for name, param in model.named_parameters():
        if name in before:
            param.grad = before[name].clone()
    error, loss = None, float("nan")
    try:
        loss = float(
            stream_backward(model, ids, objective=objective, config=_config(case, rank), sequence_parallel=group)
        )
    except ValueError as caught:
        error = str(caught)
    except Exception:
        error = traceback.format_exc()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"loss": loss, "error": error})  # every rank's outcome, to rank 0
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            grads[name] = (grad - before.get(name, 0)).detach().numpy().copy()  # plain pickle, no shared memory
    return grads, {"losses": [e["loss"] for e in every], "errors": [e["error"] for e in every]}


def _worker(rank, port, cases, queue, *, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    serve_cases(rank, cases, queue, _run_case, finish=dist.destroy_process_group)


def _spawn(cases, world):
    # a hang (ranks that disagree on a collective) fails the test after the timeout instead of stalling CI
    return run_distributed(cases, functools.partial(_worker, world=world), timeout_s=300.0, world=world)


@pytest.fixture(scope="module")
def results_2():
    return _spawn(CASES_2, 2)


@pytest.fixture(scope="module")
def results_4():
    pytest.importorskip("torch.distributed.fsdp")
    return _spawn(CASES_4, 4)


def _reference(case):
    """One process, whole sequence: each data rank's loss and the gradient averaged over the data
    ranks (2 under FSDP2's mesh, else 1)."""
    model = _model(case)
    data_ranks = 2 if case["fsdp"] else 1
    losses = []
    for data_rank in range(data_ranks):
        ids, objective = _batch(case, model, data_rank)
        loss = objective.full_loss(model(input_ids=ids).logits)
        (loss / data_ranks).backward()
        losses.append(loss.item())
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return losses, grads


def _relative_errors(grads, reference) -> dict:
    assert grads.keys() == reference.keys(), f"parameters with gradients differ: {grads.keys() ^ reference.keys()}"
    return {
        name: (grads[name] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        for name, ref in reference.items()
    }


def _assert_exact(case, results):
    grads, outcome = results[case["name"]]
    assert outcome["errors"] == [None] * case["world"], f"{case['name']}: {outcome['errors']}"
    losses, reference = _reference(case)
    errors = _relative_errors(grads, reference)
    worst = max(errors, key=errors.get)
    expected = [losses[rank // _sp_size(case)] for rank in range(case["world"])]  # data rank r // P
    loss_errors = [abs(got - loss) / abs(loss) for got, loss in zip(outcome["losses"], expected)]
    print(f"{case['name']}: max grad error {errors[worst]:.1e} ({worst}), max loss error {max(loss_errors):.1e}")
    assert errors[worst] <= TOLERANCE, f"{case['name']}: {worst} relative error {errors[worst]:.2e}"
    assert max(loss_errors) <= TOLERANCE, f"{case['name']}: losses {outcome['losses']} != {expected}"


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in EXACT if c["world"] == 2], ids=lambda c: c["name"])
def test_two_ranks_match_one_process(results_2, case):
    """On 2 sequence-parallel ranks every rank's loss and the gradients equal one process's to 1e-10 (fp64)."""
    _assert_exact(case, results_2)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in EXACT if c["world"] == 4], ids=lambda c: c["name"])
def test_four_ranks_match_one_process(results_4, case):
    """On 4 ranks (one sequence group, or FSDP2 on a 2 x 2 dp_shard x sp mesh) the loss and the
    gradients equal one process's (data ranks averaged) to 1e-10 (fp64)."""
    _assert_exact(case, results_4)


@pytest.mark.slow
def test_mismatched_chunk_sizes_raise_on_every_rank(results_2):
    """Ranks given different chunk sizes all raise ValueError naming the disagreement, none hangs."""
    _, outcome = results_2["p2_mismatched_chunks"]
    for rank, error in enumerate(outcome["errors"]):
        assert error is not None and "disagree" in error and "chunk_size" in error, f"rank {rank}: {error}"


# One process, no spawn: refusals raised before any collective, so a stand-in for a 2-rank group does.
def _stand_in_group(world=2):
    return SimpleNamespace(world=world, rank=0, layout="contiguous")


def _small_step(model, labels=None, **kwargs):
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    labels = ids if labels is None else labels
    return stream_backward(model, ids, labels, config=StreamConfig(chunk_size=4), **kwargs)


def test_query_heads_not_divisible_by_ranks_is_refused():
    """3 query heads over 2 ranks is refused with a ValueError before any work."""
    model = tiny_model("tiny/qwen3", torch.float64, **(SHAPE | {"num_attention_heads": 3}), num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"query heads \(3\) divisible by 2"):
        _small_step(model, sequence_parallel=_stand_in_group())


def test_key_value_heads_neither_dividing_nor_divided_is_refused():
    """2 K/V heads over 3 ranks (neither divides the other) is refused; 6 query heads pass the first check."""
    model = tiny_model("tiny/qwen3", torch.float64, **(SHAPE | {"num_attention_heads": 6}), num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"key/value heads \(2\)"):
        _small_step(model, sequence_parallel=_stand_in_group(3))


def test_position_ids_and_padding_are_refused():
    """position_ids (packing) and a padded attention_mask are refused under sequence parallelism."""
    model = tiny_model("tiny/qwen3", torch.float64, **SHAPE, num_key_value_heads=2)
    with pytest.raises(ValueError, match="no position_ids"):
        _small_step(model, sequence_parallel=_stand_in_group(), position_ids=torch.arange(8)[None])
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 6:] = 0  # right padding, its labels -100: a valid batch without sequence parallelism
    labels = torch.full((1, 8), -100)
    labels[0, 1:6] = 1
    with pytest.raises(ValueError, match="unpadded rows"):
        _small_step(model, labels, sequence_parallel=_stand_in_group(), attention_mask=mask)
    _small_step(model, labels, attention_mask=mask)


def test_ring_attention_and_context_parallel_refused_even_when_told():
    """Told of its Ulysses group, StreamBP still refuses ring attention and a context-parallel mesh
    dimension, and accepts an "sp" mesh dimension."""
    from sbpbench.core.parallel.grad_sync import check_no_sequence_parallel

    sdpa = SimpleNamespace(_attn_implementation="sdpa")
    with pytest.raises(ValueError, match="ring attention"):
        check_no_sequence_parallel(torch.nn.Linear(2, 2), SimpleNamespace(_attn_implementation="ring"), told=True)
    model = torch.nn.Linear(2, 2)
    model.weight.device_mesh = SimpleNamespace(mesh_dim_names=("dp_shard", "cp"))  # what a DTensor carries
    with pytest.raises(ValueError, match="context-parallel"):
        check_no_sequence_parallel(model, sdpa, told=True)
    model.weight.device_mesh = SimpleNamespace(mesh_dim_names=("dp_shard", "sp"))
    with pytest.raises(ValueError, match="sequence-parallel dimension"):
        check_no_sequence_parallel(model, sdpa)
    check_no_sequence_parallel(model, sdpa, told=True)


def test_sequence_parallel_refuses_an_unknown_layout():
    """SequenceParallel(layout=...) takes "contiguous" or "interleaved" only."""
    from sbpbench.core.parallel.sequence_group import SequenceParallel

    with pytest.raises(ValueError, match="layout must be one of"):
        SequenceParallel(layout="striped")


IGNORED = [c for c in EXACT if c["ignored"] is not None and c["ignored"][0]]


@pytest.mark.parametrize("case", IGNORED, ids=lambda c: c["name"])
def test_ignored_cases_leave_a_rank_without_targets(case):
    """The rank-empty cases are what they claim: that rank's positions have no target, the others some."""
    from sbpbench.core.parallel.sequence_shards import SequenceShards

    _, objective = _batch(case, None)
    empty, world = case["ignored"][0], case["world"]
    for rank in range(world):
        positions = SequenceShards(case["seq"], world, rank, 1, case["layout"]).positions()
        counted = int(objective.mask[:, positions[positions < case["seq"]]].sum())
        assert (counted == 0) == (rank in empty), f"rank {rank}: {counted} targets"


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
@pytest.mark.parametrize("seq, world, chunk", [(33, 2, 6), (37, 4, 4), (32, 4, 100), (5, 4, 1)])
def test_shards_partition_the_padded_sequence(layout, seq, world, chunk):
    """The ranks' positions partition [0, T_pad) and each chunk step's runs cover exactly the ranks' blocks."""
    from sbpbench.core.parallel.sequence_shards import SequenceShards

    shards = [SequenceShards(seq, world, rank, chunk, layout) for rank in range(world)]
    every = torch.cat([s.positions() for s in shards])
    assert sorted(every.tolist()) == list(range(shards[0].padded_len))
    for index in range(len(shards[0].chunks)):
        covered = sorted(p for start, end in shards[0].runs(index) for p in range(start, end))
        blocks = sorted(p for rank in range(world) for p in range(*shards[0].block(rank, index)))
        assert covered == blocks
        if layout == "interleaved":
            assert len(shards[0].runs(index)) == 1
