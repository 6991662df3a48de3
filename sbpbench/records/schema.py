"""The results schema: one dataclass whose fields, in order, are the CSV columns.

The method settings' columns are made from the settings table's method knobs (sbpbench/settings),
in its order: a knob declared there is a column here.

Raw units live in the column names (`*_bytes`, `*_s`); GiB exist only on screen. Every row
carries its provenance (when, where, which versions and commit, every setting that changes the
number), so a CSV row read alone says how it was measured. A row is keyed by the settings that
define the measured point (KEY_COLUMNS): a rerun of the same point on the same device replaces
its row, and a sweep can skip it.

Schema history (bump SCHEMA_VERSION when columns change; older rows keep their own value and
read back with the new columns empty):
  1  first version: SFT forward+backward points.
  2  objective, step, lora_rank, lora_alpha, prompt_len, trainable_params, optimizer_state_bytes
     (GRPO/DPO, LoRA, the training step); version-1 rows read back as sft, full, step bp.
  3  kind (point | maxlen) and source (measured | simulated), the max-length search columns
     (max_seq_len, oom_seq_len, search_resolution, num_probes), an estimate's peak_phase,
     margin_bytes and attention_kernel, and status skipped; older rows read back as measured points.
  4  the method settings (chunk_size, logits_chunk_size, fp32_grad_accumulation) are empty for a
     method that does not read them (bp, ckpt), so they are not part of its key; older rows of
     those methods read back with them emptied (two such rows differing only there become one
     point: the later one is kept).
  5  num_threads (torch intra-op threads of the worker) and load_avg_1m (the machine's 1-minute load
     average as the point started): what a CPU time depends on besides the point. Not key columns
     (a rerun with another thread count replaces the row). Older rows read back with them empty
     (not recorded). Also mlp_tile_size and offload_checkpoints (the `tiled` peer's settings; empty
     for every other method, so older rows read back unchanged) and status unsupported. Also
     checkpoints (the StreamBP checkpoint placement: gpu | cpu | recompute:K | cpu+recompute:K, a
     method setting and part of the key), host_pinned_peak_bytes and transfer_bytes (host copies of
     the checkpoints and the bytes moved between host and device); older streambp rows read back
     with checkpoints gpu, the only placement they had.
  6  nproc (data-parallel ranks, the model sharded with FSDP2; part of the key) and rank_peak_bytes
     (each rank's peak_allocated_bytes, ';'-joined in rank order; the memory columns of a several-rank
     row are the max over ranks, its times the max over ranks of each step's time). Older rows read
     back with nproc 1 (one process, the only way they ran) and rank_peak_bytes empty.
  7  host_register_s: seconds the point's first step spent allocating and page-locking host buffers
     for offloaded checkpoints (CUDA; core/host_pool.py). The worker keeps the buffers for its later
     steps, so the time columns (never the first step) exclude it. Older rows read back with it
     empty (not recorded; their steps registered anew every step).
  8  weights (real | random: a checkpoint's weights, or seeded random ones). Not a key column: memory
     and time do not depend on weight values. Older rows read back with it empty (not recorded).
  9  sdpa_backend (the SDPA kernel forced on the point, `--sdpa-backend`, or auto; part of the key;
     older rows read back as auto, the only way they ran), memory_limit_effective_bytes (the cap that
     applied: memory_limit_bytes, or the device's capacity where the limit was above it), timeout_s
     (the timeout the point ran under, given or predicted), auto_settings (the chunk settings the
     point's rule chose, methods/chunk_sizes.py), cuda_alloc_conf (the worker's CUDA allocator
     setting); attention_kernel is now also filled on measured rows (the SDPA kernels that ran).
     Older rows read back with these empty (not recorded).
  10 phase_*_s (streambp): seconds of each phase of the timed step whose time is the median, summed
     over layers (core/phases.py: checkpoint pass, head, K/V capture, chunk forward, chunk backward,
     rebuild, host copies, copy waits, and the rest, other); CUDA events on a GPU, wall time on a CPU.
     Not key columns. Older rows read back with them empty (not recorded).
  11 chunk_attention (StreamBP's kernel for a chunk's attention over its prefix: auto | lower-right |
     split | flex | fa3 | fa4, a method setting and part of the key); attention_kernel now also names
     the chunk kernels that ran besides SDPA's (e.g. cudnn+split). Older streambp rows read back with
     chunk_attention lower-right, the only kernel they had.
  12 seed_seq_len (the predicted max T a max-length search started from) and search_probes (every
     answer the search used, in order: "61440:ok 62464:oom", "(cached)" after one it did not run).
     Older maxlen rows read back with both empty (blind searches, probes not recorded).
  13 timeline_file: the measured step's memory timeline (`sbp run --timeline`: a JSON file, its
     prediction and on a GPU PyTorch's raw memory snapshot beside it), relative to the CSV's
     directory (runner/timelines.py). Not a key column. Older rows read back with it empty (none).
  14 trace_file: a PyTorch profiler trace of one step run after the timed steps (`sbp run --trace`:
     Chrome/Perfetto JSON, one folder per point for HTA), relative to the CSV's directory
     (runner/traces.py). Not a key column. Older rows read back with it empty (none).
     tuning_s: seconds of the untimed pass, between the memory step and the timed steps, that ran the
     chunk kernels a table of measured ones picked once per call shape (cuDNN graphs, compiles);
     timed_attention_kernel: the chunk kernels the timed steps ran (lower-right | split | flex | fa3 |
     fa4, '+'-joined); attention_kernel stays the memory step's, whose auto is the lower-right path
     (the kernel the estimator models). Not key columns. Older rows read back with them empty (their
     timed steps may have measured kernels inside them).
     kind seed (no new column): a max-length search's predicted max T stored before its probes run
     (runner/seeds.py; source simulated, seed_seq_len the seed, memory_limit_bytes the memory it was
     predicted for); a sweep's input, never a result: plots and the report read RESULT_KINDS only.
  15 sp (ranks sharing each sequence, Ulysses: nproc / sp data ranks of sp ranks each; part of the
     key) and num_cpus (the logical CPUs the point's processes could run on: nproc x num_threads
     above it means oversubscribed cores, whose times are slowed while the tracked memory is exact).
     Not a key column. Older rows read back with sp 1 (every rank held whole sequences, the only way
     they ran) and num_cpus empty (not recorded).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any

from ..settings import METHOD_KNOBS, SETTINGS

SCHEMA_VERSION = 15

# skipped: not run because a point of the same settings with no longer sequence and no larger batch
# already ran out of memory (certain OOM: plots and reports draw it as an OOM) or timed out (certain
# timeout: drawn as nothing, it says nothing about memory); its error starts with SKIPPED_OOM or
# SKIPPED_TIMEOUT. A resumed sweep does not retry it.
# unsupported: the method cannot run this point here (its library or hardware is missing, or it
# does not implement the objective: methods.MethodUnsupported); the error says why. Not retried.
STATUSES = ("ok", "oom", "error", "timeout", "skipped", "unsupported")
SKIPPED_OOM, SKIPPED_TIMEOUT = "certain OOM", "certain timeout"
# one step at one seq_len | the answer of a max-length search | a search's predicted max T (its seed)
KINDS = ("point", "maxlen", "seed")
RESULT_KINDS = ("point", "maxlen")  # what plots and the report read: a seed is a sweep's input
# measured: a real step on a real device; simulated: the same code under fake tensors (an estimate
# of a GPU that may not be here). No plot or report may mix the two without saying so.
SOURCES = ("measured", "simulated")


@dataclass(kw_only=True)
class _PointColumns:
    """A row's columns up to the method settings."""

    schema_version: int = SCHEMA_VERSION
    timestamp_utc: str = ""  # ISO 8601, when the point finished
    status: str = ""  # ok | oom | error | timeout | skipped | unsupported
    error: str = ""  # one line, for oom / error / timeout / skipped
    kind: str = "point"  # point | maxlen | seed
    source: str = "measured"  # measured | simulated
    # the measured point
    model: str = ""
    num_layers: int | None = None  # decoder layers actually built (a truncated model says so)
    num_params: int | None = None
    trainable_params: int | None = None
    method: str = ""
    objective: str = ""  # sft | grpo | dpo
    step: str = ""  # bp (forward + backward) | train (+ AdamW step)
    lora_rank: int | None = None  # 0: full fine-tuning
    lora_alpha: int | None = None
    prompt_len: int | None = None  # grpo / dpo: prompt tokens within seq_len (labels -100)
    seq_len: int | None = None  # tokens per row, prompt included (empty in a maxlen row)
    batch_size: int | None = None
    dtype: str = ""
    device: str = ""  # cpu | cuda | cuda:N (several ranks: rank 0's; rank r runs on cuda:N+r)
    nproc: int | None = None  # data-parallel ranks (FSDP2 FULL_SHARD); 1: one process
    sp: int | None = None  # of the nproc ranks, how many share each sequence (Ulysses); 1: whole sequences
    protocol: str = ""  # steady (gradient buffers resident before the step) | first (allocated in it)


