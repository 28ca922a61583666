"""Built-in plugin ``checkpoint``: checkpoints held by the agent in shared memory.

Off unless ``--checkpoint-memory SIZE`` (``FSM_AGENT_CHECKPOINT_MEMORY``, ``[plugins.checkpoint]
memory``; bytes per worker, ``1GiB``, ``512MiB``, ...) is set. Then the agent, at start:

- makes a directory in ``/dev/shm`` with one slot pair per local worker (``fsm_agent.checkpoint.slots``:
  two slots of SIZE, reserved now, so a full ``/dev/shm`` is one line at start and never a SIGBUS
  mid-training) and hands each worker its pair (``FSM_AGENT_CHECKPOINT_SLOTS``): the worker's
  ``fsm_agent.checkpoint.save(state, step=N)`` copies into it and returns. The agent removes the
  directory when it ends; its cgroup keeper does when the agent is SIGKILLed.
- with ``--checkpoint-replicas 1`` (the default) and more than one node possible, serves replicas
  (``fsm_agent.checkpoint.peers``) on this node's address (``--local-addr``, else the one that
  routes to the rendezvous endpoint).

While workers run, a background thread looks at the slots every ``POLL_INTERVAL_S`` seconds; each
new complete checkpoint is copied to the next node of the ring over the round's group ranks (its
replica), then written to ``--checkpoint-dir`` (``fsm_agent.checkpoint.disk``: temp file, fsync,
rename, manifest; the last ``--checkpoint-keep K`` steps kept), and its checksum recorded. An
unwritable or full directory is one error line; training goes on with the memory copies, and the
run's end says the disk copy stopped at which step.

At every rendezvous round (every restart and re-rendezvous), before the workers start, the agents
agree on a restore (``fsm_agent.checkpoint.restore``: the newest step every rank holds, from this
node's memory, a peer's, or the disk), stage it in each worker's slots (checksums checked: a
mismatch is skipped, reported, and the next source used) and tell the worker
(``FSM_AGENT_CHECKPOINT_RESTORE``): ``fsm_agent.checkpoint.load()`` returns it. The
``checkpoint_restore`` event and ``fsm-agent status`` say which source, which step; progress-aware
restarts read the newest checkpoint step from here instead of ``--progress-file``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from fsm_agent import tempdirs
from fsm_agent.checkpoint import PERSIST_ENV, RESTORE_ENV, SLOTS_ENV, disk, peers
from fsm_agent.checkpoint.restore import DISK, MEMORY, PEER, Inventory, Plan, Source, make_plan, successor
from fsm_agent.checkpoint.slots import (
    HEADER_AREA,
    PERSIST,
    Slot,
    SlotPair,
    checksum,
    format_bytes,
    read_consistent,
)
from fsm_agent.errors import ConfigError
from fsm_agent.hosts import advertised_address
from fsm_agent.plugins import hookimpl
from fsm_agent.worker import RunResult, Worker, WorkerGroup

if TYPE_CHECKING:
    from fsm_agent.config import LaunchConfig, OptionRegistry

log = logging.getLogger(__name__)
PLUGIN_NAME = "checkpoint"
SHM_ROOT = "/dev/shm"
#: How often the background thread looks for new checkpoints, seconds.
POLL_INTERVAL_S = 0.05
#: How long the agents of a round wait for each other's inventories and the plan, seconds.
EXCHANGE_TIMEOUT_S = 60.0
#: Rounds of plan-and-stage before the workers start without a checkpoint (a source that fails a
#: checksum is marked BAD or set aside, so the next plan takes another).
STAGE_ATTEMPTS = 3
#: The metric ``checkpoint.<verb>_s`` of each kind of copy.
_METRIC_VERB = {"replicated": "replicate", "persisted": "persist"}
#: After a failed replica transfer, the replicate loop waits this long before the next, seconds.
REPLICA_BACKOFF_S = 10.0
#: A replica transfer's socket timeout, seconds.
PEER_TIMEOUT_S = 60.0
_KEY = "fsm_agent/checkpoint"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2}
_UNITS |= {"g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes from ``text``: an integer with an optional unit (``KiB``, ``MiB``, ``GiB``, ``TiB`` or
    the decimal ``KB``, ``MB``, ``GB``, ``TB``); ``""`` and ``0`` are 0 (off).

    Raises:
        ValueError: not such a size.
    """
    if not str(text).strip():
        return 0
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a size in bytes such as 1GiB, 512MiB or 1073741824, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def _size_check(value: str) -> None:
    parse_size(value)


