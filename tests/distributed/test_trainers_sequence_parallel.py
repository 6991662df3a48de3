"""The StreamBP SFT trainer under Accelerate's DeepSpeed sequence parallelism
(`ParallelismConfig(sp_backend="deepspeed", sp_size=2)`, ZeRO-2 and ZeRO-3) on 2 gloo ranks sharing
each sequence: the gradients of one optimizer step over 3 accumulated micro-batches, and the logged
loss, are one process's standard BP on the same whole batches, to fp32 rounding. One spawn runs
every case, the refusals and the rebuilding of the adapter's halves too.

Accelerate wraps the dataloader in DeepSpeed's Ulysses adapter: each rank gets its half of every
row, with the labels shifted over the whole row first (integrations/sequence_parallel.py). The
adapter takes one dataloader batch from each rank of the group and gives them in turn. On CPU ranks
Accelerate's DeepSpeed state counts one process (it finds no device backend; DeepSpeed's own gloo
group has 2), so it does not shard the dataloader: both ranks read the same batches, and the
adapter gives each twice. The window of 3 micro-batches is therefore batches 0, 0, 1, of different
target counts: a loss normalised per micro-batch (the stock Trainer's under this adapter) would not
match; the reference normalises by the window's targets, as the Trainer does without sequence
parallelism.
"""

from __future__ import annotations

import functools
import shutil
import tempfile

import pytest
import torch

from ..conftest import tiny_model
from .ranks import run_distributed, trainer_rank

pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: pip install -e '.[deepspeed]'")
pytest.importorskip("trl", reason="needs TRL: pip install -e '.[trl]'")

BATCH, ACCUMULATION = 2, 3  # rows per micro-batch, micro-batches per optimizer step
CASES = [
    {"name": "sft_zero2", "stage": 2},
    {"name": "sft_zero3", "stage": 3},
    {"name": "sft_packing_refused", "stage": 2, "packing": True},
    {"name": "whole_batch"},  # after a trainer case: its Accelerator has started the process group
]

# One row of 4 tokens as the adapter's collator gives it, whole (each rank gets half of each tensor).
RIGHT_PADDED = {
    "input_ids": [[5, 6, 7, 0]],
    "attention_mask": [[1, 1, 1, 0]],
    "position_ids": [[0, 1, 2, 0]],
    "shift_labels": [[6, 7, -100, -100]],  # labels [5, 6, 7, -100] shifted over the whole row
}
LEFT_PADDED = RIGHT_PADDED | {"attention_mask": [[0, 1, 1, 1]], "shift_labels": [[-100, 7, 8, -100]]}
PACKED = RIGHT_PADDED | {"attention_mask": [[1, 1, 1, 1]], "position_ids": [[0, 1, 0, 1]]}


