"""A node's drain: the requests, the looks for one, the announcement to the round, the orderly stop.

The ``drain`` plugin (``fsm_agent/plugins/drain.py``) declares the options and hands the agent
their ``DrainSettings``; the statechart's ``drain_requested`` rows name the agent's steps
(``_decide_on_drain``, ``_announce_drain``, ``_drain_workers``), which call this room. A drain
is asked for by a drain signal, the ``--drain-file``, ``POST /drain``, the Python API, or a peer's
job-wide drain read from the round's rendezvous store; the agent's run loop fires it.
(torch has no drain: a preempted torchrun job is a failure.)

A peer's job-wide drain (``JOB_DRAIN_KEY``): where the round's store can tell of a key's changes
(``subscribe``: the ``fsm`` backend's membership watch carries the key, held by the store), the
agent asks the store only when it says the key changed, so an idle agent makes no request for
it; elsewhere (``c10d``, ``etcd-v3``, ``static``) it looks every ``job_drain_look_interval``.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from fsm_agent import job_verdict
from fsm_agent.errors import ConfigError
from fsm_agent.interrupts import Interrupts, empty_pipe
from fsm_agent.store_looks import STORE_LOOKS_PER_S, look_interval
from fsm_agent.worker import DRAIN_EXIT_CODE, DRAIN_SCOPES, DrainSettings, WorkerGroup

log = logging.getLogger(__name__)

#: The rendezvous-store key (in the round's store, shared by its agents) of a job-wide drain.
JOB_DRAIN_KEY = "fsm_agent/drain/job"
#: The same store's count of nodes that left the round (a node drain, or a stop signal such as a
#: preemption's SIGTERM), written before their workers stop: a peer's workers that fail meanwhile
#: (a collective with the departed node) are a membership change, not a failure.
NODE_DRAIN_KEY = "fsm_agent/drain/nodes"
#: Seconds a leaving node's announcement may take before its workers are stopped anyway.
ANNOUNCE_LEAVING_WAIT_S = 1.0
#: Peers that saw the job-wide drain count themselves here, so its announcer (maybe the store's
#: host, c10d) waits for them before it leaves and takes the store along.
JOB_DRAIN_SEEN_KEY = "fsm_agent/drain/job_seen"
#: At most this long (seconds) the announcer of a job-wide drain waits for every peer to see it.
JOB_DRAIN_SEEN_WAIT_S = 30.0
#: Seconds between looks at the --drain-file (a local stat) while the workers run; also the
#: shortest time between two looks at the store for a peer's job-wide drain.
DRAIN_POLL_S = 0.5
#: Looks for a peer's job-wide drain that the whole job makes per second at its rendezvous store.
#: Every agent looks once per ``job_drain_look_interval`` seconds, so the store's load stays flat in
#: the number of nodes (10,000 nodes: 1,000 requests/s, not 20,000 at ``DRAIN_POLL_S``).
JOB_DRAIN_LOOKS_PER_S = STORE_LOOKS_PER_S
#: The longest time (seconds) between two looks: well within ``JOB_DRAIN_SEEN_WAIT_S``, so that an
#: announcer still sees every peer see its drain before it leaves.
JOB_DRAIN_LOOK_MAX_S = JOB_DRAIN_SEEN_WAIT_S / 3


def job_drain_look_interval(group_world_size: int) -> float:
    """Seconds between one agent's looks at the rendezvous store for a job-wide drain, in a job of
    ``group_world_size`` nodes: ``group_world_size / JOB_DRAIN_LOOKS_PER_S``, at least
    ``DRAIN_POLL_S`` and at most ``JOB_DRAIN_LOOK_MAX_S``. (torch has no job-wide drain.) A lost
    peer (the announcer leaving) still makes every agent look at once."""
    return look_interval(group_world_size, DRAIN_POLL_S, JOB_DRAIN_LOOK_MAX_S)


def _shared(group: WorkerGroup) -> bool:
    """Whether the round has a store and other nodes to tell or to look at."""
    return group.store is not None and (group.group_world_size or 0) > 1


class NodeDrain:
    """One agent's drain: the pending request (any thread may make one), the one taken, and the
    work the statechart's ``drain_requested`` steps do.

    Args:
        role: the worker role, for log lines.
        wake_w: the write end of the agent's wake-up pipe: a request wakes its run loop.
    """

    def __init__(self, role: str, wake_w: int) -> None:
        self.settings = DrainSettings()
        #: the request the run loop has not fired yet (scope, source, by), set by any thread
        self.request: dict[str, str] | None = None
        #: the drain the run took (``_decide_on_drain``): scope, source, by, ts, then how the stop went
        self.taken: dict[str, Any] | None = None
        #: the blocking call running now may be cut short by a drain signal (a rendezvous)
        self.interruptible = False
        #: no request is taken any more (the run released what it held)
        self.closed = False
        #: the job's verdict record a peer published when it gave the job up (``job_verdict``): the
        #: job-wide key says "job failed", not "drain"; the run loop fires ``job_failed`` with it
        self.peer_verdict: dict[str, Any] | None = None
        self._role = role
        self._wake_w = wake_w
        self._lock = threading.RLock()  # RLock: a drain signal may arrive while the loop holds it
        self._next_check = 0.0
        self._next_job_look: float | None = None  # None: at a random phase of the first interval
        #: the round's store that tells this drain of the job-wide key's changes (None: look)
        self._subscribed: Any = None
        self._tried_store: Any = None  # the store a subscription was last asked of
        #: the store said the job-wide key changed since the last look at it
        self._store_news = False
        #: the store said a peer announced it leaves the round (``NODE_DRAIN_KEY``), not looked at yet
        self._leaving_news = False

    def configure(self, settings: DrainSettings, stop_signals: list[int], forwarded: list[int]) -> None:
        """Take ``settings`` (the ``drain`` plugin's). See ``ElasticAgent.drain_on``.

        Raises:
            ConfigError: a drain signal is also a stop signal or a forwarded one.
            ValueError: the scope is unknown.
        """
        if settings.scope not in DRAIN_SCOPES:
            raise ValueError(f"drain scope {settings.scope!r} is not one of {', '.join(DRAIN_SCOPES)}")
        for sig in settings.signals:
            for flag, taken in (("--signals-to-handle", stop_signals), ("--forward-signals", forwarded)):
                if sig in taken:
                    name = signal.Signals(sig).name
                    meaning = (
                        "stops the job, torchrun's meaning" if flag == "--signals-to-handle" else "goes to the workers"
                    )
                    raise ConfigError(
                        f"--drain-signals {name}: {name} is both a drain signal and in {flag} (it {meaning}): "
                        f"give --drain-signals another signal (e.g. SIGUSR2), or leave {name} out of {flag}"
                    )
        self.settings = settings

    def ask(self, scope: str | None = None, source: str = "api", by: str = "") -> bool:
        """Request a drain (see ``ElasticAgent.request_drain``); True if this request was taken.

        Raises:
            ValueError: ``scope`` is neither ``node`` nor ``job``.
        """
        scope = scope or self.settings.scope
        if scope not in DRAIN_SCOPES:
            raise ValueError(f"drain scope {scope!r} is not one of {', '.join(DRAIN_SCOPES)}")
        with self._lock:
            if self.request is not None or self.taken is not None or self.closed:
                return False
            self.request = {"scope": scope, "source": source, "by": by}
        try:
            os.write(self._wake_w, b"d")  # wake the run loop
        except OSError:  # the pipe is full (the loop wakes anyway) or closed (the run ended)
            pass
        return True

    def take(self, scope: str | None, source: str | None, by: str | None) -> dict[str, Any]:
        """Make the request (the ``drain_requested`` data) this run's drain; returns it.

        Raises:
            ValueError: ``scope`` is neither ``node`` nor ``job``.
        """
        scope = str(scope or self.settings.scope)
        if scope not in DRAIN_SCOPES:
            raise ValueError(f"drain_requested: scope {scope!r} is not one of {', '.join(DRAIN_SCOPES)}")
        self.taken = {"scope": scope, "source": str(source or "api"), "by": str(by or ""), "ts": time.time()}
        log.warning("[%s] draining (%s scope), requested by %s %s", self._role, scope, self.taken["source"], by or "")
        return self.taken

    @property
    def whole_job(self) -> bool:
        """The drain taken is job-wide (scope ``job``), not this node's alone."""
        return self.taken is not None and self.taken["scope"] == "job"

    # -- looking for a drain ---------------------------------------------------------------------
    def watches(self, group: WorkerGroup) -> bool:
        """While the workers run: look for the drain file, and for a peer's job-wide drain in a job of
        several nodes."""
        return bool(self.settings.file) or _shared(group)

    def seconds_to_next_look(self) -> float:
        """Seconds until ``look_if_due`` or ``peer_leaving`` has something to do (0: now)."""
        return 0.0 if self._store_news or self._leaving_news else max(0.0, self._next_check - time.monotonic())

    def look_if_due(self, group: WorkerGroup, healthy: bool) -> None:
        """The run loop's periodic look (every ``DRAIN_POLL_S`` s): the drain file, and the store
        for a peer's job-wide drain when the store said its key changed (``subscribe``) or, from a
        store that cannot say, when this agent's turn of ``job_drain_look_interval`` has come."""
        now = time.monotonic()
        self._subscribe(group)
        news = self._store_news and healthy
        if now >= self._next_check or news:
            self._next_check = now + DRAIN_POLL_S
            self._store_news = self._store_news and not news
            self.look(group, healthy, peers=news or self._job_look_due(group, now))

    def _subscribe(self, group: WorkerGroup) -> None:
        """Ask the round's store, once per store, to tell of the job-wide key's changes and of a
        peer's announcement that it leaves (``peer_leaving``)."""
        store = group.store
        if store is self._tried_store or not _shared(group):
            return
        self._tried_store, self._subscribed = store, None
        self._leaving_news = False
        subscribe = getattr(store, "subscribe", None)
        try:
            if callable(subscribe) and subscribe(JOB_DRAIN_KEY, functools.partial(self._on_store_news, store, False)):
                self._subscribed = store
                subscribe(NODE_DRAIN_KEY, functools.partial(self._on_store_news, store, True))
        except Exception as exc:  # then this agent looks on its own schedule
            log.debug("could not subscribe to the drain keys: %s", exc)

    def _on_store_news(self, store: Any, leaving: bool) -> None:
        """The store says the job-wide key changed, or (``leaving``) the key of a peer's
        announcement that it leaves (called on the rendezvous keep-alive thread): wake the run
        loop, whose next ``look_if_due`` or ``peer_leaving`` looks. Never blocks."""
        with self._lock:
            if self.closed or store is not self._subscribed:
                return
            if leaving:
                self._leaving_news = True
            else:
                self._store_news = True
            try:
                os.write(self._wake_w, b"j")
            except OSError:  # the pipe is full (the loop wakes anyway)
                pass

    def peer_leaving(self, group: WorkerGroup) -> bool:
        """Whether the store just told of a peer's announcement that it leaves the round (a stop
        signal, a node drain), confirmed by a look at the key. The round cannot go on without that
        node: a membership change now, not once its workers have stopped and it has left the
        rendezvous (under ``--restart-mode inprocess`` no worker here fails meanwhile, they wait for
        a new generation). Only from a store that tells of the key (``subscribe``): no extra looks.
        (News of an earlier round's store never counts: ``_subscribe`` clears it for a new store,
        and ``_on_store_news`` ignores any store but the one subscribed.)"""
        if not self._leaving_news:
            return False
        self._leaving_news = False
        return self.peer_left(group)

    def _job_look_due(self, group: WorkerGroup, now: float) -> bool:
        """Whether this look also asks the store for a peer's job-wide drain; schedules the next.
        Never for a store that tells of the key's changes itself. Agents look at random phases
        (spread over the first interval, then jittered by +-50 %) so that nodes started together
        do not all ask at the same instant."""
        if self._subscribed is not None and self._subscribed is group.store:
            return False
        interval = job_drain_look_interval(group.group_world_size or 1)
        if self._next_job_look is None:
            self._next_job_look = now + interval * random.random()
        if now < self._next_job_look:
            return False
        self._next_job_look = now + interval * random.uniform(0.5, 1.5)
        return True

    def look(self, group: WorkerGroup, healthy: bool, peers: bool = True) -> None:
        """Request a drain if the drain file exists or (``peers``, while ``healthy``) a peer
        announced a job-wide drain."""
        if self.request is not None:
            return
        path = self.settings.file
        if path and os.path.exists(path):
            self.ask(source="file", by=path)
            return
        if not peers or not healthy or not _shared(group):
            return
        try:
            announced = group.store.check([JOB_DRAIN_KEY])
        except Exception as exc:  # the store is gone: the membership checks report that
            log.debug("could not look for a job-wide drain: %s", exc)
            return
        if announced:
            try:
                by = group.store.get(JOB_DRAIN_KEY)
                by = by.decode() if isinstance(by, bytes) else str(by)
            except Exception:
                by = "a peer"
            if by.startswith(job_verdict.JOB_FAILED_MARK):  # not a drain: a peer gave the job up
                self._take_peer_verdict(group)
                return
            try:
                group.store.add(JOB_DRAIN_SEEN_KEY, 1)
            except Exception as exc:  # the announcer then waits out JOB_DRAIN_SEEN_WAIT_S
                log.debug("could not count this node as having seen the job-wide drain: %s", exc)
            self.ask(scope="job", source="peer", by=by)

    def _take_peer_verdict(self, group: WorkerGroup) -> None:
        """Read the job's verdict a peer published, and count this node as having seen it (its
        decider waits for that before it leaves with the store)."""
        try:
            verdict = job_verdict.published_verdict(group.store)
            group.store.add(job_verdict.SEEN_KEY, 1)
        except Exception as exc:  # the store went: the membership checks report that
            log.debug("could not read the job's verdict: %s", exc)
            return
        if verdict is not None:
            self.peer_verdict = verdict
            try:
                os.write(self._wake_w, b"v")  # wake the run loop
            except OSError:
                pass

    def peer_left(self, group: WorkerGroup) -> bool:
        """Whether another node of this round announced it leaves (a node drain, a stop signal)."""
        if not _shared(group) or self.taken is not None:
            return False
        try:
            return bool(group.store.check([NODE_DRAIN_KEY]))
        except Exception as exc:  # the store is gone: the failure stands as it is
            log.debug("could not look for a peer's drain: %s", exc)
            return False

    # -- the drain itself ------------------------------------------------------------------------
    def announce(self, group: WorkerGroup, hostname: str, call: Callable[[str, Callable[[], Any]], Any]) -> None:
        """Tell the other nodes of the round, through its rendezvous store, before any worker
        stops: a job-wide drain asked here (``JOB_DRAIN_KEY``: every agent looks for it while its
        workers run), or this node's leaving (``NODE_DRAIN_KEY``: a peer whose workers fail
        meanwhile takes it as a membership change). ``call(name, fn)`` runs ``fn`` bounded and
        uninterruptible (``Interrupts.call``)."""
        drain = self.taken
        if drain is None or drain["source"] == "peer" or not _shared(group):
            return
        if drain["scope"] != "job":
            self.announce_leaving(group, call)
            return
        who = f"{hostname} (group_rank {group.group_rank}): {drain['source']} {drain['by']}".strip()
        # a peer's job failure marked there first stands: the first to end the job wins
        try:
            call("announce-drain", functools.partial(job_verdict.set_unless_set, group.store, JOB_DRAIN_KEY, who))
        except Exception as exc:  # the others then see this node leave, later
            log.warning("could not tell the other nodes of the drain: %s", exc)

    def announce_leaving(self, group: WorkerGroup, call: Callable[[str, Callable[[], Any]], Any]) -> None:
        """Tell the other nodes of the round that this node leaves it (``NODE_DRAIN_KEY``), before
        its workers stop: their workers fail about as soon as ours stop (a collective with them),
        before this node has left the rendezvous, and must count as the membership change that
        follows, not as a failure (``peer_left``). A node drain and a stop signal (a preemption's
        SIGTERM) leave this way. ``call(name, fn)`` runs ``fn`` bounded and uninterruptible; a stop
        signal's bounds it to ``ANNOUNCE_LEAVING_WAIT_S`` seconds (a late announcement helps nobody,
        and the workers' stop keeps the rest of a scheduler's grace period)."""
        if not _shared(group):
            return
        try:
            call("announce-leaving", functools.partial(group.store.add, NODE_DRAIN_KEY, 1))
        except Exception as exc:  # the others then count their failed workers as failures
            log.warning("could not tell the other nodes that this node leaves: %s", exc)

    def stop_workers(
        self,
        launcher: Any,
        wake_r: int,
        stopped: Callable[[], bool],
        stop_all: Callable[[], None],
    ) -> dict[str, Any]:
        """The orderly stop: the checkpoint signal to every live worker, up to ``timeout_s`` seconds
        for them to exit by themselves, then ``stop_all()`` (SIGTERM, SIGKILL after
        shutdown_timeout s). ``stopped()`` (a stop signal arrived) cuts the wait short. Returns
        how it went (the ``drain`` record's checkpoint_signal, timeout_s, exits, checkpointed,
        duration_s)."""
        settings = self.settings
        started = time.monotonic()
        exits = dict(launcher.poll())
        live = [r for r in launcher.pids() if r not in exits]
        for local_rank in live:
            launcher.signal_worker(local_rank, settings.checkpoint_signal)
        deadline = started + settings.timeout_s
        while live and not stopped() and not set(live) <= set(exits):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            select.select([wake_r, *launcher.wait_fds()], [], [], min(remaining, 1.0))
            empty_pipe(wake_r)
            exits = dict(launcher.poll())
        by_themselves = {r: exits[r] for r in live if r in exits}
        if len(by_themselves) < len(live):
            log.warning(
                "[%s] drain: %d of %d workers still running after %gs: stopping them",
                self._role,
                len(live) - len(by_themselves),
                len(live),
                settings.timeout_s,
            )
        stop_all()
        return {
            "checkpoint_signal": signal.Signals(settings.checkpoint_signal).name,
            "timeout_s": settings.timeout_s,
            "exits": {str(r): c for r, c in sorted(by_themselves.items())},
            "checkpointed": bool(live)
            and len(by_themselves) == len(live)
            and all(c == 0 for c in by_themselves.values()),
            "started": started,
        }

    def stop_and_settle(
        self,
        group: WorkerGroup,
        launcher: Any,
        interrupts: Interrupts,
        stop_all: Callable[[], None],
    ) -> dict[str, Any] | None:
        """The orderly stop (``stop_workers``), then, for the announcer of a job-wide drain, the
        wait for its peers to see it (unless the store client is still busy with an abandoned
        call); a stop signal cuts both short. Returns the ``drain`` record's fields (the taken
        drain with how the stop went and ``duration_s``, seconds), or None when none was taken."""
        outcome = self.stop_workers(launcher, interrupts.wake_r, interrupts.signalled, stop_all)
        if interrupts.abandoned_call is None:
            self.wait_for_peers_to_see_it(group, interrupts.wake_r, interrupts.signalled)
        if self.taken is None:
            return None
        started = outcome.pop("started")
        self.taken.update(outcome, duration_s=round(time.monotonic() - started, 6))
        return dict(self.taken)

    def wait_for_peers_to_see_it(self, group: WorkerGroup, wake_r: int, stopped: Callable[[], bool]) -> None:
        """The announcer of a job-wide drain waits (at most ``JOB_DRAIN_SEEN_WAIT_S`` s, cut short
        by ``stopped()``) until every other node has counted itself as having seen it: leaving
        first would take the store (c10d's, on its host) with it before they look."""
        drain = self.taken
        if drain is None or drain["scope"] != "job" or drain["source"] == "peer" or not _shared(group):
            return
        others = (group.group_world_size or 1) - 1
        deadline = time.monotonic() + JOB_DRAIN_SEEN_WAIT_S
        while not stopped() and time.monotonic() < deadline:
            try:
                if group.store.add(JOB_DRAIN_SEEN_KEY, 0) >= others:
                    return
            except Exception as exc:  # the store is gone: nobody left to wait for
                log.debug("could not read who saw the job-wide drain: %s", exc)
                return
            select.select([wake_r], [], [], 0.1)
            empty_pipe(wake_r)
        log.warning("[%s] drain: not every node saw the job-wide drain within %gs", self._role, JOB_DRAIN_SEEN_WAIT_S)

    def verdict(self) -> str | None:
        """The run's verdict when it ended by this drain (the caller checks it did)."""
        drain = self.taken
        if drain is None:
            return None
        return (
            f"drained ({drain['scope']} scope, requested by {drain['source']} {drain['by']}".rstrip()
            + f"): requeue (exit code {DRAIN_EXIT_CODE})"
        )
