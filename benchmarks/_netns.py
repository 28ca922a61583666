"""Hosts made of network namespaces for the benchmarks (``goodput.py --netns``, ``checkpoint.py``'s
replication), on the topology the multi-host tests use: ``tests/netns.py``'s ``NetnsHosts``.

That is: N namespaces, host ``i`` with a veth ``IFNAME`` at ``.addrs[i]`` in one private
10.231.x.0/24, the veths' peers plugged into one bridge in a switch namespace of its own; nothing
is created in the root namespace, so the addresses cannot clash with this machine's. What the
benchmarks add here (``Hosts``): the hosts made and removed in one ``with`` (removed however the
block ends, an error or Ctrl-C included: every process still in them SIGKILLed by pid, then the
namespaces deleted by the names made, which deletes their veths and the bridge), a command's argv
run inside one host and its environment, every link's MTU, and whether a process listens on a port
of its own namespace.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.netns import IFNAME, NetnsHosts  # noqa: E402

__all__ = ["Hosts", "NetnsUnavailable", "hosts"]


class NetnsUnavailable(RuntimeError):
    """The namespaces could not be made on this machine (not root, no ``ip``, no permission, no
    veth or bridge support); the message says which command failed and why."""


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30).stdout


class Hosts(NetnsHosts):
    """``NetnsHosts`` (host ``i``: namespace ``.names[i]``, address ``.addrs[i]``) with what the
    benchmarks start their own processes with."""

    def inside(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run in host ``host``'s namespace (``ip netns exec`` execs it: the pid is the same)."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    @staticmethod
    def env() -> dict[str, str]:
        """What a job's processes need in a namespace: gloo on the veth (the hostname, shared with
        the root namespace, resolves to no address of a namespace)."""
        return {"GLOO_SOCKET_IFNAME": IFNAME}

    def set_mtu(self, mtu: int) -> None:
        """Every link between the hosts at ``mtu`` bytes: each host's ``IFNAME`` and its bridge port (a
        veth drops a frame larger than its peer's MTU, the bridge one larger than the port it leaves
        by; the bridge's own MTU follows its ports')."""
        for line in _ip("-n", self.switch, "-o", "link", "show", "type", "veth").splitlines():
            port = line.split(":")[1].strip().split("@")[0]
            _ip("-n", self.switch, "link", "set", port, "mtu", str(mtu))
        for name in self.names:
            _ip("-n", name, "link", "set", IFNAME, "mtu", str(mtu))

    @staticmethod
    def listens(pid: int, port: int) -> bool:
        """Whether a socket of ``pid``'s network namespace listens on TCP ``port``. From the root
        namespace neither a connect() nor psutil (which reads this process's own ``/proc/net``) sees
        into another namespace; ``/proc/PID/net/tcp`` is that namespace's table (state ``0A``: LISTEN)."""
        for table in ("tcp", "tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        return True
        return False


@contextlib.contextmanager
def hosts(count: int) -> Iterator[Hosts]:
    """``count`` namespaced hosts, removed when the block ends, however it ends (and the scratch
    folder ``NetnsHosts`` keeps a few files in, under ``$TMPDIR``)."""
    with tempfile.TemporaryDirectory(prefix="bench-netns-") as scratch:
        made = Hosts(Path(scratch), count=count)
        try:
            try:
                made.create()
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
                command = " ".join(map(str, exc.cmd)) if isinstance(exc, subprocess.SubprocessError) else "ip"
                detail = (getattr(exc, "stderr", None) or str(exc)).strip()
                raise NetnsUnavailable(f"cannot make network namespaces ({command}): {detail}") from exc
            yield made
        finally:
            made.destroy()
