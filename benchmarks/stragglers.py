"""Store load of step-time publication (plugin ``straggler``): store operations per second against
the number of agents.

K real agents (``fsm-agent run --nnodes K``, one stepping worker each, ``fsm`` backend) reach
one ``python -m fsm_agent.store`` through a counting TCP proxy on loopback. The proxy reads the
store's line-delimited JSON requests on their way (it never changes them) and counts them by
``op``. Each K runs twice, with ``--straggler-window`` off and on, and counts the requests of a
steady stretch of ``--seconds`` once all K workers step: all requests, and those on the step
times' keys (``fsm_agent/step_times/...``, by op). The publication is bounded when its requests
per agent and window stay flat as K grows (expected: 2 per agent, 3 for group rank 0, so
(2K + 1) / K). The last column counts the re-rendezvous the agents' events files show in the
run (none expected: a membership change in the stretch would add the rendezvous' own requests).

    python benchmarks/stragglers.py                       # K = 2, 4, 8; window 1 s; 10 s each
    python benchmarks/stragglers.py --agents 2,4,8,16 --window 0.5 --seconds 20 --markdown out.md
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

WORKER = """
    import os, time
    import fsm_agent
    open(f"started.{os.environ['RANK']}.{os.environ['WORLD_SIZE']}", "w").close()
    step = 0
    while True:
        step += 1
        time.sleep(0.05)
        fsm_agent.heartbeat(step=step)
"""


STEP_TIMES_KEY = "fsm_agent/step_times/"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingProxy:
    """Forwards 127.0.0.1:port to the store; counts the clients' request lines by ``op``."""

    def __init__(self, target: int):
        self.target, self._lock = target, threading.Lock()
        self.counts: collections.Counter = collections.Counter()  # op, and "step_times <op>" for those keys
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def snapshot(self) -> collections.Counter:
        with self._lock:
            return collections.Counter(self.counts)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        pending = b""
        try:
            while data := src.recv(256 * 1024):
                dst.sendall(data)
                if requests:
                    pending += data
                    *lines, pending = pending.split(b"\n")
                    requests = [json.loads(line) for line in lines if line.strip()]
                    with self._lock:
                        for req in requests:
                            self.counts[req.get("op", "?")] += 1
                            keys = [req.get("key", "")] + list(req.get("keys", []))
                            if any(STEP_TIMES_KEY in str(k) for k in keys):
                                self.counts["step_times " + req.get("op", "?")] += 1
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


def measure(k: int, window: float, seconds: float, directory: Path) -> tuple[collections.Counter, int]:
    """Requests by op during ``seconds`` of K agents' steady run (``window`` 0: straggler off), and
    the re-rendezvous the agents recorded."""
    store_port = free_port()
    env = {**os.environ, "TMPDIR": str(directory)}
    store = subprocess.Popen(
        [sys.executable, "-m", "fsm_agent.store", "--host", "127.0.0.1", "--port", str(store_port)],
        start_new_session=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    agents: list[subprocess.Popen] = []
    proxy = None
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", store_port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        proxy = CountingProxy(store_port)
        script = directory / "worker.py"
        script.write_text(textwrap.dedent(WORKER))
        for _ in range(k):
            agents.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "fsm_agent",
                        "run",
                        "--nnodes",
                        str(k),
                        "--nproc-per-node",
                        "1",
                        "--rdzv-backend",
                        "fsm",
                        "--rdzv-endpoint",
                        f"127.0.0.1:{proxy.port}",
                        "--rdzv-id",
                        f"bench{k}",
                        "--rdzv-conf",
                        "is_host=0",
                        "--local-addr",
                        "127.0.0.1",
                        "--straggler-window",
                        str(window),
                        "--events-file",
                        str(directory / f"events.{len(agents)}.jsonl"),
                        str(script),
                    ],
                    cwd=directory,
                    start_new_session=True,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 60 + 10 * k
        while not all((directory / f"started.{r}.{k}").exists() for r in range(k)):
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                raise RuntimeError(f"K={k}: the workers did not all start")
            time.sleep(0.2)
        time.sleep(max(3 * window, 2.0))  # past the first windows' one-off checks
        before = proxy.snapshot()
        time.sleep(seconds)
        counted = proxy.snapshot() - before
        changes = sum(
            line.count('"trigger": "membership_changed"')
            for path in directory.glob("events.*.jsonl")
            for line in path.read_text().splitlines()
        )
        return counted, changes
    finally:
        for proc in (*agents, store):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proxy is not None:
            proxy.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="2,4,8", help="numbers of agents, comma-separated")
    parser.add_argument("--window", type=float, default=1.0, help="--straggler-window, seconds")
    parser.add_argument("--seconds", type=float, default=10.0, help="steady stretch counted, seconds")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    rows = []
    header = (
        "| agents K | store requests/s, straggler off | on | step times' requests/s | per agent per window "
        "| step times' requests by op (per s) | re-rendezvous (off, on) |\n|---|---|---|---|---|---|---|"
    )
    for k in (int(x) for x in args.agents.split(",")):
        with (
            tempfile.TemporaryDirectory(prefix="fsm_bench_straggler_") as off_dir,
            tempfile.TemporaryDirectory(prefix="fsm_bench_straggler_") as on_dir,
        ):
            off, off_changes = measure(k, 0.0, args.seconds, Path(off_dir))
            on, on_changes = measure(k, args.window, args.seconds, Path(on_dir))

        def total(counts: collections.Counter) -> float:
            return sum(n for op, n in counts.items() if not op.startswith("step_times ")) / args.seconds

        steps = {op.split(" ", 1)[1]: n / args.seconds for op, n in sorted(on.items()) if op.startswith("step_times ")}
        step_rate = sum(steps.values())
        by_op = ", ".join(f"{op} {n:.1f}" for op, n in steps.items())
        row = (
            f"| {k} | {total(off):.1f} | {total(on):.1f} | {step_rate:.1f} | {step_rate * args.window / k:.2f} "
            f"| {by_op} | {off_changes}, {on_changes} |"
        )
        rows.append(row)
        print(row, flush=True)
    table = (
        "\n".join(
            [f"window {args.window:g} s, {args.seconds:g} s counted per run, fsm backend, loopback", "", header, *rows]
        )
        + "\n"
    )
    print("\n" + table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
