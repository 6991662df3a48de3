"""StreamBPTrainer: transformers' `Trainer` with the forward + backward of its training step done by
`stream_backward`, and `StreamBPStep`, the training step the TRL trainers share.

`Trainer.training_step` (transformers 5.24) prepares the batch, computes the loss with the model's
full (B, T, V) logits, scales it for gradient accumulation and calls `accelerator.backward`.
`StreamBPStep.training_step` does the same with `stream_backward` on the same batch: the objective
carries the stock scaling (the summed loss over `num_items_in_batch`, the target tokens of the whole
accumulation window, or a per-batch mean over the accumulation steps; times the number of processes
under `average_tokens_across_devices`, as the stock loss is), so loss and gradients equal the stock
step's to rounding. StreamBPStep sits just above `Trainer` in each trainer's MRO
(`class StreamBPSFTTrainer(StreamBPInit, SFTTrainer, StreamBPStep)`): TRL's own `training_step`
wrappers (GRPO's `_step` counter and step timing) still run and call this step in place of Trainer's.

Each logged loss comes with what ran (`streambp/...` keys in the trainer's log: chunk sizes, placement,
the chunk attention kernel, the peak memory of the steps since the last log), so a user sees StreamBP
engaged in their logs. The keys are flat scalars and strings, which every logging integration takes.

Under DeepSpeed the step takes Accelerate's engine, as `accelerator.backward` does (the accumulation
boundary set, `engine.step()` at it, gradients not divided again by the accumulation steps); under
FSDP2 the model Accelerate prepared. Under Accelerate's DeepSpeed sequence parallelism
(`ParallelismConfig(sp_backend="deepspeed", sp_size=P)`) each rank's slices are gathered back into
the group's whole batch and streamed with `sequence_parallel=SequenceParallel.from_deepspeed()`
(sequence_parallel.py). What the core cannot do is refused at construction (`refuse_unsupported`),
one line each, with what to do instead.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from accelerate.utils import DistributedType
from accelerate.utils.memory import clear_device_cache
from transformers import Trainer
from transformers.training_args import OptimizerNames

from ..core import SFT, Objective, SequenceParallel, StepHooks, StreamConfig, check_model, stream_backward
from .sequence_parallel import SHARDED_KEYS, count_targets, deepspeed_sequence_parallel, whole_batch
from .token_outputs import TokenRecorder

# What a batch of a causal-LM trainer may hold: the inputs StreamBP reads, and the FlashAttention
# varlen keys of padding-free collators (the same documents as position_ids, which StreamBP reads).
STREAMED_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class StreamedBatch(NamedTuple):
    """What one training step streams: input_ids (B, T), the objective (its labels, loss options
    and stock scaling), attention_mask and position_ids as stream_backward takes them."""

    input_ids: torch.Tensor
    objective: Objective
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None


def streambp_config(streambp: StreamConfig | None) -> StreamConfig:
    if streambp is None:
        return StreamConfig()
    if not isinstance(streambp, StreamConfig):
        raise TypeError(f"streambp must be a sbpbench.core.StreamConfig, got {type(streambp).__name__}")
    return streambp


class StreamBPStep(Trainer):
    """The training step of every StreamBP trainer (module docstring). Subclasses give
    `streamed_batch` (the batch and objective the stock loss would see) and, for TRL's metrics,
    `recorded_outputs` (the fused-head fields its loss code reads) and `log_streamed`."""

    streambp: StreamConfig
    recorded_outputs: tuple[str, ...] = ()  # TRL fused-head fields to record from the streamed head

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Trainer.training_step with the forward + backward done by stream_backward; returns the
        detached loss, scaled as the stock step returns it."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        group = self.sequence_parallel()
        if group is not None:  # this rank's slices -> the group's whole batch (sequence_parallel.py)
            check_batch_keys(inputs, SHARDED_KEYS)
            inputs = whole_batch(inputs, group)
        batch = self.streamed_batch(inputs, num_items_in_batch)
        # TRL's metrics are recorded per position of the whole batch; the core cuts the objective to
        # this rank's positions, which a recorder is not made for: no metrics under sequence parallelism
        recording = self.recorded_outputs and group is None
        recorder = TokenRecorder(batch.objective, self.recorded_outputs) if recording else None
        with self.compute_loss_context_manager():
            loss = self._stream(model, batch, recorder or batch.objective)
        if recorder is not None:
            self.log_streamed(inputs, num_items_in_batch, recorder.outputs())
        del inputs
        steps = self.args.torch_empty_cache_steps
        if steps is not None and self.state.global_step % steps == 0:
            clear_device_cache()
        return loss

    def _stream(self, model: torch.nn.Module, batch: StreamedBatch, objective) -> torch.Tensor:
        """stream_backward in place of `accelerator.backward(loss)`: under DeepSpeed on the engine, with
        the boundary and step of Accelerate's DeepSpeedEngineWrapper.backward and, as the Trainer asks
        it (scale_wrt_gas=False), no second division by the accumulation steps."""
        engine = None
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            engine = self.accelerator.deepspeed_engine_wrapped.engine
            engine.set_gradient_accumulation_boundary(is_boundary=self.accelerator.sync_gradients)
        config = self.streambp
        device = batch.input_ids.device
        if device.type == "cuda" and self.args.skip_memory_metrics:  # else the Trainer's own tracker owns the peak
            torch.cuda.reset_peak_memory_stats(device)
        kernels: set[str] = set()
        with self.accelerator.autocast():  # as Accelerate's forward
            loss = stream_backward(
                engine if engine is not None else model,
                batch.input_ids,
                objective=objective,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                config=config,
                hooks=StepHooks(on_kernel=kernels.add),
                scale_wrt_gas=False,
                sequence_parallel=self.sequence_parallel(),
            )
        if engine is not None and self.accelerator.sync_gradients:
            engine.step()
        self._note_what_ran(device, kernels)
        return loss

    def sequence_parallel(self) -> SequenceParallel | None:
        """DeepSpeed's sequence-parallel group under Accelerate's DeepSpeed sequence parallelism, else
        None. Read at the first step: Accelerate makes the group when it prepares the engine."""
        if not deepspeed_sequence_parallel(self.accelerator):
            return None
        if getattr(self, "_streambp_group", None) is None:
            self._streambp_group = SequenceParallel.from_deepspeed()
        return self._streambp_group

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The stock accumulation window; under sequence parallelism with num_items_in_batch counted
        from its shift labels (sequence_parallel.py), where the Trainer counts none."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        group = self.sequence_parallel()
        if group is not None:
            every_process = self.args.average_tokens_across_devices
            num_items_in_batch = count_targets(batch_samples, group, every_process, device)
        return batch_samples, num_items_in_batch

    def _note_what_ran(self, device: torch.device, kernels: set[str]) -> None:
        """What the step ran, for the next log (`log`): the peak is the highest since the last log."""
        config, ran = self.streambp, getattr(self, "_streambp_ran", None) or {}
        if device.type == "cuda":
            peak = ("streambp/peak_allocated_gib", torch.cuda.max_memory_allocated(device) / 2**30)
        else:  # the process's peak resident set (getrusage: kB on Linux, bytes on macOS)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
            peak = ("streambp/peak_rss_gib", rss / 2**30)
        self._streambp_ran = {
            "streambp/chunk_size": config.chunk_size,
            "streambp/logits_chunk_size": config.logits_chunk_size,
            "streambp/checkpoints": config.checkpoints.name,
            "streambp/chunk_attention": "+".join(sorted(kernels)) or ran.get("streambp/chunk_attention", ""),
            peak[0]: round(max(peak[1], ran.get(peak[0], 0.0)), 3),
        }

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The stock log, and with a training loss what the StreamBP steps since the last log ran."""
        ran = getattr(self, "_streambp_ran", None)
        if ran and "loss" in logs:
            logs.update(ran)
            self._streambp_ran = None
        super().log(logs, start_time)

    def streamed_batch(self, inputs: Mapping[str, Any], num_items_in_batch) -> StreamedBatch:
        """A causal-LM batch (Trainer, SFTTrainer): the SFT objective on its labels, normalised as
        the stock loss is (module docstring)."""
        if "labels" not in inputs:
            raise ValueError(
                f"{type(self).__name__} trains on the batch's labels (the causal-LM loss); this batch has none: "
                "use a data collator that sets labels (DataCollatorForLanguageModeling, DataCollatorWithFlattening)"
            )
        check_batch_keys(inputs, STREAMED_KEYS + VARLEN_KEYS)
        objective = SFT(
            inputs["labels"],
            num_items_in_batch=self._items_per_process(num_items_in_batch),
            gradient_accumulation_steps=self.accumulation_divisor(num_items_in_batch),
        )
        return StreamedBatch(inputs["input_ids"], objective, inputs.get("attention_mask"), inputs.get("position_ids"))

    def accumulation_divisor(self, num_items_in_batch) -> int:
        """Trainer.training_step's rule: 1 where the loss is already scaled for gradient accumulation
        (normalised by num_items_in_batch), else the accumulation steps it divides a per-batch mean by.
        Under sequence parallelism num_items_in_batch is ours (get_batch_samples): 1 where it is given."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # transformers >= 5.19; TRL sets it per trainer
        if self.sequence_parallel() is not None:
            scaled = num_items_in_batch is not None
        if scaled is None:
            scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        return 1 if scaled else self.current_gradient_accumulation_steps

    def _items_per_process(self, num_items_in_batch):
        """num_items_in_batch counts the target tokens of every process; with
        average_tokens_across_devices the stock loss is multiplied by the number of processes
        (data-parallel engines average gradients), here folded into the count. Under sequence
        parallelism by the number of sequence groups: the core undoes the average over a group."""
        if num_items_in_batch is None or not self.args.average_tokens_across_devices:
            return num_items_in_batch
        group = self.sequence_parallel()
        if group is None:
            return num_items_in_batch / self.accelerator.num_processes
        return num_items_in_batch / (torch.distributed.get_world_size() // group.world)

    def log_streamed(self, inputs: Mapping[str, Any], num_items_in_batch, outputs) -> None:
        """Run the stock trainer's metric code on the recorded per-token outputs (TRL trainers)."""

    def refuse_unsupported(self) -> None:
        """Raise ValueError (one line, what to do instead) for what StreamBP cannot run exactly;
        warn about settings it makes pointless. Subclasses add their trainer's options."""
        args, accelerator = self.args, self.accelerator
        refusals = {
            "nn.DataParallel (several GPUs in one process) replicates the model's forward, which StreamBP does not "
            "call: launch one process per GPU with accelerate launch or torchrun": args.n_gpu > 1,
            "DDP's gradient reducer expects one backward per step, StreamBP's chunks accumulate many: use FSDP2 "
            "(fsdp_version: 2) or DeepSpeed ZeRO through Accelerate": accelerator.num_processes > 1
            and accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED),
            "FSDP1 is not supported: set fsdp_version: 2 in the FSDP config": accelerator.distributed_type
            == DistributedType.FSDP
            and not accelerator.is_fsdp2,
            "fp16 loss scaling is not supported: train in bf16 (bf16=True) or fp32": args.fp16
            or accelerator.mixed_precision == "fp16",
            "context or tensor parallelism splits what one StreamBP chunk needs across ranks: use data "
            "parallelism (FSDP2, DeepSpeed ZeRO), sequence parallelism (sp_backend='deepspeed') and StreamBP's "
            "own chunking for long sequences": _splits_model(accelerator),
            "sequence parallelism runs under DeepSpeed: give TrainingArguments a DeepSpeed config (deepspeed=...) "
            "with parallelism_config's sp_size": deepspeed_sequence_parallel(accelerator)
            and accelerator.distributed_type != DistributedType.DEEPSPEED,
            "torch_compile compiles the model's whole forward, which StreamBP does not run: set torch_compile=False": (
                args.torch_compile
            ),
            "LOMO optimizers update parameters inside the backward: choose another optim": args.optim
            in (OptimizerNames.LOMO, OptimizerNames.ADALOMO),
            "compute_loss_func needs the full logits, which StreamBP never builds: drop it (the causal-LM loss "
            "is built in)": callable(self.compute_loss_func),
            "label smoothing is not supported: set label_smoothing_factor=0": self.label_smoother is not None,
            "activation_offloading offloads saved activations, which StreamBP does not keep: set "
            "activation_offloading=False, and StreamConfig(checkpoints='cpu') to keep its checkpoints on "
            "the host": bool(getattr(args, "activation_offloading", False)),
        }
        refuse(self, refusals)
        check_model(self.model)  # a model StreamBP cannot stream raises here, before training
        if deepspeed_sequence_parallel(accelerator) and self.recorded_outputs:
            warnings.warn(
                f"{type(self).__name__}: under sequence parallelism the loss is logged, the trainer's per-token "
                "metrics (entropy, token accuracy, token count) are not",
                UserWarning,
                stacklevel=3,
            )
        if getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False):
            warnings.warn(
                f"{type(self).__name__}: gradient checkpointing has no effect on the StreamBP step (it keeps its "
                "own checkpoints and turns the layers' checkpointing off while it runs); set "
                f"{checkpointing_option(args)}=False",
                UserWarning,
                stacklevel=3,
            )