def _knob_column(name: str) -> tuple[str, str, Any]:
    """A method knob's column: the first kind its setting takes, empty (None) where the method does
    not read it; a text one ("" where not read: a placement's or a kernel's name)."""
    kind = SETTINGS[name].kind
    first = (kind if isinstance(kind, tuple) else (kind,))[0]
    return (name, "str", field(default="")) if first is str else (name, f"{first.__name__} | None", field(default=None))


# the method settings: the settings table's method knobs, in its order, each empty in a row whose
# method does not read it (schema 4); a chunk's "auto" as the number chosen
_MethodSettingColumns = make_dataclass(
    "_MethodSettingColumns",
    [_knob_column(name) for name in METHOD_KNOBS],
    bases=(_PointColumns,),
    kw_only=True,
    namespace={"__module__": __name__},  # make_dataclass's `module` is Python 3.12's
)


@dataclass(kw_only=True)
class ResultRow(_MethodSettingColumns):
    """One CSV row: its fields, in order, are the columns (the point's, the method settings', then these)."""

    auto_settings: str = ""  # the chunk settings chosen by the point's rule ("chunk_size;logits_chunk_size")
    attn_implementation: str = ""
    sdpa_backend: str = ""  # the SDPA kernel forced for the point (flash | efficient | cudnn | math) or auto
    # the SDPA kernels that ran ('+'-joined): measured, seen in the memory step; simulated, modelled on CUDA
    attention_kernel: str = ""  # flash | efficient | cudnn | math, and StreamBP's split | flex | fa3 | fa4
    timed_attention_kernel: str = ""  # StreamBP's chunk kernels in the timed steps (lower-right | split | ...)
    tuning_s: float | None = None  # the untimed pass building the chunk kernels a table picked
    memory_limit_bytes: int | None = None  # cap asked for (None: the device's own)
    # the cap that applied: memory_limit_bytes, or where that was above the device's capacity the
    # capacity (a GPU's total memory; on the CPU the machine's RAM, against the tracked bytes)
    memory_limit_effective_bytes: int | None = None
    seed: int | None = None
    weights: str = ""  # real (a checkpoint's: --weights) | random (seeded); not in the key
    warmup_steps: int | None = None
    repeats: int | None = None
    timeout_s: float | None = None  # the point's timeout: given, or predicted from its FLOPs (runner/timeout.py)
    # what the step computed
    loss: float | None = None
    num_tokens: int | None = None  # non-padding tokens in the batch
    model_flops: float | None = None  # one forward+backward, see measure/flops.py
    # memory: allocated = torch.cuda.max_memory_allocated on CUDA; on CPU resident tensors plus
    # the live-tensor tracker's peak (its analogue)
    memory_source: str = ""  # torch.cuda | tensor-tracker
    weights_bytes: int | None = None
    grads_bytes: int | None = None  # trainable parameters' gradients (resident or not, per protocol)
    optimizer_state_bytes: int | None = None  # AdamW moments (step train), resident per protocol
    baseline_bytes: int | None = None  # allocated just before the measured step
    peak_allocated_bytes: int | None = None
    activation_peak_bytes: int | None = None  # peak_allocated - baseline
    peak_reserved_bytes: int | None = None  # CUDA caching allocator
    nvml_peak_used_bytes: int | None = None  # device-level used memory, peak over the step (all processes)
    nvml_idle_used_bytes: int | None = None  # the same before this process initialised CUDA
    cuda_context_bytes: int | None = None  # device memory of the CUDA context outside the allocator
    cuda_alloc_conf: str = ""  # the worker's PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF (runner/allocator.py)
    cpu_peak_rss_bytes: int | None = None  # process peak resident set over the measured step
    rank_peak_bytes: str = ""  # nproc > 1: each rank's peak_allocated_bytes, ';'-joined in rank order
    host_pinned_peak_bytes: int | None = None  # checkpoints held in host memory (pinned on CUDA), peak of one step
    transfer_bytes: int | None = None  # checkpoint bytes moved host <-> device in one step (both directions)
    host_register_s: float | None = None  # the first step's page-locking of host buffers (schema 7); empty: none pinned
    peak_phase: str = ""  # simulated: where in the step the peak happens (e.g. "backward, layer 3")
    margin_bytes: int | None = None  # simulated: CUDA context + allocator fragmentation, not in the peak
    timeline_file: str = ""  # the memory step's timeline (sbp run --timeline), relative to the CSV's directory
    trace_file: str = ""  # a profiler trace of one step after the timed ones (sbp run --trace), relative likewise
    # time: warm-up discarded, synchronised, `repeats` timed steps
    time_median_s: float | None = None
    time_min_s: float | None = None
    time_max_s: float | None = None
    tokens_per_s: float | None = None  # batch_size * seq_len / time_median_s (padding included)
    tflops_per_s: float | None = None  # model_flops / time_median_s / 1e12
    # streambp: where the median timed step's time went, per phase summed over layers (core/phases.py);
    # host copies run beside the compute stream on CUDA, so there the phases add up to more than the step
    phase_checkpoint_pass_s: float | None = None
    phase_head_s: float | None = None
    phase_kv_capture_s: float | None = None
    phase_chunk_forward_s: float | None = None
    phase_chunk_backward_s: float | None = None
    phase_rebuild_s: float | None = None  # recompute placements
    phase_host_copies_s: float | None = None  # offload placements; on a side stream on CUDA
    phase_copy_waits_s: float | None = None  # the compute stream waiting for a copy back
    phase_other_s: float | None = None  # the rest of stream_backward (embedding backward, gradient rounding, gaps)
    num_threads: int | None = None  # torch intra-op threads the worker ran with (RunSpec.threads)
    num_cpus: int | None = None  # logical CPUs the point's processes could use (below nproc x num_threads: shared)
    load_avg_1m: float | None = None  # the machine's 1-minute load average as the point started
    # max-length search (kind maxlen): the longest seq_len that ran and the shortest that did not
    max_seq_len: int | None = None  # the answer: the longest ok probe (None if even the first OOMed)
    oom_seq_len: int | None = None  # the shortest OOM probe (None if the search hit its ceiling)
    search_resolution: str = ""  # the bracket's stopping width: "1%" (of max_seq_len) or tokens, "256"
    num_probes: int | None = None  # probes the search used, cached ones included
    seed_seq_len: int | None = None  # the predicted max T it started from (empty: grew blind from seq_len)
    search_probes: str = ""  # every answer used, in order: "61440:ok 62464:oom 60416:ok(cached)"
    # provenance
    host: str = ""
    device_name: str = ""
    device_total_memory_bytes: int | None = None
    driver_version: str = ""
    cuda_version: str = ""
    torch_version: str = ""
    transformers_version: str = ""
    sbpbench_version: str = ""
    python_version: str = ""
    git_commit: str = ""
    git_dirty: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(ResultRow))


