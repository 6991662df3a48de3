"""Every setting a user can give, declared once: the value it takes, its choices, its help, its
flag. Torch-free, so `sbp --help` needs nothing heavy.

The CLI makes its options from this table (cli/options.py, in this order: the point, how it is
measured, the methods' knobs, a search's own), experiment files check their keys against it
(config/experiment.py), and the specs own each default and check (config/run.py RunSpec,
methods/settings.py MethodSettings, config/maxlen.py MaxlenSpec). Adding a setting: its entry
here and its field on the spec that holds it; tests/test_settings.py checks the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from .choices import DTYPE_NAMES, EVERY_METHOD, METHOD_NAMES, OBJECTIVES, PROTOCOLS, SDPA_BACKENDS, STEPS


@dataclass(frozen=True)
class Setting:
    kind: type | tuple[type, ...]  # the value a TOML key or a CLI flag takes (str: parsed by the config)
    help: str  # what it is and its default, as the CLI and error messages say it
    choices: tuple[str, ...] = ()
    may_list: bool = False  # a list is a grid axis (experiment files; the CLI's --method takes several)
    flags: tuple[str, ...] = ()  # CLI spellings kept from before; default: --the-name-with-dashes
    metavar: str = ""  # what the CLI's help shows for the value (default: from kind and choices)
    search: bool = False  # a max-length search's own (MaxlenSpec), not a point's (RunSpec)


SETTINGS: dict[str, Setting] = {
    # the point
    "method": Setting(
        str,
        "Methods, several allowed (default: bp ckpt streambp).",
        (*METHOD_NAMES, EVERY_METHOD),
        may_list=True,
    ),
    "model": Setting(
        str,
        "Registry name (`sbp models`), Hub id ORG/NAME (config from the HF cache) or checkpoint directory "
        "(default: Qwen/Qwen3-4B on cuda, small/qwen3 on cpu).",
        flags=("--model", "-m"),
        metavar="NAME|DIR",
    ),
    "weights": Setting(
        bool,
        "Real weights, from the directory or the HF cache (default: random, seeded).",
    ),
    "seq_len": Setting(
        int, "Tokens per row, prompt included (default: 9000 on cuda, 2048 on cpu).", may_list=True, flags=("--seq", "-T")
    ),
    "batch_size": Setting(
        int, "Rows per batch (default: 1; grpo 8, dpo 2).", may_list=True, flags=("--batch", "-B")
    ),
    "objective": Setting(str, "Training objective (default: sft).", OBJECTIVES),
    "prompt_len": Setting(int, "grpo/dpo: prompt tokens within --seq, at most half of it (default: 1000)."),
    "lora_rank": Setting(int, "LoRA rank (default: 0, full fine-tuning)."),
    "lora_alpha": Setting(int, "LoRA alpha (default: 128)."),
    "step": Setting(str, "bp (default): forward + backward; train: + AdamW.", STEPS),
    "dtype": Setting(str, "Dtype (default: bf16 on cuda, fp32 on cpu).", DTYPE_NAMES),
    "device": Setting(str, "auto (default), cpu, cuda or cuda:N.", metavar="DEVICE"),
    "num_layers": Setting(int, "Keep the first N decoder layers (default: all)."),
    # how it is measured
    "protocol": Setting(
        str, "steady (default): gradients resident before the step; first: allocated in it.", PROTOCOLS
    ),
    "warmup": Setting(int, "Discarded steps before measuring (default: 1; 0 with --repeats 0)."),
    "repeats": Setting(int, "Timed steps; 0: memory only (default: 3)."),
    "memory_limit": Setting(
        (int, str),
        "Memory cap, e.g. 80GiB: CUDA per-process; CPU: tracked tensors (default: none).",
        metavar="SIZE",
    ),
    "timeout_s": Setting((int, float), "Seconds per point (default: from its FLOPs).", flags=("--timeout",)),
    "seed": Setting(int, "Seed for weights and batch (default: 0)."),
    "threads": Setting(
        int, "torch threads per point (default: OMP_NUM_THREADS, else the physical cores)."
    ),
    "nproc": Setting(
        int, "Data-parallel ranks, the model sharded by FSDP2: gloo on cpu, a GPU each on cuda (default: 1)."
    ),
    # one SDPA kernel forced for every method (config/sdpa.py); a wrong name's error lists the choices
    "sdpa_backend": Setting(str, "SDPA kernel for all methods (default: auto).", SDPA_BACKENDS, metavar="KERNEL"),
    # the methods' knobs (a method reads those its registry entry names: methods/registry.py `uses`)
    "chunk_size": Setting((int, str), 'StreamBP chunk: N, "T/k" or auto (default).', metavar="N|T/k|auto"),
    "logits_chunk_size": Setting(
        (int, str), "Positions per logits chunk: streambp, ckpt-chunked-ce, tiled (default: auto).", metavar="N|auto"
    ),
    "checkpoints": Setting(
        str,
        "StreamBP: where layer inputs wait for their backward: gpu (default), cpu, recompute:K, "
        "cpu+recompute:K[+spill].",
        metavar="PLACE",
    ),  # no `choices`: K is open; RunSpec checks the name (core.placement.Placement.parse)
    "fp32_grad_accumulation": Setting(bool, "StreamBP: sum bf16 chunk gradients in fp32 (default: on)."),
    "mlp_tile_size": Setting(int, "tiled: positions per MLP tile (default: 2048)."),
    "offload_checkpoints": Setting(bool, "tiled: layer checkpoints in host memory (default: on)."),
    # a max-length search's own (its first probe is seq_len)
    "seq_len_ceiling": Setting(
        int, "Longest length tried (default: 262144 cuda, 16384 cpu).", flags=("--max-seq",), search=True
    ),
    "resolution": Setting(
        str, "Stop when the bracket is this narrow: 1% of the answer (default) or tokens (256).", search=True
    ),
    "multiple_of": Setting(int, "Probe lengths are multiples of this (default: 8).", search=True),
}

POINT_SETTINGS = tuple(name for name, setting in SETTINGS.items() if not setting.search)  # RunSpec, MethodSettings
SEARCH_SETTINGS = tuple(name for name, setting in SETTINGS.items() if setting.search)  # MaxlenSpec
