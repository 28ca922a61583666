"""The agent's side of in-process restart: host the round's store, begin a generation, watch its barrier.

One ``InProcessRecovery`` per agent, off until ``--restart-mode inprocess`` turns it on (the
``inprocess`` plugin calls ``ElasticAgent.restart_in_process``). Then, each round, the agent of
group rank 0 hosts a torch ``TCPStore`` at the round's ``MASTER_ADDR:MASTER_PORT`` (the workers
are its clients, ``TORCHELASTIC_USE_AGENT_STORE=True``, as torch's agent store) and every agent
connects to it when a fault asks. The keys and what they mean: ``fsm_agent.inprocess.protocol``.

When a worker of this node fails and the table chooses ``recovers_in_process``, the agent calls
:meth:`InProcessRecovery.begin` (the next generation: the survivors everywhere are interrupted),
replaces the failed workers' processes, and the run loop asks :meth:`InProcessRecovery.look`
until every rank has arrived at that generation's barrier (``InProcessRecovered``) or
``--inprocess-timeout`` seconds passed (``InProcessFailed``: the whole-group restart, as today).
Only the agent that began a generation watches it; the others' workers simply take part.

Imports torch lazily (the store), and only when in-process restart is on.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import attrs

from fsm_agent.inprocess import protocol
from fsm_agent.states.facts import InProcessFailed, InProcessRecovered

log = logging.getLogger(__name__)

#: Seconds between looks at the barrier while a recovery runs (a store ``check``, this node only).
LOOK_INTERVAL_S = 0.02
#: Seconds an agent waits to connect to the round's in-process store before it gives up on it (no
#: in-process recovery for this fault; a recovery running waits for its deadline): the run loop
#: waits that long, so short.
CONNECT_TIMEOUT_S = 1.0
#: At most this long (seconds) the agent's end waits for the background import of torch.distributed
#: (``enable``): long enough for a loaded machine, short enough not to hold a stop.
IMPORT_WAIT_S = 10.0


@attrs.define
class Recovery:
    """One in-process recovery this agent began.

    Attributes:
        generation: the generation it began.
        replaced: ``{local_rank: global_rank}`` of the workers replaced.
        fault_at: when the first failed worker's exit was seen (seconds since the epoch).
        began_at: when the agent began the generation (seconds since the epoch).
        spawned_at: when the new processes were started (seconds since the epoch), or None.
        deadline: ``time.monotonic()`` past which the recovery failed.
        failure: why it cannot complete, when that is known before the deadline, else None.
    """

    generation: int
    replaced: dict[int, int]
    fault_at: float
    began_at: float
    deadline: float
    spawned_at: float | None = None
    #: Why it cannot complete, known before its deadline (a step that failed to replace a worker).
    failure: str | None = None
    #: Why its store could not be read (then it is not asked again: the deadline decides).
    unreachable: str | None = None

    def phases(self, now: float) -> dict[str, float]:
        """Seconds of each phase: ``detect`` (exit seen -> generation begun), ``replace`` (begun
        -> new processes started), ``barrier`` (started -> every rank arrived), ``total``."""
        spawned = self.spawned_at if self.spawned_at is not None else self.began_at
        return {
            "detect_s": round(max(0.0, self.began_at - self.fault_at), 4),
            "replace_s": round(spawned - self.began_at, 4),
            "barrier_s": round(max(0.0, now - spawned), 4),
            "total_s": round(max(0.0, now - self.fault_at), 4),
        }


class InProcessRecovery:
    """The agent's in-process recovery service (see the module docstring)."""

    def __init__(self) -> None:
        self.enabled = False
        self.timeout_s = 30.0
        self.current: Recovery | None = None
        #: ``{global_rank: time.monotonic()}`` when a recovery that replaced it completed.
        self._recovered_at: dict[int, float] = {}
        self._server: Any = None
        self._client: Any = None
        self._endpoint: tuple[str, int] | None = None
        self._prefix = ""
        self._world_size = 0
        self._replayed_generations = 0
        self._importing: threading.Thread | None = None  # torch.distributed's import, begun by enable

    def enable(self, timeout_s: float) -> None:
        """Turn in-process restart on; ``timeout_s``: seconds a recovery may take (fault -> barrier).

        Starts importing ``torch.distributed`` in the background: each round needs it
        (``new_round``), and its import takes a second or more. A hot spare imports it while it
        waits, not after it took a lost node's seat, when every other agent of the round waits
        for it (measured: the round's checkpoint exchange took 1.0-1.3 s instead of 0.04-0.1 s)."""
        self.enabled, self.timeout_s = True, float(timeout_s)
        if self._importing is None:
            self._importing = threading.Thread(
                target=_import_torch_distributed, name="fsm-inprocess-import", daemon=True
            )
            self._importing.start()

    # -- each round and attempt -----------------------------------------------------------------
    def new_round(self, host: str, port: int, is_host: bool) -> None:
        """A round completed: the agent of group rank 0 (``is_host``) serves the in-process store
        at ``host:port`` (a new server when the address changed); every agent connects lazily."""
        if not self.enabled:
            return
        _import_torch_distributed()  # now, not at the first fault (begun in the background by enable)

        self._drop_client()
        self._endpoint = (host, int(port))
        if is_host:  # a new server each round: a new round never reads an earlier one's keys
            self.close()
            from torch.distributed import TCPStore  # type: ignore[attr-defined]  # lazy: only with in-process restart

            self._server = TCPStore(
                host, int(port), None, True, timedelta(seconds=self.timeout_s), wait_for_workers=False
            )
            log.info("in-process restart: serving the workers' store on port %s", port)
        elif self._server is not None:
            self.close()

    def new_attempt(self, run_id: str, restart_count: int, world_size: int) -> None:
        """The workers of a new attempt start (a whole-group start or restart): no recovery runs."""
        self.current, self._recovered_at = None, {}
        self._prefix = protocol.attempt_prefix(run_id, restart_count)
        self._world_size = world_size

    def worker_env(self) -> dict[str, str]:
        """What every worker of the attempt gets (none while in-process restart is off)."""
        if not self.enabled or self._endpoint is None:
            return {}
        host, port = self._endpoint
        return {
            protocol.ENV_STORE: f"{host}:{port}",
            protocol.ENV_PREFIX: self._prefix,
            protocol.ENV_TIMEOUT: f"{self.timeout_s:g}",
            protocol.ENV_GENERATION: "0",
        }

    # -- a fault ----------------------------------------------------------------------------------
    def why_not(self, failed_global_ranks: list[int], launcher_replaces: bool) -> str | None:
        """Why this fault cannot be recovered in process (one line), or None when it can."""
        if not self.enabled:
            return "in-process restart is off"
        if not launcher_replaces:
            return "the launcher cannot replace one worker (replace_workers)"
        if self.current is not None:
            return f"a second fault during the recovery of generation {self.current.generation}"
        now = time.monotonic()
        again = [r for r in failed_global_ranks if now - self._recovered_at.get(r, -1e9) < self.timeout_s]
        if again:
            return f"rank {again[0]} failed again within {self.timeout_s:g}s of its replacement"
        try:
            enrolled = self._store().add(protocol.ENROLLED, 0)
        except Exception as exc:  # the store host went with its node: the whole group restarts
            return f"the in-process store is unreachable: {type(exc).__name__}: {exc}"
        if enrolled < self._world_size:
            return f"not every rank runs fsm_agent.inprocess.run ({enrolled} of {self._world_size} enrolled)"
        return None

    def begin(self, replaced: dict[int, int], fault_at: float) -> Recovery:
        """Begin the next generation for the workers ``replaced`` (``{local_rank: global_rank}``)
        whose first exit was seen at ``fault_at`` (seconds since the epoch): the survivors of
        every node are interrupted. Returns the recovery; its generation goes in the new
        processes' ``FSM_AGENT_INPROCESS_GENERATION``.

        Raises:
            Exception: the store's error (unreachable): the caller ``abandon``s the recovery.
        """
        if self.enabled:
            store = self._store()
            generation = int(store.add(protocol.GENERATION, 1))
            store.set(protocol.replaced_key(generation), json.dumps(sorted(replaced.values())))
            store.set(protocol.begun_key(generation), b"1")
        else:  # a replay of a recorded run: no store, no workers; the record alone
            generation = self._replayed_generations = self._replayed_generations + 1
        self.current = Recovery(
            generation=generation,
            replaced=dict(replaced),
            fault_at=fault_at,
            began_at=time.time(),
            deadline=time.monotonic() + self.timeout_s,
        )
        return self.current

    def abandon(self, replaced: dict[int, int], fault_at: float, why: str) -> None:
        """The recovery of ``replaced`` cannot go on (``why``: a worker could not be replaced, the
        generation could not begin): the next :meth:`look` reports it failed, so the whole
        group restarts."""
        if self.current is None:
            now = time.time()
            self.current = Recovery(
                generation=0, replaced=dict(replaced), fault_at=fault_at, began_at=now, deadline=time.monotonic()
            )
        self.current.failure = why

    def seconds_to_next_look(self) -> float | None:
        """How long the run loop may wait before :meth:`look` (None: no recovery to watch)."""
        return LOOK_INTERVAL_S if self.current is not None else None

    def look(self) -> InProcessRecovered | InProcessFailed | None:
        """The recovery's end as a fact: ``InProcessRecovered`` once every rank arrived at its
        generation's barrier, ``InProcessFailed`` past its deadline or with its store gone; None
        while it runs, or when none does."""
        recovery = self.current
        if recovery is None:
            return None
        if recovery.failure is not None:
            return self._end(recovery, recovery.failure)
        if recovery.unreachable is None and self._barrier_state(recovery) == protocol.READY:
            return self._end(recovery, None)
        if time.monotonic() >= recovery.deadline:
            return self._end(
                recovery,
                f"not every rank reached the barrier of generation {recovery.generation} within "
                f"{self.timeout_s:g}s (--inprocess-timeout)"
                + (f"; its store is unreachable: {recovery.unreachable}" if recovery.unreachable else ""),
            )
        return None

    def _barrier_state(self, recovery: Recovery) -> bytes:
        """The state of the recovery's generation (following a newer one: another node's fault
        meanwhile); b"" while undecided, or when the store is unreachable (then noted and not asked
        again: its host's node is lost, and that membership change, not this, decides)."""
        try:
            store = self._store()
            recovery.generation = max(recovery.generation, int(store.add(protocol.GENERATION, 0)))
            key = protocol.state_key(recovery.generation)
            return bytes(store.get(key)) if store.check([key]) else b""
        except Exception as exc:
            recovery.unreachable = f"{type(exc).__name__}: {exc}"
            log.warning("in-process recovery: its store is unreachable: %s", recovery.unreachable)
            return b""

    def _end(self, recovery: Recovery, failure: str | None) -> InProcessRecovered | InProcessFailed:
        self.current = None
        phases = recovery.phases(time.time())
        if failure is not None:
            return InProcessFailed(
                reason=failure, generation=recovery.generation, replaced=recovery.replaced, phases=phases
            )
        now = time.monotonic()
        for global_rank in recovery.replaced.values():
            self._recovered_at[global_rank] = now
        return InProcessRecovered(generation=recovery.generation, replaced=recovery.replaced, phases=phases)

    # -- the store --------------------------------------------------------------------------------
    def _store(self) -> Any:
        """This attempt's keys on the round's store (a client, connected on first use)."""
        from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

        if self._client is None:
            if self._endpoint is None:
                raise RuntimeError("no round yet")
            host, port = self._endpoint
            # A plain connect first: refused at once when nothing listens, where torch's client
            # retries after a random backoff of seconds past its timeout (seen: 4.2 s for 1 s).
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
            self._client = TCPStore(
                host, port, None, False, timedelta(seconds=CONNECT_TIMEOUT_S), wait_for_workers=False
            )
        return PrefixStore(self._prefix, self._client)

    def _drop_client(self) -> None:
        self._client = None

    def close(self) -> None:
        """Stop serving the store (the agent ends, or another node hosts the next round's)."""
        self._drop_client()
        self._server = None
        if self._importing is not None:  # an interpreter that ends amid an extension's import can crash
            self._importing.join(IMPORT_WAIT_S)
            if self._importing.is_alive():
                log.warning("in-process restart: torch.distributed still importing after %g s", IMPORT_WAIT_S)


def _import_torch_distributed() -> None:
    """Import ``torch.distributed`` (a second or more); a second caller waits for the first's import."""
    import torch.distributed  # noqa: F401
