"""The ``fsm`` rendezvous's planner: what one node does next, as a pure function of the shared state
(``plan``), and the state's shape (``fresh_state``, ``rank_order``). No I/O: the handler reads the
state, asks ``plan`` and writes its answer back with one compare-and-set."""

from __future__ import annotations

import copy

SCHEMA = 1
_INF = float("inf")


# -- the state machine of one node, as a pure function ------------------------------------------------
def fresh_state() -> dict:
    return {"schema": SCHEMA, "round": 0, "complete": False, "closed": False, "seq": 0, "nodes": {},
            "participants": {}, "previous": [], "wait_list": {}, "last_join": 0.0, "master": None}


def rank_order(state: dict, participants) -> list[str]:
    """Participants in rank order: node_rank hint, then the store host, then join order."""
    nodes = state["nodes"]

    def key(p: str):
        n = nodes[p]
        hint = n.get("node_rank")
        return (hint if hint is not None else _INF, 0 if n.get("host") else 1, n.get("seq", 0), p)

    return sorted(participants, key=key)


def plan(state: dict, alive: set[str], me: str, me_info: dict, now: float, *, min_nodes: int, max_nodes: int,
         last_call_timeout: float, rejoin_timeout: float, returned_round: int | None
         ) -> tuple[dict | None, str, float | None]:
    """One step of node ``me`` on the shared state: ``(new_state or None, action, wait_s)``.

    ``new_state`` (when not None) is to be written with compare_set; then the caller re-reads and
    calls again, except after ``not_needed`` (it raises once the write succeeded). Without a write,
    ``action`` is ``finish`` (this round is ours), ``closed`` or ``wait`` (watch the state for at
    most ``wait_s`` seconds; None: until it changes).
    """
    st = copy.deepcopy(state)
    nodes, wl = st["nodes"], st["wait_list"]
    changed = False
    for n in list(nodes):  # nodes whose lease is gone have left or died
        if n not in alive and n != me:
            del nodes[n]
            changed = True
    for n in list(wl):
        if n not in nodes:
            del wl[n]
            changed = True
    if not st["complete"]:
        for n in list(st["participants"]):
            if n not in nodes:
                del st["participants"][n]
                changed = True
    if st["closed"]:
        return (st if changed else None), "closed", None
    if me not in nodes:
        nodes[me] = {**me_info, "seq": st["seq"], "rounds": 0}
        st["seq"] += 1
        changed = True
    parts = st["participants"]

    if st["complete"]:
        live = [p for p in parts if p in nodes]
        if me in parts:
            if st["round"] != returned_round:
                return (st if changed else None), "finish", None
            # this node wants a new round (restart, lost node, joiners): open it
            st["round"] += 1
            st["complete"] = False
            st["previous"] = sorted(live)
            st["participants"] = {me: None}
            st["master"] = None
            nodes[me]["port"] = me_info["port"]
            wl.pop(me, None)
            st["last_join"] = now
            return st, "wait", 0.0
        if len(live) >= max_nodes:
            del nodes[me]
            wl.pop(me, None)
            return st, "not_needed", None
        if me not in wl:
            wl[me] = now
            changed = True
        return (st if changed else None), "wait", None

    if me not in parts:
        reserved = [n for n in st["previous"] if n in nodes and n not in parts and n != me]
        seats = max_nodes - len(parts) - (0 if me in st["previous"] else len(reserved))
        if seats <= 0:
            if me not in wl:
                wl[me] = now
                changed = True
            return (st if changed else None), "wait", None
        parts[me] = None
        wl.pop(me, None)
        nodes[me]["port"] = me_info["port"]
        st["last_join"] = now
        return st, "wait", 0.0

    n = len(parts)
    if n < min_nodes:
        return (st if changed else None), "wait", None
    pending = [x for x in nodes if x not in parts]
    joinable = min(len(pending), max_nodes - n)
    new_in_round = any(nodes[p].get("rounds", 0) == 0 for p in parts)
    settle_at = st["last_join"] + (last_call_timeout if new_in_round else 0.0)
    rejoin_at = st["last_join"] + rejoin_timeout
    if n >= max_nodes or (joinable == 0 and now >= settle_at) or now >= rejoin_at:
        order = rank_order(st, parts)
        st["participants"] = {p: i for i, p in enumerate(order)}
        st["complete"] = True
        for p in order:
            nodes[p]["rounds"] = nodes[p].get("rounds", 0) + 1
            wl.pop(p, None)
        st["master"] = {"addr": nodes[order[0]]["addr"], "port": nodes[order[0]]["port"]}
        return st, "wait", 0.0
    wake = settle_at if joinable == 0 else rejoin_at
    return (st if changed else None), "wait", max(0.0, wake - now)
