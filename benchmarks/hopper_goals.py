"""The speed goals of StreamBP on one Hopper GPU, measured in one command, with each phase's time.

    python benchmarks/hopper_goals.py                  # on a GPU machine, about 6 minutes
    python benchmarks/hopper_goals.py --goals-only     # the two goal points only, about 3 minutes
    python benchmarks/hopper_goals.py --smoke          # the same commands on tiny CPU shapes (a check)
    python benchmarks/hopper_goals.py --deadline 1200  # where a command may run 20 minutes, not 10

The goals:
- Qwen3-4B, T = 9000, bf16: StreamBP's step time / gradient checkpointing's <= 0.75;
- Qwen3-8B, T = 65536, bf16, StreamBP with the checkpoints on the host (`--checkpoints cpu`):
  >= 40% MFU (model TFLOP/s over the GPU's dense bf16 peak).
Beside them, unless --goals-only, the chunk sizes a faster rule could choose: Qwen3-4B at T = 9000 in
2 chunks and in 1, Qwen3-8B at T = 65536 in chunks of 8192.

Each point is an ordinary `sbp run --phases` (one process per point, rows upserted into --out, the
phase table printed); the goal table at the end is read from the rows. The minutes above are
estimates from the selftest's times on an H100 (77 s for three methods at Qwen3-4B, 93 s for the
8B point), not measured for this script.

Time limits. `sbp run`'s own default limit (runner/timeout.py) allows 600 s of start-up for any
model, so one stalled point would outlast a machine's 10-minute command. Here each command's
points run under `--timeout`: runner/timeout.py's prediction (SAFETY_FACTOR x steps x executed
FLOPs at its assumed rate) with START_UP_S, what these models take to start, in place of its
600 s. The script stops at --deadline: a command is started only while MIN_START_S are left
(runner/budget.py's rule), and one still running then is stopped as by Ctrl-C (its workers end,
the rows of its finished points stay), so the goal table of what ran is still printed.
"""

from __future__ import annotations

import argparse
import itertools
import math
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

from sbpbench.config import point_specs
from sbpbench.records import read_rows
from sbpbench.runner.budget import MIN_START_S
from sbpbench.runner.timeout import ASSUMED_RATES, SAFETY_FACTOR, step_flops

# Dense bf16 peak in TFLOP/s by a substring of the device name (NVIDIA datasheets: H100 SXM5 and
# H200 989.4, H100 PCIe 756; "H100 80GB HBM3" is the SXM5 part). Without a match: no MFU, rates only.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 SXM": 989.4, "H100 PCIe": 756.0}
RATIO_GOAL, MFU_GOAL = 0.75, 0.40

SHORT = ["--model", "Qwen/Qwen3-4B", "--seq", "9000", "--dtype", "bf16"]
LONG = ["--model", "Qwen/Qwen3-8B", "--seq", "65536", "--dtype", "bf16", "--checkpoints", "cpu", "--repeats", "1"]
# the same commands on shapes a CPU runs in seconds (--smoke): they check the script, not the goals
SMOKE_SHORT = ["--model", "tiny/qwen3", "--seq", "96", "--device", "cpu", "--repeats", "1", "--warmup", "0"]
SMOKE_LONG = ["--model", "tiny/qwen3", "--seq", "192", "--device", "cpu", "--checkpoints", "cpu", "--repeats", "1"]

# A point's start: `sbp run` and its worker, torch and transformers imported, random 8B bf16 weights
# built on the GPU: 30.5 and 33.7 s wall on one H100 for points whose step took a few seconds
# (runner/selftest.py POINT_OVERHEAD_S). A command's own start and its tables get as much again.
START_UP_S = 30.0
# Stop 30 s before a machine's 10-minute command limit: time to print the goal table of what ran.
DEADLINE_S = 570.0
STOP_GRACE_S = 30.0  # after the Ctrl-C: `sbp run` kills its workers and exits within seconds
# The `sbp run` options that settle a point's time, and the settings they set (sbpbench/config).
TIMED_OPTIONS = {
    "--model": "model", "--seq": "seq_len", "--dtype": "dtype", "--device": "device",
    "--checkpoints": "checkpoints", "--warmup": "warmup", "--repeats": "repeats", "--chunk-size": "chunk_size",
}  # fmt: skip
INTEGERS = {"seq_len", "warmup", "repeats", "chunk_size"}


