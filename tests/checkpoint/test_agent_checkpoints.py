"""Agent-held checkpoints end to end: real agents (``fsm-agent run``), real gloo workers
(``tests/fixtures/checkpoint_worker.py``: ``w == step + 1`` after each step, so a restored
checkpoint proves its own content), real ``/dev/shm`` and real disks.

* a worker SIGKILLed at a seeded random step resumes from this node's memory, repeating fewer
  steps than the checkpoint interval, and the cycle's checkpoint step is the restored one;
* a SIGKILLed node of a 2-node job: the hot spare restores its rank from the survivor's replica;
* every agent SIGKILLed (one of them while it persists): the disk holds only complete checkpoints,
  the keeper removes the shared memory, and the whole job started again restores from disk;
* a shared-memory checkpoint whose checksum does not match is skipped and reported, the disk used;
* a full ``--checkpoint-dir`` is one error line, training goes on, the end says so;
* a ``--checkpoint-memory`` larger than ``/dev/shm`` is one line at start.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsm_agent.checkpoint.slots import HEADER_AREA, Slot
from fsm_agent.testing.processes import remove_worker_cgroups, tmpdir_env, wait_until
from tests.conftest import free_port
from tests.helpers.events import read_events
from tests.helpers.processes import checkout_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORKER = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_worker.py"
SEED = int(os.environ.get("CHECKPOINT_TEST_SEED", "32"))


class Agents:
    """``fsm-agent run`` processes, each in a session of its own; killed by process group at the end
    (their workers by their cgroup's keeper, or by pid)."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs, self.out = tmp, {}, tmp / "out"
        self.out.mkdir(exist_ok=True)

    def start(
        self,
        name: str,
        flags: list[str],
        steps: int,
        every: int,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> subprocess.Popen:
        cmd = [
            *(prefix or []),
            sys.executable,
            "-m",
            "fsm_agent",
            "run",
            "--events-file",
            str(self.events_path(name)),
            "--monitor-interval",
            "0.1",
            *flags,
            str(WORKER),
            str(self.out),
            str(steps),
            str(every),
        ]
        environment = checkout_env(PYTHONUNBUFFERED="1", **tmpdir_env(self.tmp / "t"), **(env or {}))
        with open(self.tmp / f"{name}.err", "w") as err:
            proc = subprocess.Popen(
                cmd,
                cwd=self.tmp,
                env=environment,
                stdout=err,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def events_path(self, name: str) -> Path:
        return self.tmp / f"events_{name}.jsonl"

    def events(self, name: str, kind: str | None = None) -> list[dict]:
        records = read_events(self.events_path(name), while_written=True)
        return [e for e in records if kind is None or e["kind"] == kind]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text()

    def starts(self) -> list[dict]:
        path = self.out / "starts.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def steps(self, rank: int) -> list[tuple[int, int]]:
        path = self.out / f"steps-{rank}.txt"
        return [tuple(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []

    def kill(self, name: str) -> None:
        """A machine dying: SIGKILL the agent's process group (its keeper kills the workers' cgroup)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(30)

    def wait(self, name: str, timeout: float = 180) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {name} still running after {timeout} s:\n{self.log(name)}") from None

    def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        remove_worker_cgroups(p.pid for p in self.procs.values())


@pytest.fixture
def agents(tmp_path):
    made = Agents(tmp_path)
    yield made
    made.close()


@pytest.fixture
def shm_left_behind():
    """The checkpoint directories in /dev/shm that appeared during the test and are still there."""
    before = set(glob.glob("/dev/shm/fsm-agent-ckpt-*"))
    yield lambda: sorted(set(glob.glob("/dev/shm/fsm-agent-ckpt-*")) - before)
    for path in set(glob.glob("/dev/shm/fsm-agent-ckpt-*")) - before:
        shutil.rmtree(path, ignore_errors=True)


def single_node(*extra: str) -> list[str]:
    return ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *extra]


def test_a_worker_sigkilled_resumes_from_this_nodes_memory(agents, shm_left_behind):
    every = 5
    kill_at = random.Random(SEED).randrange(12, 40)
    agents.start(
        "a",
        single_node("--checkpoint-memory", "2MiB"),
        steps=60,
        every=every,
        env={"CKPT_KILL": f"1:0:{kill_at}", "CKPT_MB": "1"},
    )
    assert agents.wait("a") == 0, agents.log("a")
    restores = agents.events("a", "checkpoint_restore")
    assert restores[0]["step"] is None and restores[0]["reason"] == "no checkpoint held"  # the first start
    restored = restores[1]
    assert kill_at - every <= restored["step"] < kill_at, (kill_at, restored)
    assert [r["source"] for r in restored["ranks"]] == ["memory", "memory"], restored
    second = [s for s in agents.starts() if s["attempt"] == 1]
    assert sorted((s["rank"], s["start"], s["source"]) for s in second) == [
        (0, restored["step"] + 1, "memory"),
        (1, restored["step"] + 1, "memory"),
    ]
    repeated = [step for attempt, step in agents.steps(1) if attempt == 1 and step < kill_at]
    assert len(repeated) <= every, repeated  # no step before the kill repeated beyond the interval
    cycle = agents.events("a", "cycle")[0]
    assert cycle["checkpoint_step"] == restored["step"], cycle  # progress-aware restarts read it
    assert [step for _, step in agents.steps(0)][-1] == 59
    assert not shm_left_behind()


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def fsm_node(port: int, *extra: str) -> list[str]:
    return [
        "--nnodes",
        "2:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "fsm",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "checkpoint-spare",
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        "join_timeout=120",
        "--checkpoint-memory",
        "2MiB",
        *extra,
    ]


def test_the_hot_spare_restores_a_lost_nodes_rank_from_the_peers_replica(agents, shm_left_behind):
    port = free_port()
    env = {"CKPT_STEP_S": "0.05"}
    agents.start("a", fsm_node(port), steps=400, every=5, env=env)
    assert wait_until(lambda: listening(port), timeout=60), agents.log("a")  # a hosts the store
    agents.start("b", fsm_node(port), steps=400, every=5, env=env)
    # both ranks checkpointed and replicated to each other
    assert wait_until(
        lambda: agents.events("a", "checkpoint_replicated") and agents.events("b", "checkpoint_replicated"), timeout=90
    ), agents.log("a") + agents.log("b")
    agents.start("c", [*fsm_node(port), "--status-port", "0"], steps=400, every=5, env=env)
    assert wait_until(lambda: agents.events("c", "standby"), timeout=60), agents.log("c")
    b_rank = agents.events("b", "checkpoint_restore")[0]["workers"][0]["global_rank"]
    agents.kill("b")
    assert wait_until(lambda: agents.events("c", "checkpoint_restore"), timeout=90), agents.log("c")
    (restore,) = agents.events("c", "checkpoint_restore")
    (rank,) = restore["ranks"]
    assert rank["global_rank"] == b_rank and rank["source"] == "peer", restore
    assert restore["step"] is not None and restore["step"] >= 4
    # fsm-agent status says it too, while the spare's workers run
    url = re.search(r"status at (http://\S+)/status", agents.log("c")).group(1)
    shown = subprocess.run(
        [sys.executable, "-m", "fsm_agent", "status", url], capture_output=True, text=True, timeout=60
    )
    assert f"step {restore['step']}: rank {b_rank} from peer" in shown.stdout, shown.stdout + shown.stderr
    (survivor,) = [e for e in agents.events("a", "checkpoint_restore") if e["ts"] >= restore["ts"] - 60][-1:]
    assert survivor["step"] == restore["step"] and survivor["ranks"][0]["source"] == "memory", survivor
    assert agents.wait("a") == 0 and agents.wait("c") == 0, agents.log("a") + agents.log("c")
    assert any(s["source"] == "peer" and s["start"] == restore["step"] + 1 for s in agents.starts()), agents.starts()


def test_every_agent_killed_then_the_job_restores_from_disk(agents, shm_left_behind, tmp_path):
    """One agent is SIGKILLed while it persists a checkpoint (a temporary file is there): the disk
    holds complete checkpoints only, the keeper removes the agent's shared memory, and the job
    started again restores from the newest step both ranks have on disk."""
    ckpt = tmp_path / "ckpt"
    flags = single_node("--checkpoint-memory", "80MiB", "--checkpoint-dir", str(ckpt), "--checkpoint-keep", "3")
    agents.start("a", flags, steps=1000, every=5, env={"CKPT_MB": "64", "CKPT_STEP_S": "0.01"})
    assert wait_until(lambda: len(agents.events("a", "checkpoint_persisted")) >= 2, timeout=120), agents.log("a")
    assert wait_until(lambda: glob.glob(str(ckpt / "*" / "*.tmp-*")), timeout=60, interval=0.002), agents.log("a")
    agents.kill("a")
    assert wait_until(lambda: not shm_left_behind(), timeout=30), shm_left_behind()  # the keeper removed it
    complete = {}
    for manifest in glob.glob(str(ckpt / "*" / "*.json")):
        doc = json.loads(Path(manifest).read_text())
        data = Path(manifest[: -len(".json")] + ".ckpt")
        assert data.stat().st_size == doc["size"], manifest  # complete, never torn
        complete.setdefault(doc["step"], set()).add(doc["global_rank"])
    newest = max(step for step, ranks in complete.items() if ranks == {0, 1})
    os.remove(agents.events_path("a"))
    agents.start("a2", flags, steps=newest + 6, every=5, env={"CKPT_MB": "64", "CKPT_STEP_S": "0.01"})
    assert agents.wait("a2") == 0, agents.log("a2")
    restore = agents.events("a2", "checkpoint_restore")[0]
    assert restore["step"] == newest and [r["source"] for r in restore["ranks"]] == ["disk", "disk"], restore
    assert {(s["rank"], s["start"]) for s in agents.starts() if s["source"] == "disk"} == {
        (0, newest + 1),
        (1, newest + 1),
    }
    assert not shm_left_behind()


def newest_slots(shm: str) -> dict[int, tuple[str, object]]:
    """{global_rank: (slot file, header)} of the newest COMPLETE slot of each local worker."""
    newest = {}
    for path in glob.glob(f"{shm}/local-*-?"):
        slot = Slot.open(path)
        h = slot.header()
        if h.complete and (h.global_rank not in newest or h.seq > newest[h.global_rank][1].seq):
            newest[h.global_rank] = (path, h)
        slot.close()
    return newest


@pytest.mark.parametrize("disk", [True, False], ids=["then-disk", "then-older-step"])
def test_a_corrupted_memory_checkpoint_is_skipped(agents, shm_left_behind, tmp_path, disk):
    """One byte flipped in rank 1's newest checkpoint in shared memory, then rank 1 SIGKILLed: the
    restore finds the checksum wrong and says so; with ``--checkpoint-dir`` rank 1 takes the same
    step from disk, without it the job plans again and every rank restores the step before."""
    hold = agents.out / "hold"
    to_disk = ["--checkpoint-dir", str(tmp_path / "ckpt")] if disk else []
    agents.start("a", single_node("--checkpoint-memory", "2MiB", *to_disk), steps=40, every=5)

    def checksummed_at_step_9():
        shm = shm_left_behind()
        newest = newest_slots(shm[0]) if shm else {}
        return len(newest) == 2 and all(h.step >= 9 and h.has_checksum for _, h in newest.values())

    assert wait_until(checksummed_at_step_9, timeout=90), agents.log("a")
    hold.touch()  # the loop waits before its next step: no new saves
    time.sleep(1.0)
    (shm,) = shm_left_behind()
    path, header = newest_slots(shm)[1]
    assert header.has_checksum, header  # the agent recorded it (disk or not)
    with open(path, "r+b") as f:  # one byte flipped in rank 1's newest checkpoint
        f.seek(HEADER_AREA + header.payload_len // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    worker = [s for s in agents.starts() if s["rank"] == 1][-1]
    os.kill(worker["pid"], signal.SIGKILL)
    hold.unlink()
    assert agents.wait("a") == 0, agents.log("a")
    restore = agents.events("a", "checkpoint_restore")[-1]
    ranks = {r["global_rank"]: r for r in restore["ranks"]}
    assert "checksum mismatch" in agents.log("a")
    if disk:
        assert restore["step"] == header.step and ranks[0]["source"] == "memory", restore
        assert ranks[1]["source"] == "disk" and ranks[1]["skipped"][0]["source"] == "memory", restore
        assert "checksum mismatch" in ranks[1]["skipped"][0]["reason"]
    else:
        (failed,) = restore["failed"]
        assert failed["global_rank"] == 1 and failed["step"] == header.step, restore
        assert "checksum mismatch" in failed["skipped"][0]["reason"]
        assert restore["step"] == header.step - 5 and {r["source"] for r in ranks.values()} == {"memory"}, restore
    starts = [s for s in agents.starts() if s["attempt"] == 1]
    assert {s["start"] for s in starts} == {restore["step"] + 1}, starts  # one step for the whole job


def test_a_full_checkpoint_dir_is_one_line_and_training_goes_on(agents, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare (a private mount namespace for a small tmpfs)")
    ckpt = tmp_path / "full"
    ckpt.mkdir()
    # a 1 MiB tmpfs in the agent's own mount namespace: the first 2 MiB checkpoint does not fit
    mount = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount -t tmpfs -o size=1m none "{ckpt}" && exec "$@"',
        "sh",
    ]
    flags = single_node("--checkpoint-memory", "3MiB", "--checkpoint-dir", str(ckpt))
    agents.start("a", flags, steps=40, every=5, env={"CKPT_MB": "2"}, prefix=mount)
    assert agents.wait("a") == 0, agents.log("a")
    log = agents.log("a")
    errors = [line for line in log.splitlines() if "No space left on device" in line and "checkpoint:" in line]
    assert len(errors) == 1, log  # one line, however many saves failed to persist
    assert "checkpoint persistence failed" in log
    assert len(agents.events("a", "checkpoint_error")) == 1
    assert [step for _, step in agents.steps(0)][-1] == 39  # training went on
    assert not list(ckpt.iterdir())  # the mount went with the namespace


def test_an_unwritable_checkpoint_dir_is_one_line_and_training_goes_on(agents, tmp_path):
    """A --checkpoint-dir that cannot be made (a file where a folder should be): one error line at
    start, training goes on with the memory copies and their restores, the end says so."""
    (tmp_path / "a-file").write_text("")
    ckpt = tmp_path / "a-file" / "ckpt"
    flags = single_node("--checkpoint-memory", "2MiB", "--checkpoint-dir", str(ckpt))
    agents.start("a", flags, steps=40, every=5, env={"CKPT_KILL": "1:0:17"})
    assert agents.wait("a") == 0, agents.log("a")
    log = agents.log("a")
    errors = [line for line in log.splitlines() if "checkpoint:" in line and str(ckpt) in line]
    assert len(errors) == 1, log
    assert "checkpoint persistence failed" in log and "the newest checkpoint on disk is none" in log, log
    assert len(agents.events("a", "checkpoint_error")) == 1
    restore = agents.events("a", "checkpoint_restore")[-1]
    assert restore["step"] == 14 and {r["source"] for r in restore["ranks"]} == {"memory"}, restore
    assert [step for _, step in agents.steps(0)][-1] == 39


def test_checkpoint_memory_beyond_dev_shm_is_one_line_at_start(agents):
    agents.start("a", single_node("--checkpoint-memory", "1000TiB"), steps=1, every=1)
    code = agents.wait("a", timeout=120)
    log = agents.log("a")
    assert code != 0 and "Traceback" not in log, log
    (line,) = [line for line in log.splitlines() if "--checkpoint-memory" in line]
    assert "/dev/shm" in line and "needs" in line, line
