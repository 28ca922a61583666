"""The preload launcher's zygote: a process that imports heavy modules once, then forks workers.

Started (``fsm_agent._early_zygote.spawn``) as ``python .../launcher_preload/zygote.py MODULES FD``, where FD
is its end of a ``SOCK_SEQPACKET`` socket pair: a file, not ``-m``, so that the preload modules are
the first thing it imports (``-m`` would import the ``fsm_agent`` packages first, a few tenths of
a second on the first start's path); the two fsm-agent modules it needs, both standard library
only, are loaded by their files. One JSON object per packet:

- agent -> zygote: ``{"op": "spawn", "local_rank", "argv", "env", "cwd", "mode", "cgroup"}`` with two
  fds (stdout, stderr) attached by SCM_RIGHTS; ``mode`` is ``script`` | ``module`` | ``exec``;
  ``cgroup`` is the directory of the workers' cgroup (``fsm_agent.plugins.containment``) or null.
- agent -> zygote: ``{"op": "store", "addr", "port"}``: fork a store host, a process holding a
  fresh torch ``TCPStore`` server at ``addr:port`` (the workers' store in torch's agent-store mode,
  ``TORCHELASTIC_USE_AGENT_STORE=True``); answered once it listens. ``{"op": "store_stop"}``: end
  the store host (killed and reaped before the answer, so the port is free again).
- zygote -> agent: first ``{"ready": true, "import_s": seconds, "torch": bool}`` once the modules
  are imported (``torch``: whether ``torch.distributed`` is among them, so a store host is cheap) (or ``{"ready": false, "module", "error"}``); ``{"spawned": local_rank, "pid": pid}`` and, when a
  worker ends, ``{"exited": pid, "code": exitcode}`` (``-N`` for death by signal N, as subprocess);
  ``{"store": port, "pid": pid}`` or ``{"store_error": message}``; ``{"store_stopped": true}``.

The zygote is single-threaded (forking a threaded process can deadlock the child): one
selector loop on the socket and on a SIGCHLD wakeup pipe. It has ``PR_SET_PDEATHSIG`` set, and
so does each worker (towards the zygote), so the chain dies with the agent. The zygote itself
stays out of the workers' cgroup (it outlives attempts); each worker enters it right after fork.
The store host stays out too: it belongs to the attempt's rendezvous, not to its workers, and it
runs the TCPStore's server threads in a process of its own so that the zygote never forks with
threads running.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import time

MAX_FDS = 2
_HERE = os.path.dirname(os.path.abspath(__file__))
_helpers: dict = {}  # "boot": fsm_agent/_early_zygote.py, "containment": fsm_agent/plugins/containment.py


def _load(name: str, path: str):
    """The module in ``path``, without importing the ``fsm_agent`` package around it."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pdeathsig() -> None:
    _helpers["boot"].parent_death_signal()


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _threads_from_env() -> None:
    """torch's intra-op threads as the worker's own OMP_NUM_THREADS says: OpenMP read the variable
    when the zygote imported torch, maybe before the agent set it (torchrun's default of 1)."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _run_worker(request: dict, out_fd: int, err_fd: int) -> int:
    """In the forked child: become the worker. Returns the exit code (never returns for exec)."""
    os.setsid()  # first: the launcher signals the worker's process group as soon as it knows the pid
    if request.get("cgroup"):
        _helpers["containment"].enter_cgroup(request["cgroup"])
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
    _threads_from_env()
    argv, mode = request["argv"], request["mode"]
    if mode == "exec":
        os.execvpe(argv[0], argv, request["env"])
    # As `python -u`: unbuffered text streams.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    sys.argv = list(argv)
    try:
        if mode == "module":
            sys.path.insert(0, os.getcwd())  # as ``python -m``: the working directory first
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


def _host_store(addr: str, port: int, ready_fd: int) -> None:
    """In the forked store host: serve a fresh TCPStore at ``addr:port`` until killed.

    Writes ``ok`` (or the error) to ``ready_fd`` once the server listens. Mirrors the store torch's
    agent hosts for its workers (``TCPStore(is_master=True, wait_for_workers=False)``)."""
    os.setsid()  # out of the zygote's process group: signals meant for the agent's group are not for it
    _pdeathsig()  # towards the zygote: the store host ends with it
    try:
        from torch.distributed import TCPStore

        listener = _helpers["boot"].listen_on(addr, port)
        store = TCPStore(host_name=addr, port=port, is_master=True, wait_for_workers=False,
                         master_listen_fd=listener.detach())
    except BaseException as exc:
        os.write(ready_fd, f"{type(exc).__name__}: {exc}".encode()[:4000])
        os._exit(1)
    os.write(ready_fd, b"ok")
    os.close(ready_fd)
    while store is not None:  # the server runs on its own threads; this one only waits to be killed
        signal.pause()


def _start_store_host(request: dict, close_in_child: list) -> dict:
    """Fork the store host; return the answer for the agent once it listens (or failed)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for closing in close_in_child:
            closing()
        os.close(ready_r)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        _host_store(request["addr"], int(request["port"]), ready_w)
        os._exit(0)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        answer = ready.read().decode(errors="replace")
    if answer != "ok":
        _stop_store_host(pid)
        return {"store_error": answer or "the store host died before it listened"}
    return {"store": int(request["port"]), "pid": pid}


def _stop_store_host(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "sock")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    store_pid: int | None = None
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
                    if pid == store_pid:  # died by itself: the agent learns it from the workers' failures
                        store_pid = None
                        continue
                    _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, MAX_FDS)
            if not data:
                _stop_store_host(store_pid)
                return  # the agent closed the socket: it is gone or done
            request = json.loads(data)
            if request["op"] in ("store", "store_stop"):
                for fd in fds:
                    os.close(fd)
                _stop_store_host(store_pid)
                store_pid = None
                if request["op"] == "store_stop":
                    _send(sock, {"store_stopped": True})
                    continue
                answer = _start_store_host(request, [selector.close, sock.close, lambda: os.close(wake_r),
                                                     lambda: os.close(wake_w)])
                store_pid = answer.get("pid")
                _send(sock, answer)
                continue
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
    if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
        del sys.path[0]  # run as a file: its directory is no import root (the workers inherit sys.path)
    _helpers["boot"] = _load("_fsm_agent_early_zygote", os.path.join(_HERE, "..", "..", "_early_zygote.py"))
    _pdeathsig()
    sock = socket.socket(fileno=int(sys.argv[2]))
    started = time.monotonic()
    for name in filter(None, sys.argv[1].split(",") if len(sys.argv) > 1 else []):
        try:
            importlib.import_module(name)
        except Exception as exc:  # told to the agent, which ends with one line naming the module
            _send(sock, {"ready": False, "module": name, "error": f"{type(exc).__name__}: {exc}"})
            return
    _helpers["containment"] = _load("_fsm_agent_containment", os.path.join(_HERE, "..", "containment.py"))
    # With torch imported, a store host is one fork away: the agent may then host the workers' store.
    _send(sock, {"ready": True, "import_s": time.monotonic() - started, "torch": "torch.distributed" in sys.modules})
    serve(sock)


if __name__ == "__main__":
    main()
