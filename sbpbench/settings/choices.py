"""The names a choice setting takes, as plain strings: the CLI lists them without importing the
torch code behind them. The registries import them from here (data: OBJECTIVES, methods: STEPS,
config: PROTOCOLS); the method registry and the dtype table keep their own keys, and
tests/unit/test_settings.py checks that those equal METHOD_NAMES and DTYPE_NAMES."""

from __future__ import annotations

# sbpbench/methods/registry.py METHODS, in its order: the paper's three, then the peers
METHOD_NAMES = (
    "bp",
    "ckpt",
    "streambp",
    "ckpt-offload",
    "ckpt-chunked-ce",
    "tiled",
    "ulysses",
    "liger",
    "trl-default",
    "official",
)
EVERY_METHOD = "all"  # stands for every registered method
OBJECTIVES = ("sft", "grpo", "dpo")
STEPS = ("bp", "train")  # bp: forward + backward; train: + AdamW (methods/training.py)
DTYPE_NAMES = ("fp64", "fp32", "bf16")  # config/run.py DTYPES maps them to torch dtypes
# steady: gradient buffers are resident before the step, as in every training step after the
#         first (the paper's Figure 3 curves); the peak above them is activations.
# first:  gradients are None before the step and allocated during it (a run's first step).
PROTOCOLS = ("steady", "first")
# `--sdpa-backend` (config/sdpa.py): auto leaves the kernel to torch's dispatcher, per call. A CPU
# build dispatches to its flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) or the math
# path; the efficient and cuDNN kernels exist only on CUDA.
SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
CPU_SDPA_BACKENDS = ("auto", "flash", "math")
# `--set chunk_attention=` (core/kernels/kernel_choice.py CHUNK_ATTENTION_CHOICES, which a test checks equal):
# the kernel of a StreamBP chunk's attention over its prefix. auto: lower-right, or in `sbp run`'s
# warm-up and timed steps what this GPU's table of measured kernels names (runner/kernel_table.py);
# lower-right: SDPA with a lower-right causal bias (FlashAttention-2 on a GPU); split:
# prefix + diagonal block on cuDNN, merged by log-sum-exp; flex: FlexAttention; fa3 / fa4:
# FlashAttention-3 / -4 where installed. Off a GPU only auto, lower-right and split run.
CHUNK_ATTENTION = ("auto", "lower-right", "split", "flex", "fa3", "fa4")
CPU_CHUNK_ATTENTION = ("auto", "lower-right", "split")
# `--set sp_layout=` (core/parallel/sequence_group.py LAYOUTS, which a test checks equal): how ranks
# sharing a sequence hold it. contiguous: rank r the r-th T/P positions (Ulysses' data adapter);
# interleaved: each chunk step's P chunks one per rank (FPDT), one attention call per step.
SP_LAYOUTS = ("contiguous", "interleaved")