def phase_column(phase: str) -> str:
    """The column of a StreamBP phase (core/phases.py PHASES, or "other"): "K/V capture" -> phase_kv_capture_s."""
    return "phase_" + re.sub(r"[^a-z0-9]+", "_", phase.lower().replace("/", "")).strip("_") + "_s"


PHASE_COLUMNS: tuple[str, ...] = tuple(name for name in COLUMNS if name.startswith("phase_"))

# What every row of every schema version has: a header without one of these is not a results CSV,
# and a row with one of them empty is skipped when read (a torn or hand-damaged line).
REQUIRED_COLUMNS: tuple[str, ...] = ("schema_version", "status", "model", "method")

# The method settings (the settings table's knobs): empty in a row whose method does not read them (schema 4).
METHOD_SETTING_COLUMNS: tuple[str, ...] = METHOD_KNOBS

# The settings that define a point: same key, same measurement (a rerun replaces it).
KEY_COLUMNS: tuple[str, ...] = (
    "kind",
    "source",
    "model",
    "num_layers",
    "method",
    "objective",
    "step",
    "lora_rank",
    "lora_alpha",
    "prompt_len",
    "seq_len",
    "batch_size",
    "nproc",
    "sp",
    "dtype",
    "device_name",
    "protocol",
    *METHOD_SETTING_COLUMNS,
    "attn_implementation",
    "sdpa_backend",
    "memory_limit_bytes",
    "seed",
)