def _rows(count: int) -> list[dict]:
    """Token rows of 6 .. 24 ids (odd and even lengths: the collator pads each batch to a multiple of 2)."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(6, 25, (count,), generator=generator).tolist()
    return [{"input_ids": torch.randint(2, 512, (n,), generator=generator).tolist()} for n in lengths]


def _trainer(case, model, output: str):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from datasets import Dataset
    from trl import SFTConfig

    from sbpbench.core import StreamConfig
    from sbpbench.integrations import StreamBPSFTTrainer

    from ..exactness.test_trainers import _tokenizer

    sequence_parallel = ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=2,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
    )
    deepspeed = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": {"stage": case["stage"], "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # Accelerate's default clips at 1.0: a clipped update would hide a wrong scale
    }
    args = SFTConfig(
        output_dir=output,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        bf16=False,
        activation_checkpointing=False,
        train_sampling_strategy="sequential",
        pad_to_multiple_of=2,  # the adapter cuts each row in 2 equal halves
        packing=case.get("packing", False),
        deepspeed=deepspeed,
        parallelism_config=sequence_parallel,
    )
    return StreamBPSFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(_rows(16)),
        processing_class=_tokenizer(),
        streambp=StreamConfig(chunk_size=3, logits_chunk_size=4),
    )


def _capture_gradients(trainer) -> dict:
    """Fills the returned dict with the engine's whole gradients just before its optimizer step
    (which clears them), wrapping the engine's step once Accelerate has made the engine."""
    from deepspeed.utils import safe_get_full_grad
    from transformers import TrainerCallback

    grads = {}

    class Capture(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            engine = trainer.model_wrapped
            step = engine.step

            def step_capturing(*args, **kwargs):
                if engine.is_gradient_accumulation_boundary():
                    for name, param in engine.module.named_parameters():
                        grads[name] = safe_get_full_grad(param).detach().clone().numpy()
                return step(*args, **kwargs)

            engine.step = step_capturing

    trainer.add_callback(Capture())
    return grads


def _whole_batches(rank: int) -> dict:
    """whole_batch on this rank's halves of the rows above: the rebuilt labels, or the refusal."""
    from sbpbench.core import SequenceParallel
    from sbpbench.integrations.sequence_parallel import whole_batch

    group, rebuilt = SequenceParallel(), {}
    for name, row in {"right_padded": RIGHT_PADDED, "left_padded": LEFT_PADDED, "packed": PACKED}.items():
        local = {key: torch.tensor(value)[:, 2 * rank : 2 * rank + 2] for key, value in row.items()}
        try:
            batch = whole_batch(local, group)
            rebuilt[name] = {key: value.tolist() for key, value in batch.items()}
        except ValueError as error:
            rebuilt[name] = str(error)
    return rebuilt


def _run_case(case, rank):
    """One optimizer step on this rank: the gradients it applied, the logged loss and the window's batches."""
    if case["name"] == "whole_batch":
        return {}, _whole_batches(rank)
    from accelerate.state import AcceleratorState
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # Accelerate has DeepSpeed wrap it in Ulysses attention
    model = tiny_model("tiny/qwen3", torch.float32)
    output = tempfile.mkdtemp(prefix="sbp-sp-trainer-")
    try:
        trainer = _trainer(case, model, output)
    except ValueError as error:
        AcceleratorState._reset_state()
        return {}, {"error": str(error)}
    finally:
        shutil.rmtree(output, ignore_errors=True)  # save_strategy "no": nothing of use there
    assert trainer.accelerator.num_processes == 1, "the window below assumes an unsharded dataloader (docstring)"
    grads = _capture_gradients(trainer)
    trainer.train()
    # the window (docstring): batches 0, 0, 1 of the sequential sampler, collated as trained
    rows = [(0, 1), (0, 1), (2, 3)]
    window = [trainer.data_collator([trainer.train_dataset[i] for i in pair]) for pair in rows]
    batches = [{key: batch[key].tolist() for key in ("input_ids", "labels")} for batch in window]
    loss = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
    trainer.model_wrapped.destroy()
    AcceleratorState._reset_state()  # one DeepSpeed Accelerator per process otherwise
    parallel_state_sp._release_sequence_parallel_groups()  # and one Ulysses registration:
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa  # the next case's wraps the plain function again
    return grads, {"loss": loss, "batches": batches}


@pytest.fixture(scope="module")
def results():
    return run_distributed(CASES, target=functools.partial(trainer_rank, run_case=_run_case), timeout_s=300.0)


def _reference(batches) -> tuple[dict, float]:
    """One process, standard BP on the window's whole batches: the summed token loss over the window's targets."""
    from sbpbench.core.labels import shift_labels, sum_cross_entropy

    model = tiny_model("tiny/qwen3", torch.float32)
    targets = [shift_labels(torch.tensor(batch["labels"])) for batch in batches]
    count = sum(int((t != -100).sum()) for t in targets)
    summed = [
        sum_cross_entropy(model(input_ids=torch.tensor(b["input_ids"])).logits, t) for b, t in zip(batches, targets)
    ]
    loss = sum(summed) / count
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, loss.item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft_zero2", "sft_zero3"])
def test_sft_trainer_matches_one_process_bp(results, name):
    """StreamBPSFTTrainer under DeepSpeed Ulysses (2 ranks, ZeRO-2 and 3, accumulation 3): the
    gradients of the optimizer step and the logged loss are one process's on the whole window,
    normalised by its targets (fp32 rounding)."""
    grads, counts = results[name]
    reference, loss = _reference(counts["batches"])
    assert len({len(batch["input_ids"][0]) for batch in counts["batches"]}) == 2, "the window wants two widths"
    assert set(grads) == set(reference)
    for param, expected in reference.items():
        scale = float(expected.abs().max())
        assert scale > 0, f"{param} has no gradient"
        difference = float((grads[param] - expected).abs().max())
        assert difference <= 1e-5 * scale, f"{param}: gradient differs by {difference:.2e} (scale {scale:.2e})"
    assert counts["loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.slow
def test_packing_is_refused(results):
    """Packing under sequence parallelism: refused at construction, in one line saying what to set."""
    error = results["sft_packing_refused"][1]["error"]
    assert "packing=False" in error and "\n" not in error


@pytest.mark.slow
def test_whole_batch_from_the_adapters_halves(results):
    """The halves rebuild the whole row (labels unshifted, -100 first); right padding stays as -100
    labels; left padding and restarting position_ids (packing) are refused in one line."""
    rebuilt = results["whole_batch"][1]
    assert rebuilt["right_padded"] == {"input_ids": [[5, 6, 7, 0]], "labels": [[-100, 6, 7, -100]]}
    assert "pad on the right" in rebuilt["left_padded"] and "\n" not in rebuilt["left_padded"]
    assert "packing=False" in rebuilt["packed"] and "\n" not in rebuilt["packed"]


def _sequence_parallel_stand_in(engine, **attributes):
    """What the trainers' refuse_unsupported reads, two processes under Accelerate's DeepSpeed
    sequence parallelism (ParallelismConfig(sp_backend="deepspeed", sp_size=2)) on `engine`."""
    from types import SimpleNamespace

    from ..exactness.test_trainer_refusals import _stand_in

    config = SimpleNamespace(sp_enabled=True, sp_backend="deepspeed", cp_enabled=False, tp_enabled=False)
    trainer = _stand_in(
        **{"accelerator.num_processes": 2, "accelerator.distributed_type": engine, "accelerator.is_fsdp2": True}
    )
    trainer.accelerator.parallelism_config = config
    for name, value in attributes.items():
        setattr(trainer, name, value)
    return trainer


def test_deepspeed_sequence_parallelism_is_accepted():
    """Accelerate's DeepSpeed sequence parallelism passes the rules; without DeepSpeed it is refused in one line."""
    from accelerate.utils import DistributedType

    from sbpbench.integrations.trainer import StreamBPStep

    StreamBPStep.refuse_unsupported(_sequence_parallel_stand_in(DistributedType.DEEPSPEED, recorded_outputs=()))
    with pytest.raises(ValueError, match="runs under DeepSpeed") as error:
        StreamBPStep.refuse_unsupported(_sequence_parallel_stand_in(DistributedType.FSDP, recorded_outputs=()))
    assert "\n" not in str(error.value)


def test_sft_metrics_warning_and_dpo_grpo_refusals():
    """Under sequence parallelism the SFT trainer warns that TRL's per-token metrics are not logged;
    DPO and GRPO (batches the Ulysses data adapter cannot cut) are refused in one line."""
    from accelerate.utils import DistributedType

    from sbpbench.integrations import StreamBPDPOTrainer, StreamBPGRPOTrainer
    from sbpbench.integrations.trainer import StreamBPStep

    deepspeed = DistributedType.DEEPSPEED
    with pytest.warns(UserWarning, match="per-token metrics"):
        StreamBPStep.refuse_unsupported(_sequence_parallel_stand_in(deepspeed, recorded_outputs=("log_probs",)))
    dpo = _sequence_parallel_stand_in(
        deepspeed, ld_alpha=None, use_weighting=False, f_divergence_type="reverse_kl", aux_loss_enabled=False
    )
    grpo = _sequence_parallel_stand_in(
        deepspeed, loss_type="dapo", top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
    )  # fmt: skip
    for cls, trainer in ((StreamBPDPOTrainer, dpo), (StreamBPGRPOTrainer, grpo)):
        with pytest.raises(ValueError, match="sequence parallelism is not supported") as error:
            cls.refuse_unsupported(trainer)
        assert "\n" not in str(error.value)
