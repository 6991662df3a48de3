"""Synthetic batches for the benchmark (no tokenizer, no dataset download)."""

from ..settings import OBJECTIVES
from .preference import DEFAULT_PROMPT_LEN, DPOBatch, GRPOBatch, make_dpo_batch, make_grpo_batch, prompt_length
from .sft import SFTBatch, make_sft_batch, pad_lengths

# Every batch has input_ids, attention_mask, labels (B, T), num_tokens, .to(device) and
# .objective() (the core objective its tensors define).
Batch = SFTBatch | GRPOBatch | DPOBatch

__all__ = [
    "DEFAULT_PROMPT_LEN",
    "OBJECTIVES",
    "Batch",
    "DPOBatch",
    "GRPOBatch",
    "SFTBatch",
    "make_batch",
    "make_dpo_batch",
    "make_grpo_batch",
    "make_sft_batch",
    "pad_lengths",
    "prompt_length",
]


def make_batch(
    objective: str,
    *,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    seed: int = 0,
    pad_token_id: int = 0,
    device="cpu",
) -> Batch:
    """The synthetic batch of an objective: batch_size rows (a GRPO group; DPO chosen + rejected
    rows) of seq_len tokens; prompt_len applies to GRPO and DPO."""
    if objective == "sft":
        return make_sft_batch(
            batch_size=batch_size,
            seq_len=seq_len,
            vocab_size=vocab_size,
            seed=seed,
            pad_token_id=pad_token_id,
            device=device,
        )
    if objective == "grpo":
        return make_grpo_batch(
            group_size=batch_size,
            seq_len=seq_len,
            vocab_size=vocab_size,
            prompt_len=prompt_len,
            seed=seed,
            device=device,
        )
    if objective == "dpo":
        return make_dpo_batch(
            batch_size=batch_size,
            seq_len=seq_len,
            vocab_size=vocab_size,
            prompt_len=prompt_len,
            seed=seed,
            device=device,
        )
    raise ValueError(f"unknown objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
