"""A fork server: one interpreter that has imported tracegym's heavy modules once (torch, transformers, the
gateway) and forks a child for each ``python -m MODULE ...`` it is asked to start, so that the child skips the
seconds of imports a fresh interpreter pays (an embedded engine on a tiny model: ~0.2 s to ready instead of ~3
s).

A test suite that starts hundreds of gateways and engines runs one per worker (``python -m tracegym.forkserver
SOCKET``) and puts the socket's path in ``$TRACEGYM_FORKSERVER``: from then on ``procs.spawn_process`` sends
it every ``python -m`` child, including the engines a forked gateway starts in turn, and starts the others as
before. A child it cannot reach is started as before too.

The server stays single-threaded and computes nothing, so forking it is safe: it imports, then only accepts
requests (one JSON line each on a Unix socket that only its user can open), forks, and reaps. The child
becomes what ``subprocess.Popen`` with ``start_new_session`` would have made: its own session, the request's
environment and working directory, stdout and stderr on the descriptors the requester sent (its log file, or
its own), SIGTERM when the server dies, and ``sys.argv`` and ``__main__`` as ``python -m`` sets them. Two
things differ: its command line in ``/proc`` (and so in ``ps``) stays the server's, and the modules the server
imported were imported with the server's environment. stdlib only.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORKSERVER_ENV = "TRACEGYM_FORKSERVER"
"""The environment variable holding the path of a running fork server's socket."""

PRELOAD = (
    "tracegym.cli", "tracegym.gateway.serve", "tracegym.gateway.app", "tracegym.engine.server",
    "tracegym.engine.endpoints", "tracegym.engine.runtime", "tracegym.modelfiles.prepare", "uvicorn",
    "transformers.models.auto.modeling_auto", "transformers.core_model_loading", "transformers.masking_utils",
    "transformers.generation.continuous_batching", "transformers.models.llama.modeling_llama",
    # what a gateway imports as it builds its app and starts (its store's routes, the span recorder and
    # exporter, the server's protocol and loop, SQLite's dialect)
    "tracegym.gateway.api.control", "tracegym.gateway.api.imports", "tracegym.gateway.api.otlp",
    "tracegym.gateway.api.trajectories", "tracegym.gateway.api.ui", "tracegym.gateway.api.waits",
    "tracegym.gateway.proxy.connections", "tracegym.gateway.proxy.prefix_lookup",
    "tracegym.gateway.proxy.prompt.prefix_reuse", "tracegym.gateway.traces.recorder",
    "tracegym.gateway.traces.exporter", "uvicorn.loops.uvloop", "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.websockets_sansio_impl", "sqlalchemy.dialects.sqlite.pysqlite",
)
"""What the server imports before it serves: what a gateway and an embedded engine on a Llama-shaped model
import. A child imports anything else itself."""


# ---- the client: what procs.spawn_process uses


def _ask(path: str, request: dict[str, Any], fds: Sequence[int] = (), timeout: float = 30.0) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        socket.send_fds(s, [json.dumps(request).encode() + b"\n"], list(fds))
        with s.makefile("rb") as f:
            reply = json.loads(f.readline() or b"{}")
    if "error" in reply:
        raise OSError(f"fork server {path}: {reply['error']}")
    return reply