PROVENANCE_COLUMNS: tuple[str, ...] = (
    "schema_version",
    "timestamp_utc",
    "kind",
    "source",
    "objective",
    "step",
    "host",
    "device_name",
    "device_total_memory_bytes",
    "driver_version",
    "cuda_version",
    "torch_version",
    "transformers_version",
    "sbpbench_version",
    "python_version",
    "git_commit",
    "git_dirty",
    "protocol",
    "dtype",
    "attn_implementation",
    "sdpa_backend",
    "seed",
)  # not the method settings (METHOD_SETTING_COLUMNS): empty for a method that does not read them

# What a row of an older schema meant for the columns it lacks.
UPGRADES: dict[str, dict[str, str]] = {
    "1": {"objective": "sft", "step": "bp", "lora_rank": "0", "kind": "point", "source": "measured"},
    "2": {"kind": "point", "source": "measured"},
}
# Methods of the older schemas that read none of them (every method before version 4 but streambp).
SETTINGLESS_BEFORE_4 = ("bp", "ckpt")


def _as_text(value) -> str:
    """A default as the CSV writes it (records/store.py encode)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def upgrade(row: dict[str, str]) -> dict[str, str]:
    """A CSV row (strings) of any schema as the current schema reads it, in place: every current
    column present. One its file lacks and no rule below fills is empty, but for a method knob
    newer than the file, which a method that reads it ran at its default (a knob whose default
    changes what the method did needs a rule here instead, as chunk_attention has)."""
    version = row.get("schema_version", "")
    for column, value in UPGRADES.get(version, {}).items():
        if not row.get(column):
            row[column] = value
    if version in ("1", "2", "3") and row.get("method") in SETTINGLESS_BEFORE_4:
        for column in METHOD_SETTING_COLUMNS:
            row[column] = ""
    if version in ("1", "2", "3", "4") and row.get("method") == "streambp" and not row.get("checkpoints"):
        row["checkpoints"] = "gpu"  # schema 5: the placement every earlier streambp row used
    if version in ("1", "2", "3", "4", "5") and not row.get("nproc"):
        row["nproc"] = "1"  # schema 6: every earlier row ran in one process
    if version in [str(v) for v in range(1, 15)] and not row.get("sp"):
        row["sp"] = "1"  # schema 15: every earlier row's ranks held whole sequences
    if version in ("1", "2", "3", "4", "5", "6", "7", "8") and not row.get("sdpa_backend"):
        row["sdpa_backend"] = "auto"  # schema 9: every earlier row left the kernel to torch
    if version in ("1", "2", "3", "4", "5", "6", "7", "8", "9", "10") and row.get("method") == "streambp":
        row["chunk_attention"] = row.get("chunk_attention") or "lower-right"  # schema 11: the only chunk kernel
    for column in COLUMNS:  # what the rules above did not fill
        if column not in row:
            setting = SETTINGS.get(column)
            ran_at_default = setting is not None and row.get("method") in setting.read_by
            row[column] = _as_text(setting.default) if ran_at_default else ""
    return row