def _keep_check(value: int) -> None:
    if value < 1:
        raise ValueError(f"expected a count >= 1, got {value}")


def _replicas_check(value: int) -> None:
    if value not in (0, 1):
        raise ValueError(f"expected 0 (no replica) or 1 (one peer holds a copy), got {value}")


#: (option, type, default, check, help); each is flag ``--checkpoint-<option>`` and env
#: ``FSM_AGENT_CHECKPOINT_<OPTION>``.
OPTIONS = (
    (
        "memory",
        str,
        "",
        _size_check,
        "shared memory per worker for checkpoints held by the agent (e.g. 1GiB); the largest "
        "checkpoint a worker saves; empty or 0: off",
    ),
    ("dir", str, "", None, "directory the agent persists each in-memory checkpoint to, in the background"),
    ("keep", int, 2, _keep_check, "checkpoints (steps) kept in --checkpoint-dir per rank"),
    ("replicas", int, 1, _replicas_check, "1: each node's checkpoints are copied to the next node's agent; 0: not"),
)


@hookimpl
def fsm_agent_addoption(options: OptionRegistry) -> None:
    for name, kind, default, check, text in OPTIONS:
        options.add(name, type=kind, default=default, check=check, help=text)


@hookimpl
def fsm_agent_configure(config: LaunchConfig | None, agent: Any) -> None:
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    capacity = parse_size(options.get("memory") or "")
    directory = options.get("dir") or ""
    if not capacity:
        if directory:
            raise ConfigError(
                f"--checkpoint-dir {directory}: needs --checkpoint-memory SIZE (the largest checkpoint "
                f"a worker saves, e.g. 1GiB): the agent persists what workers save in its memory"
            )
        return
    keeper = CheckpointKeeper(
        agent,
        capacity,
        directory=directory or None,
        keep=int(options.get("keep") or 2),
        replicas=int(options.get("replicas", 1)) if agent.spec.rendezvous.max_nodes > 1 else 0,
    )
    agent.plugin_manager.register(keeper, f"{PLUGIN_NAME}-{id(agent)}")


def shm_needed(capacity: int, local_world_size: int, replicas: int) -> int:
    """Bytes of ``/dev/shm`` a node needs: two slots per local worker, and as many again for the
    replicas of the previous node's workers (as many as this node's, in a homogeneous job)."""
    return 2 * (HEADER_AREA + capacity) * local_world_size * (1 + replicas)


