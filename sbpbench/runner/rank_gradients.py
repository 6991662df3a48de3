"""`sbp check` on several ranks: one step of a method on spec.nproc ranks, as `sbp run` shards it
(FSDP2, --sp ranks sharing each sequence: runner/ranks.py), every data rank on the check's one
batch, and the loss and the full gradients back from rank 0, to compare with one process's bp
(in the spec's dtype: fp64, or fp32 and bf16 judged against bp's fp64 step, runner/exactness.py).

The parent (`ranked_step`) starts the ranks as `python -m sbpbench.runner.rank_gradients OUT.pt`,
the spec's JSON on stdin and the rank in the environment, as runner/isolated.py starts a point's
ranks, and reads OUT.pt: {"loss": tensor, "grads": {name: tensor}}, or {"unsupported": why}.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..config import RunSpec
from ..measure.threads import set_intra_op_threads
from ..methods import MethodUnsupported
from ..records import one_line
from . import ranks
from .isolated import point_directory
from .ranks import INIT_METHOD_ENV
from .timeout import point_timeout_s
from .worker import die_with_parent


class RankedStepUnsupported(MethodUnsupported):
    """The method cannot run this check's point on ranks; the message says why (a MethodUnsupported,
    so the fp32 and bf16 judges report it as they report one in one process)."""


def ranked_step(spec: RunSpec) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, {parameter name: full gradient}) of one step of spec on spec.nproc ranks; raises
    RankedStepUnsupported (the method's reason) or RuntimeError (a rank failed: its last line)."""
    with point_directory() as tmp:
        out = tmp / "gradients.pt"
        workers: list[subprocess.Popen] = []
        try:
            for rank in range(spec.nproc):
                workers.append(_start(spec, rank, tmp, out, workers[0].pid if workers else None))
            failed = _wait(workers, tmp, point_timeout_s(spec))
        except BaseException:  # Ctrl-C: the ranks must not outlive the check
            _kill(workers)
            raise
        if failed is None and out.exists():
            result = torch.load(out, weights_only=True)
            if "unsupported" in result:
                raise RankedStepUnsupported(result["unsupported"])
            return result["loss"], result["grads"]
    raise RuntimeError(f"{spec.method} on {spec.nproc} ranks failed: {failed or 'no result'}")


def _start(spec: RunSpec, rank: int, tmp: Path, out: Path, group: int | None) -> subprocess.Popen:
    """Rank `rank`, its stderr in tmp; the first makes a process group the others join (one kill ends them all)."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(spec.nproc)}
    env[INIT_METHOD_ENV] = f"file://{tmp / 'rendezvous'}"
    with (tmp / f"rank{rank}.stderr").open("w") as stderr:
        worker = subprocess.Popen(
            [sys.executable, "-m", "sbpbench.runner.rank_gradients", str(out)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
            env=env,
            process_group=0 if group is None else group,
        )
    worker.stdin.write(spec.to_json())
    worker.stdin.close()
    return worker


def _kill(workers: list[subprocess.Popen]) -> None:
    if workers:
        try:
            os.killpg(workers[0].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for worker in workers:
        worker.wait()


def _wait(workers: list[subprocess.Popen], tmp: Path, timeout_s: float) -> str | None:
    """None when every rank exited 0; else why not (the timeout, or a failed rank's last stderr
    line), the ranks left killed: one that failed leaves the others waiting in a collective."""
    deadline = time.monotonic() + timeout_s
    while any(w.poll() is None for w in workers):
        if time.monotonic() > deadline or any(w.poll() not in (None, 0) for w in workers):
            break
        time.sleep(0.05)
    timed_out = time.monotonic() > deadline
    _kill(workers)
    bad = next((r for r, w in enumerate(workers) if w.returncode != 0), None)
    if bad is None:
        return None
    if timed_out:
        return f"no result after {timeout_s:g} s (--timeout)"
    lines = [line.strip() for line in (tmp / f"rank{bad}.stderr").read_text().splitlines() if line.strip()]
    return f"rank {bad}: {lines[-1][:500] if lines else f'exit code {workers[bad].returncode}'}"


def main(argv: list[str]) -> int:
    """A rank: join, build the sharded step, run it from zero gradients, rank 0 writes the result."""
    die_with_parent()
    spec, out = RunSpec.from_json(sys.stdin.read()), Path(argv[0])
    rank = ranks.rank_from_env()
    device = ranks.join(spec, rank)
    set_intra_op_threads(spec.threads)
    try:
        result = _gradients(spec, device, rank)
    except MethodUnsupported as error:
        result = {"unsupported": one_line(error).removeprefix(f"{type(error).__name__}: ")}
    if rank.rank == 0:
        torch.save(result, out.with_name(out.name + ".tmp"))
        os.replace(out.with_name(out.name + ".tmp"), out)
    sys.stderr.flush()
    ranks.leave()
    os._exit(0)  # gloo can abort at interpreter exit


def _gradients(spec: RunSpec, device: torch.device, rank: ranks.Rank) -> dict:
    """One step as `sbp check` runs it (LoRA adapters seeded non-zero, alpha 2 x rank), every data rank
    on the same batch; every rank gathers each full gradient (a collective), in the same order."""
    alpha = 2 * spec.lora_rank
    step, model = ranks.build_sharded_step(
        spec, device, rank, same_batch=True, lora_alpha=alpha, lora_init_seed=spec.seed
    )
    loss = step.run()  # gradients were zeroed in place (the steady protocol)
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[name] = grad.detach().cpu()
    return {"loss": loss.detach().cpu(), "grads": grads}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
