"""The preload launcher's zygote: a process that imports heavy modules once, then forks workers.

Started by ``fsm_agent.plugins.launcher_preload`` as ``python -m fsm_agent.plugins.launcher_preload.zygote MODULES FD``
where FD is its end of a ``SOCK_SEQPACKET`` socket pair. One JSON object per packet:

- agent -> zygote: ``{"op": "spawn", "local_rank", "argv", "env", "cwd", "mode", "cgroup"}`` with two
  fds (stdout, stderr) attached by SCM_RIGHTS; ``mode`` is ``script`` | ``module`` | ``exec``;
  ``cgroup`` is the directory of the workers' cgroup (``fsm_agent.plugins.containment``) or null.
- zygote -> agent: ``{"spawned": local_rank, "pid": pid}`` and, when a worker ends,
  ``{"exited": pid, "code": exitcode}`` (``-N`` for death by signal N, as subprocess).

The zygote is single-threaded (forking a threaded process can deadlock the child): one
selector loop on the socket and on a SIGCHLD wakeup pipe. It has ``PR_SET_PDEATHSIG`` set, and
so does each worker (towards the zygote), so the chain dies with the agent. The zygote itself
stays out of the workers' cgroup (it outlives attempts); each worker enters it right after fork.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys

from fsm_agent.plugins.containment import enter_cgroup

_PR_SET_PDEATHSIG = 1
MAX_FDS = 2


def _pdeathsig() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _run_worker(request: dict, out_fd: int, err_fd: int) -> int:
    """In the forked child: become the worker. Returns the exit code (never returns for exec)."""
    os.setsid()  # first: the launcher signals the worker's process group as soon as it knows the pid
    if request.get("cgroup"):
        enter_cgroup(request["cgroup"])
    _pdeathsig()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    for fd, target in ((out_fd, 1), (err_fd, 2)):
        if fd >= 0:
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv, mode = request["argv"], request["mode"]
    if mode == "exec":
        os.execvpe(argv[0], argv, request["env"])
    # As `python -u`: unbuffered text streams.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    sys.argv = list(argv)
    try:
        if mode == "module":
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "sock")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                os.read(wake_r, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, MAX_FDS)
            if not data:
                return  # the agent closed the socket: it is gone or done
            request = json.loads(data)
            out_fd, err_fd = (list(fds) + [-1, -1])[:2]
            pid = os.fork()
            if pid == 0:
                selector.close()
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                os._exit(_run_worker(request, out_fd, err_fd))
            for fd in (out_fd, err_fd):
                if fd >= 0:
                    os.close(fd)
            _send(sock, {"spawned": request["local_rank"], "pid": pid})


def main() -> None:
    _pdeathsig()
    sock = socket.socket(fileno=int(sys.argv[2]))
    for name in filter(None, sys.argv[1].split(",") if len(sys.argv) > 1 else []):
        try:
            importlib.import_module(name)
        except Exception as exc:  # told to the agent, which ends with one line naming the module
            _send(sock, {"ready": False, "module": name, "error": f"{type(exc).__name__}: {exc}"})
            return
    _send(sock, {"ready": True})
    serve(sock)


if __name__ == "__main__":
    main()
