"""The speed goals of StreamBP on one Hopper GPU, measured in one command, with each phase's time.

    python benchmarks/hopper_goals.py                  # on a GPU machine, about 6 minutes
    python benchmarks/hopper_goals.py --goals-only     # the two goal points only, about 3 minutes
    python benchmarks/hopper_goals.py --smoke          # the same commands on tiny CPU shapes (a check)

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
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from sbpbench.records import read_rows

# Dense bf16 peak in TFLOP/s by a substring of the device name (NVIDIA datasheets: H100 SXM5 and
# H200 989.4, H100 PCIe 756; "H100 80GB HBM3" is the SXM5 part). Without a match: no MFU, rates only.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 SXM": 989.4, "H100 PCIe": 756.0}
RATIO_GOAL, MFU_GOAL = 0.75, 0.40

SHORT = ["--model", "Qwen/Qwen3-4B", "--seq", "9000", "--dtype", "bf16"]
LONG = ["--model", "Qwen/Qwen3-8B", "--seq", "65536", "--dtype", "bf16", "--checkpoints", "cpu", "--repeats", "1"]
# the same commands on shapes a CPU runs in seconds (--smoke): they check the script, not the goals
SMOKE_SHORT = ["--model", "tiny/qwen3", "--seq", "96", "--device", "cpu", "--repeats", "1", "--warmup", "0"]
SMOKE_LONG = ["--model", "tiny/qwen3", "--seq", "192", "--device", "cpu", "--checkpoints", "cpu", "--repeats", "1"]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu/hopper_goals.csv"), help="results CSV")
    parser.add_argument("--goals-only", action="store_true", help="only the two goal points")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU shapes: checks the script, not the goals")
    args = parser.parse_args(argv)
    failed = 0
    for run in commands(args.smoke, args.goals_only):
        command = [sys.executable, "-m", "sbpbench", "run", *run, "--phases", "--out", str(args.out)]
        print("$ sbp " + " ".join(command[3:]), flush=True)
        failed += subprocess.run(command, check=False).returncode != 0
    short, long = (SMOKE_SHORT, SMOKE_LONG) if args.smoke else (SHORT, LONG)
    print("\n".join(["", *goal_lines(read_rows(args.out), short, long)]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
