"""A fork server for CPU point workers: one process that has imported torch, transformers and
sbpbench forks each point's worker, instead of a fresh interpreter importing them again (about
7 s a point on an idle 2-core VM and 13 s on a loaded one, where a tiny point's step takes well
under a second).

Not multiprocessing's forkserver (set_forkserver_preload): one server a process, kept in the environment it began in;
a child gets no stderr pipe, session or rank group of its own, and outlives a SIGKILLed parent (holds the alive pipe).

A forked worker starts where a fresh one would be after its imports, so isolation is unchanged:
the server runs no tensor operation, starts no thread (torch's thread pools start in the worker,
which sets its own thread count) and never touches CUDA. GPU points keep a fresh interpreter
(isolated.py). The server is started by the first CPU point of a process and serves every later
one whose environment it matches; SBP_FORK_SERVER=0 turns it off.

Protocol, over a SOCK_SEQPACKET socketpair, one JSON object a message:
  parent -> server   {"spec", "result", "env", "cwd", "pgid"}, with the worker's stderr fd attached
  server -> parent   {"ready": true} once imported; {"pid": N} a worker started;
                     {"exit": N, "code": C} it ended, C as Popen's returncode (-signal when killed)
The server dies with its parent and each worker with the server (PR_SET_PDEATHSIG), so a
SIGKILLed `sbp` leaves no process behind.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from .ranks import INIT_METHOD_ENV

ENABLE_ENV = "SBP_FORK_SERVER"
# Read by the worker at run time, not at import, so a worker may differ from the server in these.
_RUNTIME_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", INIT_METHOD_ENV})
_START_TIMEOUT_S = 600.0  # the server's imports: seconds on an idle machine, minutes on a swamped one
_MESSAGE_BYTES = 1 << 20
_REAP_INTERVAL_S = 0.05
# What a point imports: the worker (and with it core, DeepSpeed's sync included), model building
# (transformers' generation mixin), the supported families' modelling code, LoRA. Not deepspeed
# itself (a ZeRO point imports it: seconds, rarely used).
_PRELOAD = (
    "sbpbench.runner.worker",
    "sbpbench.models.build",
    "sbpbench.models.lora",
    "transformers.generation.utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.gemma3.modeling_gemma3",
    "peft",
)
# not `-m sbpbench.runner.fork_server`: the package imports this module first (runpy warns)
_SERVER_MAIN = "import sys; from sbpbench.runner.fork_server import serve; sys.exit(serve(int(sys.argv[1])))"


class ForkServerUnavailable(RuntimeError):
    """The server could not start or has died: use fresh workers."""


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _RUNTIME_ENV}


class ForkServer:
    """The parent's end: start() forks one worker and returns a Popen-like handle."""

    def __init__(self) -> None:
        self.env = _import_env(dict(os.environ))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER_MAIN, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock = ours
        self._request_lock = threading.Lock()  # one request in flight: its pid reply comes next
        self._started: queue.Queue[int | None] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._alive = True
        self.started, self.last_pid = 0, None  # workers forked so far, the latest one's pid
        ready: queue.Queue[bool] = queue.Queue()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        try:
            ok = ready.get(timeout=_START_TIMEOUT_S)
        except queue.Empty:
            ok = False
        if not ok:
            self.close()
            raise ForkServerUnavailable("the fork server did not start")

    def serves(self, env: dict[str, str]) -> bool:
        return self._alive and _import_env(env) == self.env

    def _read(self, ready: queue.Queue) -> None:
        while True:
            try:
                data = self._sock.recv(_MESSAGE_BYTES)
            except OSError:
                data = b""
            if not data:  # the server is gone: its workers die with it (PDEATHSIG)
                with self._changed:
                    self._alive = False
                    self._changed.notify_all()
                ready.put(False)
                self._started.put(None)
                return
            message = json.loads(data)
            if "ready" in message:
                ready.put(bool(message["ready"]))
            elif "pid" in message:
                self._started.put(message["pid"])
            elif "exit" in message:
                with self._changed:
                    self._exits[message["exit"]] = message["code"]
                    self._changed.notify_all()

    def start(self, spec_json: str, result_path: Path, env: dict[str, str], pgid: int | None) -> ForkedWorker:
        """A worker for one point (or one rank: pgid is the rank group's, None for a session of its own)."""
        request = {"spec": spec_json, "result": str(result_path), "env": env, "cwd": os.getcwd(), "pgid": pgid}
        read_end, write_end = os.pipe()
        try:
            with self._request_lock:
                if not self._alive:
                    raise ForkServerUnavailable("the fork server has exited")
                try:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], [write_end])
                except OSError as error:
                    raise ForkServerUnavailable(f"the fork server is unreachable: {error}") from error
                pid = self._started.get()
                if pid is not None:
                    self.started, self.last_pid = self.started + 1, pid
        finally:
            os.close(write_end)
        if pid is None:
            os.close(read_end)
            raise ForkServerUnavailable("the fork server has exited")
        return ForkedWorker(self, pid, os.fdopen(read_end, "r"))

    def returncode(self, pid: int) -> int | None:
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            return None if self._alive else -signal.SIGKILL  # the server's death killed it

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: self.returncode(pid) is not None, timeout)
        return self.returncode(pid)

    def close(self) -> None:
        # shutdown, not just close: the reader thread's recv holds the socket open past a close
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the server sees EOF and exits
        except OSError:  # already shut, or the server is gone
            pass
        self._sock.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ForkedWorker:
    """The subset of subprocess.Popen that isolated.py uses: pid, stderr, poll, wait, kill, returncode."""

    def __init__(self, server: ForkServer, pid: int, stderr) -> None:
        self.server, self.pid, self.stderr = server, pid, stderr

    @property
    def returncode(self) -> int | None:
        return self.server.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        code = self.server.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return code

    def kill(self) -> None:
        if self.returncode is None:  # not after its exit: the pid may be another process's by then
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_server: ForkServer | None = None
_server_failed = False  # once a server could not start, this process uses fresh workers
_server_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0" and not _server_failed


