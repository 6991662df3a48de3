"""Synthetic batches for the benchmark (no tokenizer, no dataset download)."""

from .sft import SFTBatch, make_sft_batch, pad_lengths

__all__ = ["SFTBatch", "make_sft_batch", "pad_lengths"]
