"""A spec's model and batch: random weights (seeded) or the real ones, truncated depth, LoRA
adapters, the objective's synthetic batch. Shared by the measured worker, `sbp check` and the estimator."""

from __future__ import annotations

from ..config.run import DTYPES, RunSpec
from ..methods.step import TrainingStep


def build_model_and_batch(
    spec: RunSpec,
    *,
    lora_alpha: int | None = None,
    lora_init_seed: int | None = None,
    device: str | None = None,
    batch_seed: int | None = None,
):
    """The model and its batch on spec.device (or `device`: a rank's own GPU). lora_alpha
    overrides spec.lora_alpha; lora_init_seed gives LoRA's B matrices seeded non-zero values
    (gradients everywhere); batch_seed overrides spec.seed for the batch only (a rank's own batch)."""
    from ..models import build_model

    device = device or spec.device
    overrides = {"num_hidden_layers": spec.num_layers} if spec.num_layers else {}
    dtype = DTYPES[spec.dtype]
    model = build_model(spec.model, dtype=dtype, device=device, seed=spec.seed, weights=spec.weights, **overrides)
    if spec.lora_rank:
        from ..models.lora import apply_lora

        alpha = spec.lora_alpha if lora_alpha is None else lora_alpha
        model = apply_lora(model, rank=spec.lora_rank, alpha=alpha, init_nonzero_seed=lora_init_seed)
    return model, make_spec_batch(spec, model.config, device=device, seed=batch_seed)


def make_spec_batch(spec: RunSpec, config, *, device: str = "cpu", seed: int | None = None):
    """The objective's synthetic batch for a model of this config (seed: spec.seed unless given).
    Real tensors: the simulated step builds the same batch."""
    from ..data import make_batch

    return make_batch(
        spec.objective,
        batch_size=spec.batch_size,
        seq_len=spec.seq_len,
        vocab_size=config.vocab_size,
        prompt_len=spec.prompt_len,
        seed=spec.seed if seed is None else seed,
        pad_token_id=config.pad_token_id or 0,
        device=device,
    )


def training_step(spec: RunSpec, model, batch, **options) -> TrainingStep:
    """The spec's step over a model and batch already built (options: TrainingStep's)."""
    return TrainingStep(
        model,
        batch,
        method=spec.method,
        settings=spec.settings,
        step=spec.step,
        protocol=spec.protocol,
        **options,
    )