def shared_server() -> ForkServer:
    """This process's server, started (or restarted, after an environment change) on demand."""
    global _server, _server_failed
    with _server_lock:
        if _server is not None and not _server.serves(dict(os.environ)):
            _server.close()
            _server = None
        if _server is None:
            try:
                _server = ForkServer()
            except ForkServerUnavailable:
                _server_failed = True
                raise
        return _server


@atexit.register
def _close_shared_server() -> None:
    if _server is not None:
        _server.close()


# ---- the server process ----------------------------------------------------------------------


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _child(sock: socket.socket, request: dict, stderr_fd: int) -> None:
    """In the forked worker: detach, redirect, run the point, exit. Never returns."""
    code = 1
    try:
        sock.close()
        if request["pgid"] is None:
            os.setsid()  # a session of its own, as a fresh point worker gets
        else:
            os.setpgid(0, request["pgid"])  # the ranks of one point share a process group
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)  # model code may print; the result travels in a file
        os.dup2(stderr_fd, 2)
        os.close(devnull)
        os.close(stderr_fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from .worker import run_point

        code = run_point(request["spec"], Path(request["result"]))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(fd: int) -> int:
    from .worker import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; its death ends this
    sock = socket.socket(fileno=fd)
    for module in _PRELOAD:  # the imports every worker would pay
        try:
            importlib.import_module(module)
        except ImportError:  # an optional extra (peft) not installed: its points import nothing more
            pass

    # A Python thread could hold a lock the fork copies held. Native pools are fine: numpy's and
    # scipy's OpenBLAS threads (idle) shut down at fork and restart in the child (pthread_atfork).
    if threading.active_count() != 1:
        _send(sock, {"ready": False})
        return 1
    gc.freeze()  # the imported objects: the workers' collections skip them (no copy-on-write of every page)
    _send(sock, {"ready": True})
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], _REAP_INTERVAL_S if children else None)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, 1)
        if not data:  # the parent closed its end (or died)
            return 0
        sys.stdout.flush()
        sys.stderr.flush()
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            _child(sock, request, fds[0])
        if request["pgid"] is not None:  # here too, so the group exists before the next rank joins it
            try:
                os.setpgid(pid, request["pgid"] or pid)
            except OSError:  # the child has done it already, or died
                pass
        os.close(fds[0])
        children.add(pid)
        _send(sock, {"pid": pid})
