"""StreamBP under FSDP2 on CPU with 2 gloo ranks: gradients equal one process's, and the collectives
equal plain FSDP2 backprop's whatever the chunk count (core/parallel/grad_sync.py).

Each rank trains on its own batch (data parallel); the reference is standard BP in one process on
every rank's batch, gradients averaged over ranks (FSDP2 divides by the world size) and summed over
micro-batches. All cases run in one spawn of two workers (about 20 s of imports saved per case);
rank 0 sends full gradients and collective counts back to the parent.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from sbpbench.data import make_batch

from ..conftest import streamed, tiny_model
from .ranks import WORLD, run_distributed, serve_cases

SEQ = 24
# Collectives FSDP2 issues (torch 2.13 calls the *_single names; older ones the others).
_COLLECTIVES = {
    "all_gather": ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"),
    "all_reduce": ("all_reduce",),
}


def _case(
    name,
    *,
    wrap="full",
    tied=False,
    objective="sft",
    method="stream",
    chunk=5,
    micro=1,
    lora=False,
    bf16=None,
    checkpoints="gpu",
    left_pad=False,
):
    """bf16: None (fp32 throughout) or whether StreamBP sums chunk gradients in fp32, under FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32). checkpoints: the placement.
    left_pad: the second row's prompt left-padded, as TRL's GRPO batches are (core/layout.py)."""
    return {
        "checkpoints": checkpoints,
        "left_pad": left_pad,
        "name": name,
        "wrap": wrap,
        "tied": tied,
        "objective": objective,
        "method": method,
        "chunk": chunk,
        "micro": micro,
        "lora": lora,
        "bf16": bf16,
    }


CASES = [
    _case("full_sft_untied"),
    _case("full_sft_tied", tied=True),
    _case("zero2_sft", wrap="zero2"),
    _case("replicate_sft", wrap="replicate"),
    _case("full_two_micro_batches", micro=2),
    _case("full_grpo", objective="grpo"),
    _case("full_grpo_left_padded_recompute", objective="grpo", left_pad=True, checkpoints="recompute:2"),
    _case("full_dpo", objective="dpo", tied=True),
    _case("full_lora", lora=True),
    # recompute placements: tiny/qwen3's 2 layers, K = 2: layer 0 rebuilds X_1 (one more all-gather)
    _case("full_cpu_recompute", checkpoints="cpu+recompute:2"),
    _case("zero2_recompute_tied", wrap="zero2", tied=True, checkpoints="recompute:2"),
    _case("full_recompute_chunks12", chunk=2, checkpoints="recompute:2"),
    # collective counts: plain FSDP2 backprop against 1, 3 and 12 chunks (SEQ / chunk)
    # bf16 compute, fp32 master weights and reduction: errors against an fp64 reference
    _case("bf16_bp", method="bp", bf16=True),
    _case("bf16_stream_fp32_sums", chunk=2, bf16=True),
    _case("bf16_stream_bf16_sums", chunk=2, bf16=False),
    _case("refused_layer_not_a_unit", wrap="root_only"),
    _case("refused_head_in_a_unit_with_layers", wrap="decoder_unit"),
    # head modules in units of their own: the final norm alone, and Accelerate's FSDP2 layout
    _case("head_in_own_unit", wrap="head_unit"),
    _case("accelerate_untied_two_micro_batches", wrap="accelerate", micro=2),
    _case("accelerate_tied_grpo_left_padded", wrap="accelerate", tied=True, objective="grpo", left_pad=True),
    *[_case(f"{wrap}_bp", wrap=wrap, method="bp") for wrap in ("full", "zero2", "replicate")],
    *[
        _case(f"{wrap}_chunks{SEQ // chunk}", wrap=wrap, chunk=chunk)
        for wrap in ("full", "zero2", "replicate")
        for chunk in (SEQ, 8, 2)
    ],
]


def _model(case):
    model = tiny_model("tiny/qwen3", torch.float32, tie_word_embeddings=case["tied"])
    if case["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
        for name, param in model.named_parameters():  # B starts at 0: make every gradient non-trivial
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def _batch(case, model, rank, micro):
    vocab = model.config.vocab_size
    batch = make_batch(
        case["objective"], batch_size=2, seq_len=SEQ, vocab_size=vocab, prompt_len=6, seed=100 * micro + rank
    )
    if not case.get("left_pad"):
        return batch
    mask = batch.attention_mask.clone()
    mask[1, :3] = 0  # 3 of the 6 prompt tokens become left padding (prompt labels are -100 already)
    return replace(batch, attention_mask=mask)


def _step(case, model, batch):

    if case["method"] == "bp":
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        batch.objective().full_loss(logits).backward()
    else:
        streamed(
            model,
            batch.input_ids,
            objective=batch.objective(),
            attention_mask=batch.attention_mask,
            chunk_size=case["chunk"],
            logits_chunk_size=case["chunk"],
            fp32_grad_accumulation=case["bf16"] is not False,
            checkpoints=case["checkpoints"],
        )


def _wrap(case, model):
    import functools

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp_fully_shard

    # a CPU mesh, as the models are: FSDP2's default mesh is the machine's accelerator's, CUDA on a GPU machine
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard = functools.partial(fsdp_fully_shard, mesh=mesh)
    policy = MixedPrecisionPolicy()
    if case["bf16"] is not None:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if case["wrap"] == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        shard = functools.partial(replicate, mesh=mesh)
    else:
        reshard = case["wrap"] in ("full", "accelerate")

        def shard(module):
            return fully_shard(module, reshard_after_forward=reshard, mp_policy=policy)

    layers = model.get_decoder().layers
    for layer in layers if case["wrap"] != "root_only" else layers[1:]:
        shard(layer)
    decoder = model.get_decoder()
    if case["wrap"] == "head_unit":
        fully_shard(decoder.norm)
    if case["wrap"] == "decoder_unit":
        fully_shard(decoder)
    if case["wrap"] == "accelerate":  # accelerate 1.15's fsdp2_prepare_model: embedding and tail units of their own
        tied = model.lm_head.weight is decoder.embed_tokens.weight
        if not tied:
            fully_shard(decoder.embed_tokens, mp_policy=policy)
        tail = [decoder.norm, decoder.embed_tokens, model.lm_head] if tied else [decoder.norm, model.lm_head]
        fully_shard(tail, reshard_after_forward=False, mp_policy=policy)
    if case["wrap"] == "replicate":
        shard(model)
    else:
        fully_shard(model, mp_policy=policy)  # the root's default: kept gathered from forward to backward
    return model


def _reference(case, dtype=torch.float32):
    """Standard BP in one process: rank-averaged, micro-batch-summed gradients."""
    model = _model(case).to(dtype)
    for micro in range(case["micro"]):
        for rank in range(WORLD):
            batch = _batch(case, model, rank, micro)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            (batch.objective().full_loss(logits) / WORLD).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


class _Counter:
    """Counts calls of torch.distributed's collective functions while active."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.counts, self.saved = dist, {}, {}

    def __enter__(self):
        for kind, names in _COLLECTIVES.items():
            self.counts[kind] = 0
            for name in names:
                original = getattr(self.dist, name, None)
                if original is None:
                    continue
                self.saved[name] = original

                def counted(*args, _kind=kind, _original=original, **kwargs):
                    self.counts[_kind] += 1
                    return _original(*args, **kwargs)

                setattr(self.dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(self.dist, name, original)


def _run_case(case, rank):
    model = _wrap(case, _model(case))
    if case["name"].startswith("refused"):
        try:
            _step(case, model, _batch(case, model, rank, 0))
        except ValueError as error:
            return {}, {"error": str(error)}
        return {}, {"error": None}
    with _Counter() as counter:
        for micro in range(case["micro"]):
            last = micro == case["micro"] - 1
            model.set_requires_gradient_sync(last)
            _step(case, model, _batch(case, model, rank, micro))
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[name] = full.detach().numpy().copy()  # plain pickle: no shared memory outliving the worker
    return grads, dict(counter.counts)


def _worker(rank, port, cases, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    serve_cases(rank, cases, queue, _run_case, finish=dist.destroy_process_group)


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("torch.distributed.fsdp")
    return run_distributed(CASES, target=_worker)


def _assert_close(name, grads, reference, tolerance=1e-5):
    assert grads.keys() == reference.keys(), f"{name}: parameters with gradients differ"
    for key, ref in reference.items():
        error = (grads[key] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        assert error <= tolerance, f"{name}: {key} relative error {error:.2e}"


EXACT = [
    c
    for c in CASES
    if c["method"] == "stream" and "chunks" not in c["name"] and not c["name"].startswith(("refused", "bf16"))
]


@pytest.mark.slow
@pytest.mark.parametrize("case", EXACT, ids=[case["name"] for case in EXACT])
def test_gradients_match_one_process(results, case):
    """StreamBP on 2 FSDP2 ranks gives the rank-averaged one-process gradients (fp32 rounding)."""
    _assert_close(case["name"], results[case["name"]][0], _reference(case))


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["full", "zero2", "replicate"])
def test_collectives_equal_plain_fsdp2(results, wrap):
    """All-gathers, reduce-scatters and all-reduces equal plain FSDP2 backprop's for 1, 3, 12 chunks."""
    expected = results[f"{wrap}_bp"][1]
    for chunks in (1, 3, 12):
        name = f"{wrap}_chunks{chunks}"
        assert results[name][1] == expected, f"{name}: {results[name][1]} != plain FSDP2 {expected}"
        _assert_close(name, results[name][0], results[f"{wrap}_bp"][0])


@pytest.mark.slow
def test_a_rebuild_adds_one_all_gather_per_rebuilt_layer(results):
    """recompute:2 on 2 layers rebuilds X_1 once through layer 0, gathered once for all 12 chunks:
    plain FSDP2's collectives plus one all-gather; the reductions are unchanged."""
    expected = dict(results["full_bp"][1], all_gather=results["full_bp"][1]["all_gather"] + 1)
    assert results["full_recompute_chunks12"][1] == expected
    assert results["full_cpu_recompute"][1] == expected
    _assert_close("full_recompute_chunks12", results["full_recompute_chunks12"][0], results["full_bp"][0])


@pytest.mark.slow
def test_layout_refusals(results):
    """A decoder layer that is not its own FSDP unit, or a final norm in a unit with decoder layers, is refused."""
    assert "not FSDP units" in results["refused_layer_not_a_unit"][1]["error"]
    assert "a unit without decoder layers" in results["refused_head_in_a_unit_with_layers"][1]["error"]


def test_sequence_parallel_attention_is_refused():
    """An attention implementation named like Ulysses / ring attention is refused before any work."""
    from types import SimpleNamespace

    from sbpbench.core.parallel.grad_sync import check_no_sequence_parallel

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="looks sequence parallel"):
        check_no_sequence_parallel(model, SimpleNamespace(_attn_implementation="ulysses"))
    with pytest.raises(ValueError, match="ring attention"):
        check_no_sequence_parallel(model, SimpleNamespace(_attn_implementation="ring_flash"), told=True)
    check_no_sequence_parallel(model, SimpleNamespace(_attn_implementation="ulysses"), told=True)
    check_no_sequence_parallel(model, SimpleNamespace(_attn_implementation="sdpa"))


def test_context_parallel_mesh_is_refused():
    """A parameter on a device mesh with a context-parallel dimension ("dp_shard_cp") is refused."""
    from types import SimpleNamespace

    from sbpbench.core.parallel.grad_sync import check_no_sequence_parallel

    model = torch.nn.Linear(2, 2)
    model.weight.device_mesh = SimpleNamespace(mesh_dim_names=("dp_shard_cp",))  # what a DTensor carries
    with pytest.raises(ValueError, match="context-parallel"):
        check_no_sequence_parallel(model, SimpleNamespace(_attn_implementation="sdpa"))
    model.weight.device_mesh = SimpleNamespace(mesh_dim_names=("dp_replicate", "dp_shard"))
    check_no_sequence_parallel(model, SimpleNamespace(_attn_implementation="sdpa"))


def _max_rel_error(grads, reference) -> float:
    return max((grads[k].double() - ref).abs().max().item() / ref.abs().max().item() for k, ref in reference.items())


@pytest.mark.slow
def test_bf16_fp32_chunk_sums_no_worse_than_fsdp2_backprop(results):
    """Under FSDP2 bf16 compute / fp32 reduce, StreamBP's fp32 chunk sums (12 chunks) stay within
    plain FSDP2 backprop's bf16 error against an fp64 reference; bf16 sums are reported for contrast."""
    reference = _reference(_case("bf16_ref"), torch.float64)
    errors = {
        name: _max_rel_error(results[name][0], reference)
        for name in ("bf16_bp", "bf16_stream_fp32_sums", "bf16_stream_bf16_sums")
    }
    print("max relative gradient error vs fp64:", errors)
    assert errors["bf16_stream_fp32_sums"] <= 2 * errors["bf16_bp"], errors


def test_zero_module_without_its_engine_is_refused():
    """A module under DeepSpeed ZeRO (parameters marked ds_id) given without its DeepSpeedEngine is
    refused with what to pass instead, not run with no reduction at all."""

    model = tiny_model("tiny/qwen3", torch.float32)
    batch = make_batch("sft", batch_size=1, seq_len=8, vocab_size=model.config.vocab_size)
    next(model.parameters()).ds_id = 0  # what deepspeed.zero.Init leaves on a partitioned parameter
    with pytest.raises(ValueError, match="pass the DeepSpeedEngine"):
        streamed(model, batch.input_ids, batch.labels)


def _ds_engine(*, fp16=False, amp=None, optimizer_scales=None, autocast_scaler=None):
    """A stand-in for a DeepSpeedEngine with only what scales_loss probes; `amp=None`: no
    amp_enabled() at all (DeepSpeed >= 0.19.8 removed it), `optimizer_scales=None`: no needs_scaler()."""
    from types import SimpleNamespace

    optimizer = SimpleNamespace()
    if optimizer_scales is not None:
        optimizer.needs_scaler = lambda: optimizer_scales
    engine = SimpleNamespace(
        fp16_enabled=lambda: fp16, optimizer=optimizer, torch_autocast_z0_gradscaler=autocast_scaler
    )
    if amp is not None:
        engine.amp_enabled = lambda: amp
    return engine


def test_deepspeed_loss_scaling_found_with_or_without_amp_enabled():
    """The fp16 loss-scaling check works on engines with amp_enabled() (DeepSpeed < 0.19.8) and without
    it (0.19.8+), and sees each way an engine scales the loss: fp16, Apex AMP, a ZeRO optimizer's
    scaler, torch.autocast fp16's GradScaler at ZeRO-0."""
    from sbpbench.core.parallel.grad_sync_deepspeed import scales_loss

    assert not scales_loss(_ds_engine())  # 0.19.8+: no amp_enabled attribute
    assert not scales_loss(_ds_engine(amp=False, optimizer_scales=False))
    assert scales_loss(_ds_engine(fp16=True))
    assert scales_loss(_ds_engine(amp=True))
    assert scales_loss(_ds_engine(optimizer_scales=True))
    assert scales_loss(_ds_engine(autocast_scaler=object()))