def commands(smoke: bool, goals_only: bool) -> list[list[str]]:
    """The `sbp run` argument lists, goal points first."""
    short, long = (SMOKE_SHORT, SMOKE_LONG) if smoke else (SHORT, LONG)
    seq_short, seq_long = int(short[short.index("--seq") + 1]), int(long[long.index("--seq") + 1])
    runs = [[*short, "--method", "ckpt", "streambp"], [*long, "--method", "streambp"]]
    if not goals_only:
        runs += [
            [*short, "--method", "streambp", "--chunk-size", str(seq_short // 2)],
            [*short, "--method", "streambp", "--chunk-size", str(seq_short)],
            [*long, "--method", "streambp", "--chunk-size", str(seq_long // 8)],
        ]
    return runs


def methods_of(run: list[str]) -> list[str]:
    """The methods a command's `--method` names: one point each."""
    after = run[run.index("--method") + 1 :]
    return list(itertools.takewhile(lambda arg: not arg.startswith("--"), after))


def point_timeout_s(run: list[str]) -> float:
    """The --timeout of each point of one command (module docstring): the longest its methods need."""
    settings = {TIMED_OPTIONS[flag]: value for flag, value in itertools.pairwise(run) if flag in TIMED_OPTIONS}
    settings = {name: int(value) if name in INTEGERS else value for name, value in settings.items()}
    kind = "cpu" if settings.get("device") == "cpu" else "cuda"  # no --device: this script's GPU points
    with warnings.catch_warnings():  # `sbp run` gives the point's notices itself
        warnings.simplefilter("ignore")
        specs = point_specs(settings, methods_of(run), defaults_for=kind)
    # steps: the warm-up, the memory step and the timed ones, as runner/timeout.py counts them
    seconds = max((s.warmup + 1 + s.repeats) * step_flops(s) / ASSUMED_RATES[kind, s.dtype] for s in specs)
    return float(math.ceil(SAFETY_FACTOR * (START_UP_S + seconds)))


def run_command(command: list[str], limit_s: float) -> int | None:
    """Run `command`; its exit code, or None when it was stopped at limit_s: Ctrl-C first (`sbp run`
    then kills its workers and keeps its finished points' rows), a kill after STOP_GRACE_S."""
    process = subprocess.Popen(command)
    try:
        return process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return None
    except BaseException:  # Ctrl-C here reached the command too: let it end, then stop
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
        raise


def peak_tflops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in device_name), None)


def goal_lines(rows: list[dict], short: list[str], long: list[str]) -> list[str]:
    """The goal table (Markdown) from the rows of the two goal points (auto chunk sizes)."""

    def pick(args: list[str], method: str, **match: str) -> dict | None:
        model, seq = args[args.index("--model") + 1], args[args.index("--seq") + 1]
        found = [
            r
            for r in rows
            if r["model"] == model and r["seq_len"] == seq and r["method"] == method and r["status"] == "ok"
            and (method != "streambp" or "chunk_size" in (r.get("auto_settings") or "").split(";"))  # not a variant
            and all(r.get(k) == v for k, v in match.items())
        ]  # fmt: skip
        return found[-1] if found else None

    lines = ["| goal | measured | target |", "|---|---:|---:|"]
    ckpt, stream = pick(short, "ckpt"), pick(short, "streambp", checkpoints="gpu")
    if ckpt and stream and ckpt.get("time_median_s") and stream.get("time_median_s"):
        ratio = float(stream["time_median_s"]) / float(ckpt["time_median_s"])
        lines.append(f"| StreamBP / ckpt step time, {short[1]} T={short[3]} | {ratio:.3f} | <= {RATIO_GOAL} |")
    else:
        lines.append(f"| StreamBP / ckpt step time, {short[1]} T={short[3]} | not measured | <= {RATIO_GOAL} |")
    point = pick(long, "streambp", checkpoints="cpu")
    what = f"StreamBP MFU, {long[1]} T={long[3]}, checkpoints cpu"
    if point and point.get("tflops_per_s"):
        peak = peak_tflops(point.get("device_name", ""))
        rate = float(point["tflops_per_s"])
        value = f"{rate / peak:.1%} ({rate:.1f} TFLOP/s)" if peak else f"{rate:.3g} TFLOP/s (peak unknown)"
        lines.append(f"| {what} | {value} | >= {MFU_GOAL:.0%} |")
    else:
        lines.append(f"| {what} | not measured | >= {MFU_GOAL:.0%} |")
    return lines


def main(argv: list[str] | None = None, clock=time.monotonic) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu/hopper_goals.csv"), help="results CSV")
    parser.add_argument("--goals-only", action="store_true", help="only the two goal points")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU shapes: checks the script, not the goals")
    parser.add_argument(
        "--deadline", type=float, default=DEADLINE_S, metavar="S", help=f"stop after S seconds (default {DEADLINE_S:g})"
    )
    args = parser.parse_args(argv)
    deadline = clock() + args.deadline
    unfinished = []
    for run in commands(args.smoke, args.goals_only):
        timeout_s = point_timeout_s(run)
        command = [sys.executable, "-m", "sbpbench", "run", *run, "--timeout", f"{timeout_s:g}", "--phases"]
        command += ["--out", str(args.out)]
        line = "sbp " + " ".join(command[3:])
        left = deadline - clock()
        if left < MIN_START_S:
            print(f"not started ({left:.0f} s left of --deadline): {line}", flush=True)
            unfinished.append(line)
            continue
        print(f"$ {line}", flush=True)
        limit_s = len(methods_of(run)) * timeout_s + START_UP_S  # its points, and its own start
        code = run_command(command, min(limit_s, left))
        if code is None:
            why = "at --deadline" if left < limit_s else f"after {limit_s:g} s, its points' time limits"
            print(f"stopped {why}: {line}", flush=True)
        if code != 0:
            unfinished.append(line)
    short, long = (SMOKE_SHORT, SMOKE_LONG) if args.smoke else (SHORT, LONG)
    print("\n".join(["", *goal_lines(read_rows(args.out), short, long)]))
    return 1 if unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