def module_argv(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """``(MODULE, ARGS)`` of ``[this interpreter, "-m", MODULE, *ARGS]``, else None: what a fork of this
    interpreter can run."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2], list(argv[3:])
    return None


class ForkedChild:
    """A child of the fork server, with the parts of ``subprocess.Popen`` that ``procs.ManagedProcess`` and
    the tests use: ``pid``, ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``,
    ``kill``. Its exit is seen through a pidfd; its exit code comes from the server, which reaps it."""

    def __init__(self, server: str, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None
        self._pidfd: int | None = os.pidfd_open(pid)

    def _exited(self, timeout: float | None) -> bool:
        if self._pidfd is None:
            return True
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        return bool(ready)

    def _collect(self) -> int:
        if self.returncode is None:
            self.returncode = int(_ask(self.server, {"op": "wait", "pid": self.pid})["returncode"])
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        return self._collect() if self._exited(0) else None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._exited(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._collect()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)


def spawn(server: str, argv: Sequence[str], *, env: dict[str, str], cwd: str | Path | None,
          log_path: Path | None, fds: tuple[int, int] | None = None) -> ForkedChild:
    """Have the fork server at ``server`` start ``argv`` (a ``python -m`` command: ``module_argv``), its
    output appended to ``log_path``, or on this process's stdout and stderr, or on ``fds`` (the descriptors
    for its stdout and its stderr: pipes the caller reads) where given."""
    parsed = module_argv(argv)
    if parsed is None:
        raise ValueError(f"the fork server runs only `{sys.executable} -m MODULE ...`, not {list(argv)}")
    module, args = parsed
    request = {"op": "spawn", "module": module, "args": args, "env": env,
               "cwd": str(Path(cwd or os.getcwd()).resolve())}
    if fds is not None:
        reply = _ask(server, request, fds=fds)
    elif log_path is None:
        sys.stdout.flush()
        sys.stderr.flush()
        reply = _ask(server, request, fds=(1, 2))
    else:
        with open(log_path, "ab") as log:
            reply = _ask(server, request, fds=(log.fileno(), log.fileno()))
    return ForkedChild(server, int(reply["pid"]), list(argv))


# ---- the server


def die_with_parent() -> None:
    """In a child: get SIGTERM when the parent dies (Linux), so no child outlives it."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pythonpath(env: Any) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _run_child(request: dict[str, Any], out: int, err: int) -> int:
    """In the forked child: become the requested ``python -m MODULE ARGS``, with ``out`` and ``err`` (the
    requester's descriptors) as stdout and stderr, and return its exit code."""
    os.setsid()
    die_with_parent()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {devnull, out, err} - {0, 1, 2}:
        os.close(fd)
    # runpy warns when the module is imported already, as the server's modules are: a fresh `python -m` does not
    warnings.filterwarnings("ignore", message=".* found in sys.modules after import of package",
                            category=RuntimeWarning)
    ours = _pythonpath(os.environ)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    # as `python -m` sets it: the working directory, then $PYTHONPATH, then the rest (the server's own
    # working directory and $PYTHONPATH out)
    theirs = _pythonpath(os.environ)
    sys.path[:] = [request["cwd"], *theirs, *(p for p in sys.path[1:] if p not in ours and p not in theirs)]
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        data += more
    return json.loads(data or b"{}"), fds


def _handle(conn: socket.socket, listener: socket.socket) -> None:
    request, fds = _receive(conn)
    with conn:
        try:
            if request.get("op") == "wait":
                _, status = os.waitpid(int(request["pid"]), 0)
                reply: dict[str, Any] = {"returncode": os.waitstatus_to_exitcode(status)}
            elif request.get("op") == "spawn" and len(fds) == 2:
                reply = {"pid": _fork(request, fds, listener, conn)}
            else:
                reply = {"error": f"unknown request {request.get('op')!r}"}
        except (OSError, ValueError, KeyError) as e:  # a pid not ours, a field missing: the requester is told
            reply = {"error": repr(e)}
        finally:
            for fd in fds:
                os.close(fd)
        conn.sendall(json.dumps(reply).encode() + b"\n")


def _fork(request: dict[str, Any], fds: list[int], listener: socket.socket, conn: socket.socket) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    listener.close()
    conn.close()
    code = 1
    try:
        code = _run_child(request, *fds)
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(path: str, preload: Sequence[str] = PRELOAD) -> None:
    """Import ``preload``, then serve requests on a Unix socket at ``path`` until killed."""
    from tracegym.progress import quiet_progress_bars

    quiet_progress_bars(sys.stderr)  # as the tracegym command does before anything imports transformers
    t0 = time.monotonic()
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError as e:  # a missing extra: its children import what they can themselves
            print(f"fork server: not preloaded: {name} ({e})", file=sys.stderr)
    # what the children inherit leaves the collector's generations: a child's collections (the automatic
    # full ones, a gateway's own at start) then scan only the objects it made, instead of every object of
    # the modules preloaded here, and leave the memory pages it shares with this server unwritten (a
    # full collection writes to every object it scans, and the kernel then copies each page it touches)
    gc.collect()
    gc.freeze()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        old = os.umask(0o177)
        try:
            listener.bind(path + ".tmp")
        finally:
            os.umask(old)
        listener.listen(64)
        os.rename(path + ".tmp", path)  # the socket appears once it accepts
        print(f"fork server: {len(sys.modules)} modules in {time.monotonic() - t0:.1f} s; serving {path}",
              file=sys.stderr, flush=True)
        while True:
            conn, _ = listener.accept()
            try:
                _handle(conn, listener)
            except (OSError, ValueError, KeyError) as e:
                print(f"fork server: a request failed: {e!r}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m tracegym.forkserver SOCKET [MODULE ...]  (modules to import first)")
    die_with_parent()
    serve(args[0], (*PRELOAD, *args[1:]))


if __name__ == "__main__":
    main()