def checkpointing_option(args) -> str:
    """The installed transformers' name of the option: activation_checkpointing where it has it (the
    newer name; gradient_checkpointing is its deprecated alias there), else gradient_checkpointing."""
    names = {f.name for f in dataclasses.fields(args)} if dataclasses.is_dataclass(args) else set(vars(args))
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def refuse(trainer, refusals: dict[str, bool]) -> None:
    """Raise ValueError with the first message whose condition holds, naming the trainer."""
    for message, refused in refusals.items():
        if refused:
            raise ValueError(f"{type(trainer).__name__}: {message}")


def _splits_model(accelerator) -> bool:
    """Context or tensor parallelism, or sequence parallelism other than DeepSpeed's (Ulysses)."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None:
        return False
    other_sp = getattr(config, "sp_enabled", False) and not deepspeed_sequence_parallel(accelerator)
    return other_sp or any(getattr(config, name, False) for name in ("cp_enabled", "tp_enabled"))


def check_batch_keys(inputs: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    """Refuse a batch with inputs StreamBP would silently drop (images, token types, ...)."""
    extra = sorted(set(inputs) - set(allowed))
    if extra:
        raise ValueError(
            f"StreamBP streams text batches; this batch also has {', '.join(extra)} (multimodal or "
            "model-specific inputs), which it cannot pass to the decoder layers"
        )


class StreamBPInit:
    """First in each StreamBP trainer's bases: takes the `streambp=` keyword (a StreamConfig; None:
    the defaults), builds the stock trainer with the other arguments, then refuses what StreamBP
    cannot run (the trainer's `refuse_unsupported`)."""

    def __init__(self, *args, streambp: StreamConfig | None = None, **kwargs):
        self.streambp = streambp_config(streambp)
        super().__init__(*args, **kwargs)
        self.refuse_unsupported()


class StreamBPTrainer(StreamBPInit, StreamBPStep):
    """transformers' Trainer, each training step's forward + backward by StreamBP (exact: the stock
    step's loss and gradients to rounding). streambp: StreamBP's knobs, a sbpbench.core.StreamConfig."""
