"""Real pods on one machine with podman: ``podman kube play`` of pod manifests, no control plane.

A :class:`PodNet` is one test's private podman: its own storage (``CONTAINERS_STORAGE_CONF``: graph
root and run root in a temporary directory of the test's), its own ``containers.conf``
(``CONTAINERS_CONF``: runc with cgroupfs, the ulimits and the file events logger this machine
needs, podman's temporary directory, and the CNI configuration directory), one CNI bridge network
of its own (bridge ``fsmk<tag>``, a random 10.89.x.0/24, IPAM state in the test's directory, no
masquerade, no firewall or port-map plugin: no iptables rule is written) and one image.

**The image.** The manifests run ``image: fsm-agent-train:latest``. Here it is
``localhost/fsm-agent-train:latest``, made by ``podman import`` of a tar of a few kilobytes (empty
mount points, the usr-merge links, ``/etc/passwd``, ``group``, ``nsswitch.conf``, ``ld.so.cache``),
``WORKDIR /app`` with ``/app/examples`` a link to the checkout's ``examples/``, and ``PATH``
starting with the host Python's ``bin``. What a real image would hold comes from the host,
read-only, through ``containers.conf``'s ``volumes`` (which podman adds to every container, so the
manifests keep no volume of the test's): ``/usr``, the Python prefix (fsm-agent installed editable,
torch), the checkout, and the test's directory (read-write: the workers' records, the agents'
events). ``podman run --rootfs`` has no ``kube play`` equivalent; this is its equivalent.

**The controllers.** Nothing runs the Job, JobSet, PyTorchJob or Trainer controllers: each test
builds the pod each would create (``pod_of``), from the manifest's pod template and the additions
the controller (and the kubelet, cluster DNS) would make, each named by the caller:

* ``annotations``: e.g. ``batch.kubernetes.io/job-completion-index``, ``jobset.sigs.k8s.io/*``;
  read by the manifest's own downward-API ``env`` (podman resolves ``fieldRef`` to annotations);
* ``env``: the Job controller's ``JOB_COMPLETION_INDEX``, an operator's ``PET_*``, the kubelet's
  ``KUBERNETES_SERVICE_HOST``/``PORT``;
* ``hostname`` (and the pod name): what the Job controller sets (``<job>-<index>``);
* ``hostAliases``: cluster DNS for the headless Services' names (no DNS server runs; the pods'
  IPs are chosen before they start, ``podman kube play --ip``).

**Teardown**, also after a failure (:meth:`PodNet.destroy`): every pod this object played is
removed by name (``podman pod rm -f``, which stops its containers and their conmon), its image
removed, its network removed and its bridge deleted if podman left it, then the storage is reset
(``podman system reset``, which unmounts it) and the directory deleted. It then checks that no
pod, container, bridge, network namespace or mount of its own is left. The one file written
outside the test's directory is podman's (containers/image's) cache of blob digests,
``/var/lib/containers/cache/blob-info-cache-v1.boltdb``, which ``podman import`` updates.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "kubernetes"
IMAGE = "localhost/fsm-agent-train:latest"
#: What the kubelet sets in every container of every pod (the cluster's API Service).
KUBELET_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
#: Generous: a loaded 2-core machine starts a torch worker in seconds.
PODMAN_TIMEOUT_S = 120.0
#: Tries of a ``podman inspect`` that met its container's process exiting (``PodNet.inspect``).
INSPECT_RETRIES = 5


def skip_or_fail_without_podman() -> None:
    """Skip with one line where podman is missing, except under CI, where the lane must run."""
    missing = [tool for tool in ("podman", "runc", "conmon") if shutil.which(tool) is None]
    if not missing and os.geteuid() == 0 and sys.platform == "linux":
        return
    reason = (
        f"{', '.join(missing)} not installed (bash .ci/install-podman.sh)"
        if missing
        else "real pods need root on Linux (podman with CNI bridge networks)"
    )
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI: the kubernetes lane cannot run: {reason}")
    pytest.skip(reason)


def _image_tar(path: Path) -> None:
    """The image's own file system: mount points, the usr-merge links, a few files of /etc."""
    now = int(time.time())
    with tarfile.open(path, "w") as tar:

        def add(name: str, kind: bytes, mode: int = 0o755, link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime, info.linkname = kind, mode, now, link
            tar.addfile(info)

        for folder in ("usr", "root", "work", "proc", "sys", "dev", "etc", "run", "var", "app", "home"):
            add(folder, tarfile.DIRTYPE)
        add("tmp", tarfile.DIRTYPE, 0o1777)
        add("var/tmp", tarfile.DIRTYPE, 0o1777)
        for link in ("bin", "sbin", "lib", "lib64"):
            if os.path.islink(f"/{link}"):
                add(link, tarfile.SYMTYPE, link=os.readlink(f"/{link}"))
        add("app/examples", tarfile.SYMTYPE, link=str(ROOT / "examples"))
        for name in ("/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/ld.so.cache"):
            if os.path.exists(name):
                tar.add(name, name[1:])


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


class PodNet:
    """One test's pods on one private bridge network (see the module docstring)."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        # Not pytest's tmp_path (kept after the run): everything here is removed at teardown.
        self.dir = Path(tempfile.mkdtemp(prefix=f"fsmk8s-{self.tag}-"))
        self.shared = self.dir / "shared"  # mounted read-write in every container, same path
        self.shared.mkdir()
        self.network = f"fsmk8s-{self.tag}"
        self.bridge = f"fsmk{self.tag}"
        self.subnet = random.randint(2, 254)
        self.gateway = f"10.89.{self.subnet}.1"
        self._next_ip = 10
        self.pods: dict[str, Path] = {}  # pod name -> its manifest file
        self.sandboxes: set[str] = set()  # the network namespaces podman made for our pods
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(self.dir / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.dir / "storage.conf"),
        }
        self.env.pop("CONTAINER_HOST", None)

    # -- set up ----------------------------------------------------------------------------------
    def create(self) -> None:
        prefixes = sorted({os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)})
        volumes = ["/usr:/usr:ro", f"{ROOT}:{ROOT}:ro", f"{self.shared}:{self.shared}:rw"]
        volumes += [f"{p}:{p}:ro" for p in prefixes if not p.startswith("/usr/")]
        (self.dir / "tmp").mkdir()
        (self.dir / "cni").mkdir()
        (self.dir / "containers.conf").write_text(
            "[containers]\n"
            'default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n'
            f"volumes = {_toml_list(volumes)}\n"
            "[engine]\n"
            'cgroup_manager = "cgroupfs"\n'
            'runtime = "runc"\n'
            'events_logger = "file"\n'
            f'tmp_dir = "{self.dir / "tmp"}"\n'
            "[network]\n"
            f'network_config_dir = "{self.dir / "cni"}"\n'
            f'default_network = "{self.network}"\n'
        )
        (self.dir / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{self.dir / "root"}"\nrunroot = "{self.dir / "run"}"\n'
        )
        conflist = {
            "cniVersion": "0.4.0",
            "name": self.network,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(self.dir / "ipam"),
                        "ranges": [[{"subnet": f"10.89.{self.subnet}.0/24", "gateway": self.gateway}]],
                    },
                    "capabilities": {"ips": True},
                },
            ],
        }
        (self.dir / "cni" / f"{self.network}.conflist").write_text(json.dumps(conflist, indent=1))
        tar = self.dir / "image.tar"
        _image_tar(tar)
        bin_dir = os.path.dirname(os.path.realpath(sys.executable))
        self.podman(
            "import",
            "--change",
            "WORKDIR=/app",
            "--change",
            f"ENV=PATH={bin_dir}:/usr/local/bin:/usr/bin:/bin",
            str(tar),
            IMAGE,
        )

    # -- podman ----------------------------------------------------------------------------------
    def podman(self, *args: str, check: bool = True, timeout: float = PODMAN_TIMEOUT_S) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def new_ip(self) -> str:
        self._next_ip += 1
        return f"10.89.{self.subnet}.{self._next_ip}"

    def play(self, pod: dict, ip: str) -> str:
        """``podman kube play --network <ours> --ip IP`` of one pod; returns its name."""
        name = pod["metadata"]["name"]
        assert name not in self.pods, f"pod {name} played twice: names are unique per test"
        path = self.dir / f"{name}.yaml"
        import yaml

        path.write_text(yaml.safe_dump(pod, sort_keys=False))
        self.pods[name] = path
        self.podman("kube", "play", "--network", self.network, "--ip", ip, str(path))
        infra = self.podman("pod", "inspect", name, "--format", "{{.InfraContainerID}}").stdout.strip()
        key = self.podman("inspect", infra, "--format", "{{.NetworkSettings.SandboxKey}}").stdout.strip()
        if key:
            self.sandboxes.add(key)
        return name

    def kube_down(self, name: str) -> subprocess.CompletedProcess:
        """``podman kube down <the pod's manifest>``: stops and removes the pod. podman 4.3.1 stops
        it with a timeout of 0 (``PodStopOptions{}``): SIGKILL at once, no grace period."""
        return self.podman("kube", "down", str(self.pods[name]), timeout=PODMAN_TIMEOUT_S + 60)

    def containers_of(self, name: str) -> list[str]:
        """The pod's own containers (not its infra container)."""
        listing = self.podman("ps", "-a", "--filter", f"pod={name}", "--format", "{{.Names}} {{.IsInfra}}").stdout
        return [line.split()[0] for line in listing.splitlines() if line.split()[1:] == ["false"]]

    def stop(self, name: str, grace_s: float) -> float:
        """What the kubelet does to a deleted (evicted, preempted, drained) pod: SIGTERM to each of
        its containers, SIGKILL to those still running ``grace_s`` later
        (``terminationGracePeriodSeconds``), and only then the sandbox (the infra container and the
        pod's network). Returns the seconds until the last container exited.

        Not ``podman kube down`` (SIGKILL at once) nor ``podman pod stop -t`` (podman 4.3.1 stops
        the infra container with the others, so the pod's network is gone while they shut down):
        :meth:`pod_stop`."""
        containers = self.containers_of(name)
        started = time.monotonic()
        for container in containers:
            self.podman("kill", "--signal", "TERM", container)
        deadline = started + grace_s
        while time.monotonic() < deadline and any(self.state(c)["Running"] for c in containers):
            time.sleep(0.05)
        took = time.monotonic() - started
        for container in containers:
            if self.state(container)["Running"]:
                self.podman("kill", "--signal", "KILL", container, check=False)
        self.podman("pod", "stop", "-t", "0", name)
        return took

    def pod_stop(self, name: str, grace_s: int) -> subprocess.CompletedProcess:
        """``podman pod stop -t GRACE``: SIGTERM, SIGKILL after ``GRACE`` s; the pod's network (its
        infra container) is torn down at the same time, unlike the kubelet."""
        return self.podman("pod", "stop", "-t", str(grace_s), name, timeout=PODMAN_TIMEOUT_S + grace_s)

    def died(self, container: str) -> list[int]:
        """The exit codes of ``container``'s ends, from podman's event log (also after removal)."""
        proc = self.podman(
            "events",
            "--stream=false",
            "--filter",
            f"container={container}",
            "--filter",
            "event=died",
            "--format",
            "{{.ContainerExitCode}}",
        )
        return [int(code) for code in proc.stdout.split()]

    def delete(self, name: str) -> None:
        """The pod is gone at once (SIGKILL): a node lost, or a pod force-deleted."""
        self.podman("pod", "rm", "-f", "-t", "0", name)

    def inspect(self, container: str, template: str) -> str:
        """``podman inspect --format TEMPLATE``. Podman reads the container's process while it
        exits and can fail for that instant ("read /proc/PID/cgroup: no such process", seen on a
        loaded CI machine): that answer is asked again, a few times, not taken as an error."""
        for _ in range(INSPECT_RETRIES):
            proc = self.podman("inspect", container, "--format", template, check=False)
            if proc.returncode == 0:
                return proc.stdout.strip()
            if "no such process" not in proc.stderr:
                break
            time.sleep(0.1)
        return self.podman("inspect", container, "--format", template).stdout.strip()  # its error, as any call's

    def state(self, container: str) -> dict:
        return json.loads(self.inspect(container, "{{json .State}}"))

    def restarts(self, container: str) -> int:
        return int(self.inspect(container, "{{.RestartCount}}"))

    def ip_of(self, name: str) -> str:
        infra = self.podman("pod", "inspect", name, "--format", "{{.InfraContainerID}}").stdout.strip()
        return self.inspect(infra, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")

    def logs(self, container: str) -> str:
        proc = self.podman("logs", container, check=False)
        return proc.stdout + proc.stderr

    def wait_exited(self, container: str, timeout: float = 180.0) -> int:
        """Poll until ``container`` has exited for good (not restarting); returns its exit code."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(container)
            if state["Status"] == "exited" and not state.get("Restarting"):
                return int(state["ExitCode"])
            if time.monotonic() > deadline:
                raise AssertionError(f"{container} still {state['Status']} after {timeout:.0f}s\n{self.diagnostics()}")
            time.sleep(0.2)

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.diagnostics()}")
            time.sleep(0.1)

    def diagnostics(self) -> str:
        text = ""
        for name in self.pods:
            listing = self.podman("ps", "-a", "--pod", "--filter", f"pod={name}", "--format", "{{.Names}}", check=False)
            for container in listing.stdout.split():
                if container.endswith("-infra"):
                    continue
                status = self.podman("inspect", container, "--format", "{{json .State}}", check=False).stdout.strip()
                text += f"--- {container}: {status[:300]}\n{self.logs(container)[-4000:]}\n"
        return text

    # -- teardown --------------------------------------------------------------------------------
    def destroy(self) -> None:
        problems = []
        for name in self.pods:
            self.podman("pod", "rm", "-f", "-t", "0", name, check=False)
        left = self.podman("pod", "ps", "-a", "--format", "{{.Name}}", check=False).stdout.split()
        left += self.podman("ps", "-a", "--format", "{{.Names}}", check=False).stdout.split()
        if left:
            problems.append(f"pods/containers left: {left}")
        self.podman("rmi", "-a", "-f", check=False)
        self.podman("network", "rm", "-f", self.network, check=False)
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)  # the CNI bridge plugin keeps it
        self.podman("system", "reset", "--force", check=False, timeout=PODMAN_TIMEOUT_S)
        for key in self.sandboxes:
            if os.path.exists(key):
                problems.append(f"network namespace left: {key}")
        with open("/proc/self/mountinfo") as mounts:
            ours = [line.split()[4] for line in mounts if str(self.dir) in line.split()[4]]
        for point in reversed(ours):  # should be none: system reset unmounts the storage
            subprocess.run(["umount", "-l", point], capture_output=True)
        if ours:
            problems.append(f"mounts left: {ours}")
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.dir.exists():
            problems.append(f"directory left: {self.dir}")
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
            problems.append(f"bridge left: {self.bridge}")
        assert not problems, "; ".join(problems)


@contextlib.contextmanager
def pod_net():
    skip_or_fail_without_podman()
    net = PodNet()
    try:
        net.create()
        yield net
    finally:
        net.destroy()


# -- the pods the controllers would create ---------------------------------------------------------
def documents(name: str) -> dict[str, dict]:
    import yaml

    return {doc["kind"]: doc for doc in yaml.safe_load_all((EXAMPLES / name).read_text())}


def downward(annotation: str) -> dict:
    """An ``env`` entry's ``valueFrom`` reading one of the pod's annotations (the downward API)."""
    return {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{annotation}']"}}}


def pod_of(
    template: dict,
    name: str,
    hostname: str,
    *,
    annotations: dict[str, str] | None = None,
    env: dict[str, str | dict] | None = None,
    overrides: dict[str, str] | None = None,
    dns: dict[str, str] | None = None,
    subdomain: str | None = None,
    restart_policy: str | None = None,
    command: list[str] | None = None,
) -> dict:
    """A ``v1/Pod`` from a manifest's pod template (``{metadata?, spec}``) plus the named additions.

    ``env`` ({name: value, or a ``valueFrom`` dict: :func:`downward`}) is appended to the (single)
    container's own ``env`` and may not name one of the manifest's variables; ``overrides``
    replaces the value of manifest variables (a change of the test's, named where used), as do
    ``restart_policy`` and ``command`` (another worker script). ``dns`` ({name: IP}) becomes
    ``hostAliases``. The container's ``ports`` are dropped: podman 4.3 publishes a
    ``containerPort`` on the host even without a ``hostPort`` (Kubernetes does not: it is
    informational), so two pods of one manifest would collide on the host's port.
    """
    spec = copy.deepcopy(template["spec"])
    (container,) = spec["containers"]
    own = {item["name"] for item in container.get("env", [])}
    clash = own & set(env or {})
    assert not clash, f"the manifest already sets {clash}: use overrides"
    missing = set(overrides or {}) - own
    assert not missing, f"the manifest does not set {missing}"
    container_env = []
    for item in container.get("env", []):
        if item["name"] in (overrides or {}):
            item = {"name": item["name"], "value": overrides[item["name"]]}
        container_env.append(item)
    for key, value in (env or {}).items():
        container_env.append({"name": key, **(value if isinstance(value, dict) else {"value": value})})
    container["env"] = container_env
    if command is not None:
        container["command"] = command
    container.pop("ports", None)
    spec["hostname"] = hostname
    if subdomain:
        spec["subdomain"] = subdomain
    if dns:
        spec["hostAliases"] = [{"ip": ip, "hostnames": [host]} for host, ip in dns.items()]
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    metadata = {"name": name, "annotations": dict(annotations or {})}
    labels = (template.get("metadata") or {}).get("labels")
    if labels:
        metadata["labels"] = dict(labels)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def container_name(pod: dict) -> str:
    """podman names a played pod's container ``<pod>-<container>``."""
    return f"{pod['metadata']['name']}-{pod['spec']['containers'][0]['name']}"
