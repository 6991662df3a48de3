"""Every setting a user can give, described once: the value it takes, its choices, its help.

The CLI makes its options from this table (cli/options.py: the flag is the name with dashes unless
it keeps an older spelling) and experiment files check their keys against it (config/experiment.py),
so adding a setting is a field on RunSpec / MethodSettings / MaxlenSpec plus its entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..data import OBJECTIVES
from ..methods import METHODS, STEPS
from .maxlen import SEARCH_FIELDS as SEARCH_SETTINGS
from .run import DTYPES, FIELD_NAMES, PROTOCOLS
from .sdpa import SDPA_BACKENDS


@dataclass(frozen=True)
class Setting:
    kind: type | tuple[type, ...]  # the value a TOML key or a CLI flag takes (str: parsed by the config)
    help: str  # what it is and its default, as the CLI and error messages say it
    choices: tuple[str, ...] = ()
    may_list: bool = False  # a list is a grid axis (experiment files; the CLI's --method takes several)


SETTINGS: dict[str, Setting] = {
    "model": Setting(
        str,
        "Registry name (`sbp models`), any Hub id ORG/NAME (its config.json from the HF cache) or a local checkpoint "
        "directory (default: Qwen/Qwen3-4B on cuda, small/qwen3 on cpu).",
    ),
    "weights": Setting(
        bool,
        "Real weights, from the local checkpoint directory or the HF cache (default: random, seeded: memory and "
        "time do not depend on them).",
    ),
    "method": Setting(
        str,
        "Methods; several allowed; all: every one (default: bp, ckpt, streambp).",
        (*METHODS, "all"),
        may_list=True,
    ),
    "seq_len": Setting(int, "Tokens per row, prompt included (default: 9000 on cuda, 2048 on cpu).", may_list=True),
    "batch_size": Setting(int, "Rows per batch (default: sft 1, grpo 8 = a group, dpo 2 = a pair).", may_list=True),
    "objective": Setting(str, "Training objective (default: sft).", OBJECTIVES),
    "prompt_len": Setting(int, "grpo/dpo: prompt tokens within --seq, at most half of it (default: 1000)."),
    "lora_rank": Setting(int, "LoRA rank on all linear layers (peft); 0: full fine-tuning (default)."),
    "lora_alpha": Setting(int, "LoRA alpha (default: 128)."),
    "step": Setting(
        str, "bp: forward + backward (the paper's Figure 3, default); train: + AdamW (its Table 3).", STEPS
    ),
    "dtype": Setting(str, "Model dtype (default: bf16 on cuda, fp32 on cpu).", tuple(DTYPES)),
    "device": Setting(str, "auto (default), cpu, cuda or cuda:N."),
    "num_layers": Setting(int, "Keep only the first N decoder layers (default: all)."),
    "protocol": Setting(
        str,
        "steady (default): gradient buffers resident before the step (the paper's); first: allocated in it.",
        PROTOCOLS,
    ),
    "warmup": Setting(int, "Discarded steps before measuring (default: 1; 0 with --repeats 0)."),
    "repeats": Setting(int, "Timed steps (median, min, max); 0: memory only (default: 3)."),
    "memory_limit": Setting(
        (int, str), "Cap memory, e.g. 80GiB: CUDA per-process limit; CPU limit on tracked tensors (default: none)."
    ),
    "seed": Setting(int, "Seed for weights and batch (default: 0)."),
    "threads": Setting(
        int,
        "CPU threads for torch's intra-op work in each point (default: OMP_NUM_THREADS if set, else the physical cores this process may use).",
    ),
    "nproc": Setting(
        int,
        "Data-parallel processes for the step, the model sharded with FSDP2 (FULL_SHARD): gloo on cpu, one GPU "
        "per rank on cuda; bp, ckpt and streambp (default: 1).",
    ),
    "timeout_s": Setting(
        (int, float),
        "Seconds per point before it is recorded as timeout (default: predicted from the point's FLOPs, at least 600).",
    ),
    "chunk_size": Setting(
        (int, str),
        'StreamBP positions per layer chunk: tokens, "T/k" for T/k, or auto (default: chosen from T, the model '
        "and the memory limit; core/README.md).",
    ),
    "logits_chunk_size": Setting(
        (int, str), "StreamBP, ckpt-chunked-ce, tiled: positions per logits chunk, or auto (default: auto)."
    ),
    "fp32_grad_accumulation": Setting(bool, "StreamBP: sum bf16 chunk gradients in fp32 (default: on)."),
    "mlp_tile_size": Setting(int, "tiled (ALST): positions per MLP tile (default: 2048)."),
    "offload_checkpoints": Setting(bool, "tiled (ALST): layer checkpoints in host memory (default: on)."),
    "checkpoints": Setting(
        str,
        "StreamBP: where the layer inputs live until their backward: gpu (default), cpu (pinned host memory, "
        "prefetched a layer ahead), recompute:K (keep every K-th, rebuild the rest), cpu+recompute:K, or "
        "cpu+recompute:K+spill (rebuilt inputs to the host too: two layer inputs on the GPU at most).",
    ),  # no `choices`: K is open; RunSpec checks the name (core.placement.Placement.parse)
    "sdpa_backend": Setting(
        str,
        "Force one scaled-dot-product-attention kernel for every method (default: auto, torch's choice per call); "
        "cpu has flash and math.",
        SDPA_BACKENDS,
    ),
    # a max-length search's own settings (MaxlenSpec); its first probe is seq_len
    "seq_len_ceiling": Setting(int, "Longest length a search tries (default: 262144 cuda, 16384 cpu)."),
    "resolution": Setting(
        str, "Stop a search when the bracket is this narrow: 1% of the answer (default) or tokens (256)."
    ),
    "multiple_of": Setting(int, "Probe lengths are multiples of this (default: 8)."),
}
assert set(SETTINGS) == {*FIELD_NAMES, *SEARCH_SETTINGS}, (
    "every RunSpec / MethodSettings / MaxlenSpec field has its entry"
)