class CheckpointKeeper:
    """One agent's checkpoint memory, replica server, background copier and restore staging."""

    def __init__(self, agent: Any, capacity: int, *, directory: str | None, keep: int, replicas: int):
        self._agent, self.capacity, self.replicas = agent, capacity, replicas
        spec = agent.spec
        self._check_shm(capacity, spec.local_world_size, replicas)
        self.disk = None if not directory else disk.DiskCheckpoints(directory, keep)
        self._persist_error: str | None = None
        self._persist_failure_recorded = False
        if directory:
            try:
                disk.check_dir(directory)
            except disk.PersistError as exc:  # the memory copies still work: say it once and go on
                log.error("checkpoint: %s; training goes on with the memory copies", exc)
                self._persist_error = str(exc)
        self.shm_dir = tempfile.mkdtemp(prefix="fsm-agent-ckpt-", dir=SHM_ROOT)
        tempdirs.remove_if_the_agent_dies(self.shm_dir)
        try:
            self.pairs = [
                SlotPair.create(os.path.join(self.shm_dir, f"local-{i}"), capacity, reserve=True)
                for i in range(spec.local_world_size)
            ]
        except OSError as exc:
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            raise ConfigError(
                f"--checkpoint-memory {format_bytes(capacity)}: cannot reserve it in {SHM_ROOT} ({exc.strerror}); "
                f"it needs {format_bytes(shm_needed(capacity, spec.local_world_size, replicas))}"
            ) from None
        self.server: peers.ReplicaServer | None = None
        self._address: tuple[str, int] | None = None  # the replica server's, once it listens
        self._replicas: dict[str, SlotPair] = {}
        self._lock = threading.Lock()
        self._restores: dict[int, str] = {}
        self._persisted_seq: dict[int, int] = {}  # the persist loop's progress: {local_rank: seq}
        self._replicated_seq: dict[int, int] = {}  # the replicate loop's, reset for a new successor
        self._replica_pause_until = 0.0
        self._target: tuple[str, int] | None = None
        self._generation = 0
        self._persisted_step: dict[int, int] = {}
        self._view: dict[str, Any] = {"dir": directory, "memory_bytes": capacity, "restore": None}
        if self._persist_error is not None:
            self._view["persist_error"] = self._persist_error
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        agent.track_checkpoints(self.checkpoint_step)

    # -- start ---------------------------------------------------------------------------------
    @staticmethod
    def _check_shm(capacity: int, local_world_size: int, replicas: int) -> None:
        needed = shm_needed(capacity, local_world_size, replicas)
        try:
            st = os.statvfs(SHM_ROOT)
        except OSError as exc:
            raise ConfigError(f"--checkpoint-memory: {SHM_ROOT} is not usable ({exc.strerror})") from None
        free = st.f_bavail * st.f_frsize
        if free < needed:
            raise ConfigError(
                f"--checkpoint-memory {format_bytes(capacity)}: {SHM_ROOT} has {format_bytes(free)} free, needs "
                f"{format_bytes(needed)} (2 slots x {local_world_size} workers"
                + (" x 2 with replicas" if replicas else "")
                + "): enlarge /dev/shm (docker --shm-size, a memory-backed emptyDir) or lower --checkpoint-memory"
            )

    def _start_background(self) -> None:
        if self._threads:
            return
        if self.replicas:
            host = self._agent.spec.local_addr or advertised_address(self._agent.rdzv_endpoint) or "127.0.0.1"
            self.server = peers.ReplicaServer(
                self.shm_dir, self.capacity, self._token(), host=host, local_lookup=self._find_local
            )
            self.server.start()
            self._address = (host, self.server.port)
        # Two loops: a slow or dead peer never holds up the disk copies (nor the saves waiting on them)
        self._threads = [
            threading.Thread(target=self._persist_loop, name="fsm-agent-checkpoint-persist", daemon=True),
            threading.Thread(target=self._replicate_loop, name="fsm-agent-checkpoint-replicate", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _token(self) -> str:
        return str(self._agent.spec.rendezvous.run_id)

    # -- hooks ---------------------------------------------------------------------------------
    @hookimpl
    def fsm_agent_rendezvous_completed(self, worker_group: WorkerGroup, duration_s: float) -> None:
        self._start_background()
        started = time.monotonic()
        plan: Plan | None = None
        ranks: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []  # the earlier attempts' failed stagings, for the record
        reason = ""
        try:
            for _ in range(STAGE_ATTEMPTS):
                self._restores = {}  # this round's, staged below
                plan = self._exchange(worker_group)
                ranks = self._stage_all(worker_group, plan)
                if self._agree(worker_group, all(r["source"] is not None for r in ranks)):
                    reason = plan.reason
                    break
                # A source failed on some node (and is marked BAD or set aside now): plan again.
                failed += [{**r, "step": plan.step} for r in ranks if r["source"] is None]
            else:
                reason = f"staging failed on some node {STAGE_ATTEMPTS} times: the workers start without a checkpoint"
                self._restores, plan = {}, None
        except Exception as exc:  # a peer gone mid-exchange: start without a restore, say so
            log.error("checkpoint: no restore this round: the agents' exchange failed: %s", exc)
            self._restores, plan, reason = {}, None, f"exchange failed: {exc}"
        if plan is not None:
            self._follow_the_ring(worker_group, plan)
            self._abandon_after(plan, worker_group)
        elif reason:
            log.error("checkpoint: no restore this round: %s", reason)
        self._report_restore(plan, ranks if plan is not None else [], time.monotonic() - started, reason, failed)

    def _stage_all(self, group: WorkerGroup, plan: Plan) -> list[dict[str, Any]]:
        """Stage ``plan`` for every local worker, side by side (each is mostly a checksum and a copy)."""
        if plan.step is None:
            return []
        with ThreadPoolExecutor(max(1, len(group.workers))) as pool:
            return list(pool.map(lambda worker: self._stage(worker, plan), group.workers))

    def _follow_the_ring(self, group: WorkerGroup, plan: Plan) -> None:
        """Replicate to this round's successor from now on (and send it the newest checkpoints)."""
        rank, size = group.group_rank or 0, group.group_world_size or 1
        nxt = successor(rank, size)
        if self.server is not None:  # keep the replicas of the ranks the predecessor runs now
            previous = (rank - 1) % size
            for name in [n for n in self._replicas if int(n.rsplit("-", 1)[1]) not in plan.runs.get(previous, ())]:
                self._replicas.pop(name).close()
            dropped = self.server.keep_only(plan.runs.get(previous, ()) if previous != rank else ())
            if dropped:
                log.info("checkpoint: dropped the replicas of ranks %s (no longer the predecessor's)", dropped)
        with self._lock:
            self._target = plan.addresses.get(nxt) if nxt is not None and nxt != rank else None
            self._replicated_seq = {}  # the newest checkpoints go to the new successor too
            self._replica_pause_until = 0.0

    @hookimpl
    def fsm_agent_worker_env(self, worker: Worker, worker_group: WorkerGroup) -> dict[str, str]:
        env = {SLOTS_ENV: os.path.join(self.shm_dir, f"local-{worker.local_rank}")}
        if self.disk is not None:
            env[PERSIST_ENV] = "1"  # save's default: persist
        if worker.local_rank in self._restores:
            env[RESTORE_ENV] = self._restores[worker.local_rank]
        return env

    @hookimpl
    def fsm_agent_unconfigure(self, result: RunResult) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=PEER_TIMEOUT_S)
        if self.server is not None:
            self.server.close()
        for pair in [*self.pairs, *self._replicas.values()]:
            pair.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        tempdirs.forget(self.shm_dir)
        if self._persist_error is not None:
            steps = sorted(self._persisted_step.values())
            log.error(
                "checkpoint persistence failed: %s; the newest checkpoint on disk is %s",
                self._persist_error,
                f"step {steps[0]}" if steps else "none from this run",
            )

    # -- the round's exchange and the restore --------------------------------------------------
    def _exchange(self, group: Any) -> Plan:
        """Publish this agent's inventory; group rank 0 makes the plan; every agent reads it."""
        store, rank, size = group.store, group.group_rank, group.group_world_size
        world = group.workers[0].world_size
        # Each agent of a round adds 1 once: the same generation for all of them, whether the store
        # is the round's own (fsm, c10d) or lives across restarts (static).
        self._generation = (int(store.add(f"{_KEY}/arrivals", 1)) - 1) // size
        prefix = f"{_KEY}/{self._generation}"
        store.set(f"{prefix}/inv/{rank}", self._inventory(group).to_json())
        timeout = timedelta(seconds=EXCHANGE_TIMEOUT_S)
        if rank == 0:
            keys = [f"{prefix}/inv/{r}" for r in range(size)]
            store.wait(keys, timeout)
            plan = make_plan([Inventory.from_json(raw) for raw in store.multi_get(keys)], world)
            store.set(f"{prefix}/plan", plan.to_json())
            return plan
        store.wait([f"{prefix}/plan"], timeout)
        return Plan.from_json(store.get(f"{prefix}/plan"))

    def _agree(self, group: Any, staged: bool) -> bool:
        """Whether every agent of the round staged all its workers' checkpoints (group rank 0
        reads every agent's answer and publishes the verdict)."""
        store, rank, size = group.store, group.group_rank, group.group_world_size
        prefix = f"{_KEY}/{self._generation}"
        store.set(f"{prefix}/staged/{rank}", "1" if staged else "0")
        timeout = timedelta(seconds=EXCHANGE_TIMEOUT_S)
        if rank == 0:
            keys = [f"{prefix}/staged/{r}" for r in range(size)]
            store.wait(keys, timeout)
            verdict = "ok" if all(raw in (b"1", "1") for raw in store.multi_get(keys)) else "again"
            store.set(f"{prefix}/verdict", verdict)
            return verdict == "ok"
        store.wait([f"{prefix}/verdict"], timeout)
        return store.get(f"{prefix}/verdict") in (b"ok", "ok")

    def _inventory(self, group: Any) -> Inventory:
        memory = set()
        for pair in [*self.pairs, *self._replica_pairs()]:
            for slot in pair.slots:
                h = slot.header()
                if h.complete:
                    memory.add((h.global_rank, h.world_size, h.step))
        on_disk = []
        if self.disk is not None:
            try:
                on_disk = [(g, w, e.step) for (g, w), entries in self.disk.scan().items() for e in entries]
            except OSError as exc:
                if self._persist_error is None:  # said once already otherwise
                    log.warning("checkpoint: cannot scan --checkpoint-dir: %s", exc)
        return Inventory(
            group_rank=group.group_rank,
            address=self._address,
            runs=tuple(w.global_rank for w in group.workers),
            memory=tuple(sorted(memory)),
            disk=tuple(sorted(on_disk)),
        )

    def _replica_pairs(self) -> list[SlotPair]:
        """The replica pairs the server made so far (each mapped once here, kept until the end)."""
        for name in sorted(os.listdir(self.shm_dir)):
            if name.startswith("replica-") and name.endswith("-a") and name[:-2] not in self._replicas:
                try:
                    self._replicas[name[:-2]] = SlotPair.open(os.path.join(self.shm_dir, name[:-2]))
                except Exception:  # being made by the server now: seen next time
                    continue
        return list(self._replicas.values())

    def _find_local(self, global_rank: int, world_size: int, step: int) -> Slot | None:
        for pair in self.pairs:
            found = pair.find(step, global_rank, world_size)
            if found is not None:
                return found[0]
        return None

    def _stage(self, worker: Any, plan: Plan) -> dict[str, Any]:
        """Put ``plan.step`` of the worker's global rank in its slots, from the first source that
        checks out; remember the slot for its environment. Returns the ``checkpoint_restore``
        record's entry for it."""
        g, step, world = worker.global_rank, plan.step, plan.world_size
        assert step is not None
        pair = self.pairs[worker.local_rank]
        skipped: list[dict[str, str]] = []
        started = time.monotonic()
        for source in plan.sources.get(g, ()):
            try:
                slot, reason = self._stage_from(source, pair, g, world, step)
            except Exception as exc:
                slot, reason = None, str(exc)
            if slot is not None:
                self._restores[worker.local_rank] = f"{step}:{source.kind}:{slot.path}"
                return {
                    "local_rank": worker.local_rank,
                    "global_rank": g,
                    "source": source.kind,
                    "holder": source.holder,
                    "seconds": round(time.monotonic() - started, 4),
                    "skipped": skipped,
                }
            log.error("checkpoint: rank %s step %s from %s skipped: %s", g, step, source.kind, reason)
            skipped.append({"source": source.kind, "reason": reason})
        self._restores.pop(worker.local_rank, None)
        return {"local_rank": worker.local_rank, "global_rank": g, "source": None, "skipped": skipped}

    def _stage_from(self, source: Source, pair: SlotPair, g: int, world: int, step: int) -> tuple[Slot | None, str]:
        """(the slot of ``pair`` now holding the checkpoint, or None; why not)."""
        if source.kind == MEMORY:
            return self._stage_from_memory(pair, g, world, step)
        if source.kind == PEER and source.address is not None:
            result = peers.fetch(source.address, self._token(), g, world, step, pair, timeout=PEER_TIMEOUT_S)
            if result.header is None:
                return None, result.reason or "not fetched"
            return self._slot_of(pair, g, world, step), ""
        if source.kind == DISK and self.disk is not None:
            entry = next((e for e in self.disk.scan().get((g, world), []) if e.step == step), None)
            if entry is None:
                return None, "not on disk any more"
            if self.disk.read_into(entry, pair) is None:
                os.replace(entry.manifest_path, entry.manifest_path + ".corrupt")  # kept, never planned again
                return None, f"checksum mismatch in {entry.path} (its manifest renamed *.corrupt)"
            return self._slot_of(pair, g, world, step), ""
        return None, f"no such source here: {source.kind}"

    @staticmethod
    def _slot_of(pair: SlotPair, g: int, world: int, step: int) -> Slot | None:
        found = pair.find(step, g, world)
        return None if found is None else found[0]

    def _stage_from_memory(self, pair: SlotPair, g: int, world: int, step: int) -> tuple[Slot | None, str]:
        reason = "not in this node's memory"
        for candidate in [pair, *(p for p in self.pairs if p is not pair), *self._replica_pairs()]:
            found = candidate.find(step, g, world)
            if found is None:
                continue
            slot, header = found
            value = checksum(slot.payload, header.payload_len)
            if header.has_checksum and value != header.checksum:
                slot.mark_bad(header.seq)
                reason = f"checksum mismatch in shared memory {os.path.basename(slot.path)}"
                continue
            slot.set_checksum(header.seq, value)
            if candidate is pair:
                return slot, ""
            target = pair.begin_write(step, g, world)
            target.payload[: header.payload_len] = slot.payload[: header.payload_len]
            target.commit(header.payload_len, checksum=value)
            return target, ""
        return None, reason

    def _abandon_after(self, plan: Plan, group: Any) -> None:
        """Drop every checkpoint of this world newer than the restored step (in memory: all of them
        when none is restored), in memory and, for this node's ranks, on disk: they are of a timeline
        the job left, and a save of the same step number later must never meet one of them in a
        restore (rank 0's new step 20 beside rank 1's old step 20)."""
        after = -1 if plan.step is None else plan.step
        for pair in [*self.pairs, *self._replica_pairs()]:
            for slot in pair.slots:
                h = slot.header()
                if h.complete and h.world_size == plan.world_size and h.step > after:
                    slot.discard(h.seq)
        if self.disk is not None and plan.step is not None:  # no step: the disk is left as it is
            for worker in group.workers:
                try:
                    self.disk.discard_after(worker.global_rank, after)
                except OSError as exc:  # an unusable directory: its one error line was given
                    log.debug("checkpoint: cannot drop newer steps on disk: %s", exc)

    def _report_restore(
        self,
        plan: Plan | None,
        ranks: list[dict[str, Any]],
        seconds: float,
        reason: str,
        failed: list[dict[str, Any]],
    ) -> None:
        fields = {
            "step": None if plan is None else plan.step,
            "world_size": None if plan is None else plan.world_size,
            "ranks": ranks,
            "seconds": round(seconds, 4),
            "reason": reason or None,
            "failed": failed,
        }
        self._agent.record_event("checkpoint_restore", **fields)
        self._view["restore"] = fields
        self._agent.report_checkpoints(self._view)
        for entry in ranks:
            if entry["source"] is not None:
                log.info(
                    "checkpoint: rank %s restores step %s from %s",
                    entry["global_rank"],
                    fields["step"],
                    entry["source"],
                )

    # -- background: replicate, persist --------------------------------------------------------
    def checkpoint_step(self) -> int | None:
        """The newest step every local worker has a complete checkpoint of (None: some has none):
        what progress-aware restarts read as the cycle's checkpoint step."""
        steps = []
        for pair in self.pairs:
            newest = pair.newest()
            if newest is None:
                return None
            steps.append(newest[1].step)
        return min(steps) if steps else None

    def _persist_loop(self) -> None:
        """Every new complete checkpoint, oldest first: written to disk when the worker asked for
        it, its checksum recorded, then the slot released (``set_persisted``) for the worker's next
        save into it."""
        while not self._stop.wait(POLL_INTERVAL_S):
            for local_rank, pair in enumerate(self.pairs):
                done = self._persisted_seq.get(local_rank, 0)
                fresh = sorted(
                    ((h.seq, slot, h) for slot in pair.slots if (h := slot.header()).complete and h.seq > done),
                    key=lambda item: item[0],
                )
                for seq, slot, header in fresh:
                    if header.flags & PERSIST:
                        self._persist(slot)
                    slot.set_persisted(seq)  # written or given up: the worker may reuse the slot
                    self._record_checksum(slot, seq)
                    self._persisted_seq[local_rank] = seq

    def _replicate_loop(self) -> None:
        """The newest complete checkpoint of each local worker, to the ring's successor; after a
        failed transfer, none for ``REPLICA_BACKOFF_S`` seconds."""
        while not self._stop.wait(POLL_INTERVAL_S):
            if time.monotonic() < self._replica_pause_until:
                continue
            for local_rank, pair in enumerate(self.pairs):
                newest = pair.newest()
                if newest is None or self._replicated_seq.get(local_rank) == newest[1].seq:
                    continue
                self._replicated_seq[local_rank] = newest[1].seq
                if not self._replicate(newest[0]):
                    self._replica_pause_until = time.monotonic() + REPLICA_BACKOFF_S
                    self._replicated_seq.pop(local_rank, None)  # tried again after the pause
                    break

    @staticmethod
    def _record_checksum(slot: Slot, seq: int) -> None:
        """Compute and record the checksum of write ``seq`` if neither copy did (no peer, no
        disk): a restore from this node's memory compares against it."""
        header = slot.header()
        if header.seq != seq or header.has_checksum:
            return
        read = read_consistent(slot, lambda piece: None)
        if read is not None:
            slot.set_checksum(read[0].seq, read[1])

    def _replicate(self, slot: Slot) -> bool:
        """Send ``slot``'s checkpoint to the successor; False when the transfer failed."""
        with self._lock:
            target = self._target
        if target is None:
            return True
        try:
            sent = peers.send_replica(target, self._token(), slot, timeout=PEER_TIMEOUT_S)
        except peers.PeerError as exc:
            log.warning("checkpoint: replica not sent: %s", exc)
            self._agent.record_event("checkpoint_error", what="replicate", message=str(exc))
            return False
        if sent is None:
            return True  # overwritten while sending: the next save is sent instead
        slot.set_checksum(sent.seq, sent.checksum)  # nothing when the slot holds another save now
        if not sent.ok:
            log.warning("checkpoint: replica of rank %s step %s refused: %s", sent.global_rank, sent.step, sent.reason)
            return False
        self._report_copy(
            "replicated", sent.global_rank, sent.step, sent.bytes, sent.seconds, peer=f"{target[0]}:{target[1]}"
        )
        return True

    def _report_copy(self, what: str, global_rank: int, step: int, size: int, seconds: float, **where: str) -> None:
        """A ``checkpoint_<what>`` event and the metric ``checkpoint.<verb>_s`` of one copy made."""
        self._agent.record_event(
            f"checkpoint_{what}", global_rank=global_rank, step=step, bytes=size, seconds=round(seconds, 4), **where
        )
        self._agent.put_metric("fsm_agent", f"checkpoint.{_METRIC_VERB[what]}_s", seconds)

    def _persist(self, slot: Slot) -> None:
        if self.disk is None:
            return
        try:
            done = self.disk.persist(slot, self._token())
        except disk.PersistError as exc:
            if self._persist_error is None:  # one line, however many saves fail to persist
                log.error("checkpoint: %s; training goes on with the memory copies", exc)
            if not self._persist_failure_recorded:
                self._agent.record_event("checkpoint_error", what="persist", message=str(exc))
                self._persist_failure_recorded = True
            self._persist_error = str(exc)
            self._view["persist_error"] = str(exc)
            self._agent.report_checkpoints(self._view)
            return
        if done is None:
            return
        self._persisted_step[done.global_rank] = done.step
        self._view["persisted"] = dict(sorted(self._persisted_step.items()))
        self._agent.report_checkpoints(self._view)
        self._report_copy("persisted", done.global_rank, done.step, done.size, done.seconds, path=done.path)
