"""The ``fsm`` rendezvous's planner: one run's rendezvous state and the operations on it
(``Rendezvous``), with no I/O, no clock and no threads. The store server holds one per run and
applies each client's request to it in its single serving thread, so every operation is atomic;
``tests/rendezvous/test_planner_properties.py`` drives it through random interleavings and
``tests/rendezvous/test_rendezvous_model.py`` checks the same protocol as a Promela model.

Cost: ``join``, ``leave``, ``lose`` and ``membership`` are O(1) (amortised) in the number of
nodes; completing a round is O(N log N) once (the rank sort) and hands each participant O(1) bytes.
Nothing is ever copied or serialised whole, so N joins cost O(N) in all (the JSON document that
every join read and compare-and-set before made them O(N^2)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_INF = float("inf")


@dataclass
class Node:
    """A live node of the run. ``seq`` is its first-join order (ranks are stable across rounds);
    ``rounds`` how many rounds it was ranked in (0: new to the run, which starts the settle window)."""

    addr: str
    port: int
    host: bool = False
    node_rank: int | None = None
    seq: int = 0
    rounds: int = 0


@dataclass(frozen=True)
class Joined:
    """The answer to ``join``. ``status``: ``ranked`` (``rank``/``world`` of ``round`` hold),
    ``wait`` (blocked until the round completes or seats free up), ``not_needed`` (the round is
    complete with ``max_nodes`` live participants) or ``closed``."""

    status: str
    round: int
    rank: int | None = None
    world: int = 0


#: torch's c10d ``last_call_timeout`` (seconds): a staggered start of ``--nnodes MIN:MAX`` waits
#: this long for more nodes rather than starting with fewer and restarting when they come.
DEFAULT_LAST_CALL_TIMEOUT_S = 30.0


@dataclass
class Rendezvous:
    """One run's rendezvous (torch's ``_RendezvousState``, but in the store and updated in place).

    Rounds: a round completes when ``min_nodes <= n`` and one of: ``n == max_nodes``; no other
    live node can still join and either no participant is settling or ``last_call_timeout``
    passed since the last join (the settle window); or ``rejoin_timeout`` passed since the last
    join. A participant settles while it is new to the run and has not already waited
    ``last_call_timeout`` on the wait list (a late node that waited for a running round to take
    it is not waited for twice). A participant of the last completed round that joins again opens
    the next round; the live participants of the last round have reserved seats in it. Ranks: ``node_rank`` hint,
    then the store host, then first-join order. All times are the store server's monotonic clock
    (seconds).

    Hot spares (``hot_spares``, torch's redundancy list): a node that finds no seat (the round
    complete with ``max_nodes`` live participants, or open with every seat taken or reserved)
    stays in ``wait_list`` as a standby (``is_standby``) instead of leaving with ``not_needed``.
    ``wait_list`` never counts towards ``n``, so a standby cannot complete, close or overfill a
    round; ``_admit`` seats it when a round has a free seat, after the reserved seats of the last
    round's live participants, which are held ``rejoin_timeout`` at most when a standby waits
    (``_release_reserved``). Once every participant of the complete round is gone, the last one
    decides: if it left (the job finished or was stopped) the job has ``ended`` and its standbys
    and late nodes leave (as torch's closed rendezvous ends its redundancy list); if it was lost
    (killed, silent) the waiting nodes open the next round, so spares replace a job whose every
    active node died.
    """

    min_nodes: int
    max_nodes: int
    last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT_S
    rejoin_timeout: float = 60.0
    round: int = 0
    complete: bool = False
    closed: bool = False
    nodes: dict[str, Node] = field(default_factory=dict)
    #: this round's participants in join order; their ranks once complete (else None)
    participants: dict[str, int | None] = field(default_factory=dict)
    #: live participants of the last completed round that have not joined this one (reserved seats)
    reserved: set[str] = field(default_factory=set)
    #: node -> server time it began waiting for a round with room
    wait_list: dict[str, float] = field(default_factory=dict)
    last_join: float = 0.0
    #: nodes beyond max_nodes wait as standbys (False: they leave with not_needed)
    hot_spares: bool = True
    #: server time the incomplete round opened (reserved seats are held from then)
    opened_at: float = 0.0
    master: tuple[str, int] | None = None
    #: participants of the complete round that are gone (lease lapsed, killed, left)
    lost: set[str] = field(default_factory=set)
    _seq: int = 0
    #: participants of the incomplete round the settle window waits for (see the class docstring)
    _settling: set[str] = field(default_factory=set)
    #: the complete round's last live participant left (not lost): the job ended, see ``ended``
    _left_at_end: bool = False

    # -- operations ----------------------------------------------------------------------------
    def join(self, me: str, info: Node, now: float, returned_round: int | None) -> Joined:
        """Node ``me`` asks for a rank; ``returned_round``: the round its last join returned (None: never)."""
        if self.closed:
            return Joined("closed", self.round)
        node = self.nodes.get(me)
        if node is None:
            info.seq, info.rounds = self._seq, 0
            self._seq += 1
            node = self.nodes[me] = info
        else:
            node.port = info.port  # a fresh MASTER_PORT candidate each join
        if self.complete:
            if me in self.participants and me not in self.lost:
                if self.round != returned_round:
                    return self._ranked(me)
                self._open(me, now)  # this node wants a new round (restart, lost node, joiners)
                return Joined("wait", self.round)
            if self._live_participants() >= self.max_nodes and not self.hot_spares:
                self._forget(me)
                return Joined("not_needed", self.round)
            if self.ended():  # a late node: the job it would join is over
                self._forget(me)
                return Joined("not_needed", self.round)
            self.wait_list.setdefault(me, now)
            if self._live_participants() == 0:  # no one of the last round is left to open the next
                self._open(None, now)
            return Joined("wait", self.round)
        if me not in self.participants:
            if self._seats(me) <= 0:
                self.wait_list.setdefault(me, now)
                return Joined("wait", self.round)
            self._seat(me, now)
        return Joined("wait", self.round)

    def leave(self, me: str, now: float, *, forget: bool = True, lost: bool = False) -> None:
        """Node ``me`` leaves: the wait list and an incomplete round; ``forget``: the run too
        (its next join counts as a new node). A participant of a complete round stays in it
        unless forgotten (then it counts as lost).

        When the last live participant of a complete round is gone, ``lost`` decides what the
        waiting nodes (standbys, late joiners) do: a lost one (killed, silent) leaves them to open
        the next round themselves, so spares replace a job whose every active node died; one that
        left (the job ended, or was stopped) has ``ended`` the job and they are not needed."""
        if forget:
            self._forget(me)
        else:
            self.wait_list.pop(me, None)
            if not self.complete:
                self._unseat(me)
        if self.complete and self.participants and self._live_participants() == 0:
            self._left_at_end = not lost
            if lost and self.wait_list:
                self._open(None, now)
        self._admit(now)

    def lose(self, me: str, now: float) -> None:
        """Node ``me``'s lease ended (killed, silent for the keep-alive timeout): as ``leave``,
        lost."""
        self.leave(me, now, forget=True, lost=True)

    def close(self) -> None:
        self.closed = True

    def tick(self, now: float) -> tuple[list[str], list[str]]:
        """Complete the round if it is due at ``now`` (call after every operation and at
        ``deadline()``): ``(ranked, turned_away)``, the participants in rank order and the waiting
        nodes that leave with ``not_needed`` because the round is full; both empty: not yet."""
        if self.closed or self.complete:
            return [], []
        self._release_reserved(now)
        n = len(self.participants)
        if n < self.min_nodes or (n < self.max_nodes and now < self.deadline()):
            return [], []
        order = self._complete()
        away = list(self.wait_list) if n >= self.max_nodes and not self.hot_spares else []
        for w in away:
            self._forget(w)
        return order, away

    def deadline(self) -> float:
        """When ``tick`` completes the incomplete round, or releases reserved seats to a standby,
        at the latest (inf: neither)."""
        return min(self._completes_at(), self._reserved_until())

    def _completes_at(self) -> float:
        if self.complete or self.closed or len(self.participants) < self.min_nodes:
            return _INF
        if self._joinable() == 0:
            return self.last_join + (self.last_call_timeout if self._settling else 0.0)
        return self.last_join + self.rejoin_timeout

    def membership(self, me: str, round_: int, now: float) -> tuple[int, int, float]:
        """For a participant of ``round_``: ``(lost, waiting, recheck_at)`` (torch's
        ``num_nodes_lost``/``num_nodes_waiting``). ``waiting``: nodes waiting for a new round
        (another participant opened one, or nodes waited ``last_call_timeout`` to join a round
        with room); ``recheck_at``: when ``waiting`` may change without any operation (inf: never)."""
        if round_ != self.round:
            others = len(self.participants) + len(self.wait_list) - (me in self.participants) - (me in self.wait_list)
            return 0, max(1, others), _INF
        due = self.waiting_due_at()
        if now >= due:
            return len(self.lost), len(self.wait_list), _INF
        return len(self.lost), 0, due

    def waiting_due_at(self) -> float:
        """When the nodes waiting to join the complete round are reported (inf: none, or no room)."""
        if self.closed or not self.complete or not self.wait_list or self._live_participants() >= self.max_nodes:
            return _INF
        first_waiting = next(iter(self.wait_list.values()))  # insertion order is waiting order
        if self._live_participants() + len(self.wait_list) >= self.max_nodes:
            return first_waiting  # enough to fill every seat: no one else is worth waiting for
        return first_waiting + self.last_call_timeout

    # -- hot spares -------------------------------------------------------------------------------
    def is_standby(self, me: str) -> bool:
        """Node ``me`` waits with no seat for it: the complete round has ``max_nodes`` live
        participants, or the open round's seats are all taken or reserved."""
        if me not in self.wait_list or self.closed:
            return False
        if self.complete:
            return self._live_participants() >= self.max_nodes
        return self._seats(me) <= 0

    def ended(self) -> bool:
        """The complete round's participants are all gone and the last one left rather than being
        lost: the job is over, so the nodes still waiting (standbys) and late ones are not needed."""
        return self.complete and self._left_at_end and self._live_participants() == 0

    def _reserved_until(self) -> float:
        if self.complete or self.closed or not self.reserved or not self.wait_list:
            return _INF
        return self.opened_at + self.rejoin_timeout

    def _release_reserved(self, now: float) -> None:
        """A live participant of the last round that has not come back ``rejoin_timeout`` after
        the round opened loses its reserved seat to a waiting standby (a slow survivor is waited
        for, a hung one is replaced)."""
        if now >= self._reserved_until():
            self.reserved = set()
            self._admit(now)

    def ranks(self) -> dict[str, int]:
        return {p: r for p, r in self.participants.items() if r is not None}

    # -- inside ------------------------------------------------------------------------------------
    def _ranked(self, me: str) -> Joined:
        return Joined("ranked", self.round, self.participants[me], len(self.participants))

    def _live_participants(self) -> int:
        return len(self.participants) - len(self.lost)

    def _seats(self, me: str) -> int:
        reserved = 0 if me in self.reserved else len(self.reserved)
        return self.max_nodes - len(self.participants) - reserved

    def _seat(self, me: str, now: float) -> None:
        self.participants[me] = None
        self.reserved.discard(me)
        waiting_since = self.wait_list.pop(me, None)
        waited = now - waiting_since if waiting_since is not None else 0.0
        if self.nodes[me].rounds == 0 and waited < self.last_call_timeout:
            self._settling.add(me)
        self.last_join = now

    def _unseat(self, me: str) -> None:
        if me in self.participants:
            del self.participants[me]
            self._settling.discard(me)

    def _forget(self, me: str) -> None:
        self.wait_list.pop(me, None)
        self.reserved.discard(me)
        if self.complete:
            if me in self.participants:
                self.lost.add(me)
        else:
            self._unseat(me)
        self.nodes.pop(me, None)

    def _open(self, me: str | None, now: float) -> None:
        """Open the next round (``me``: the participant that asked for it, seated first)."""
        self.reserved = {p for p in self.participants if p not in self.lost and p != me}
        self.round += 1
        self.complete, self._left_at_end = False, False
        self.participants, self.lost, self.master, self._settling = {}, set(), None, set()
        self.opened_at = now
        if me is not None:
            self._seat(me, now)
        self._admit(now)

    def _admit(self, now: float) -> None:
        """Seat waiting nodes, in waiting order, while the incomplete round has free seats."""
        if self.complete or self.closed:
            return
        while self.wait_list and self._seats("") > 0:
            self._seat(next(iter(self.wait_list)), now)

    def _joinable(self) -> int:
        pending = len(self.nodes) - len(self.participants)
        return min(pending, self.max_nodes - len(self.participants))

    def _complete(self) -> list[str]:
        order = rank_order(self.nodes, self.participants)
        self.participants = {p: i for i, p in enumerate(order)}
        self.complete = True
        self.reserved = set()
        for p in order:
            self.nodes[p].rounds += 1
            self.wait_list.pop(p, None)
        self._settling = set()
        first = self.nodes[order[0]]
        self.master = (first.addr, first.port)
        return order


def rank_order(nodes: dict[str, Node], participants) -> list[str]:
    """Participants in rank order: node_rank hint, then the store host, then first-join order."""

    def key(p: str):
        n = nodes[p]
        return (n.node_rank if n.node_rank is not None else _INF, 0 if n.host else 1, n.seq, p)

    return sorted(participants, key=key)
