"""The one way these tests run ranks: WORLD spawned gloo processes on this machine, each running
the same cases, rank 0 sending each case's result back through a queue.

    run_distributed(cases, target)   in the test process: spawn, collect, fail on a dead rank
    serve_cases(rank, cases, queue, run_case, finish)   in a rank: run each case, report rank 0's
    deepspeed_rank(rank, port)       in a rank, first: what DeepSpeed and Accelerate read
    trainer_rank(..., run_case)      a trainer test's rank: deepspeed_rank, then serve_cases
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import traceback
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

WORLD = 2  # ranks: the smallest group that has collectives, one per core of a 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_cases(rank: int, cases, queue, run_case: Callable, finish: Callable[[], None] = lambda: None) -> None:
    """A rank's life: run_case(case, rank) -> (grads, counts) for each case, rank 0 putting
    (name, grads, counts, None) on the queue; an exception is put as the traceback. Then finish()
    (the process group's end), and out without the interpreter's exit, at which gloo can abort
    ("terminate called without an active exception")."""
    try:
        for case in cases:
            grads, counts = run_case(case, rank)
            if rank == 0:
                queue.put((case["name"], grads, counts, None))
    except Exception:
        queue.put((None, None, None, f"rank {rank}: {traceback.format_exc()}"))
    finally:
        finish()
        queue.close()
        queue.join_thread()  # flush what was put before leaving
        os._exit(0)


def run_distributed(cases, target: Callable, timeout_s: float = 240.0, world: int = WORLD) -> dict:
    """Run `cases` in one spawn of `world` ranks, `target(rank, port, cases, queue)` each;
    {name: (full grads, counts)} from rank 0. Skipped where torch has no gloo."""
    import pytest

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch built without gloo")
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    workers = [context.Process(target=target, args=(rank, port, cases, queue)) for rank in range(world)]
    for worker in workers:
        worker.start()
    results, waited = {}, 0.0
    try:
        while len(results) < len(cases):
            try:
                name, grads, counts, error = queue.get(timeout=1.0)
            except queue_module.Empty:
                waited += 1.0
                dead = [w.exitcode for w in workers if not w.is_alive()]
                if dead or waited > timeout_s:
                    raise AssertionError(f"workers exited ({dead}) or timed out after {len(results)} cases") from None
                continue
            if error is not None:
                raise AssertionError(error)
            results[name] = ({key: torch.from_numpy(value) for key, value in grads.items()}, counts)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    return results


def trainer_rank(rank: int, port: int, cases, queue, run_case: Callable) -> None:
    """A rank of a trainer test: DeepSpeed's environment (deepspeed_rank; the Trainer's Accelerator
    starts the process group), then each case (serve_cases). A target as functools.partial(trainer_rank,
    run_case=...)."""
    deepspeed_rank(rank, port)
    serve_cases(rank, cases, queue, run_case)


def deepspeed_rank(rank: int, port: int) -> None:
    """Make this spawned process rank `rank` of WORLD for DeepSpeed on CPU (the environment variables
    deepspeed and Accelerate read), before any process group exists."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
    )
    import logging
    import sys

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    torch.set_num_threads(1)
    # The CPU accelerator JIT-compiles a shared-memory all-reduce op on first use (a minute of g++ on
    # 2 cores, then a file lock on ~/.cache/torch_extensions); gloo alone is what is tested here.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # deepspeed.comm.torch is torch itself
