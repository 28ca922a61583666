"""Runs the network node check as one node of a round, outside an agent, for the tests.

``python network_driver.py --store HOST:PORT --rank R --world N --addr ADDR --expect K [--master]
[--runs M]``: connects to the TCPStore at HOST:PORT (``--master``: hosts it there), then for each
of M runs meets the other K drivers at a barrier in the store (so every node starts the check
within a store round trip, as after a rendezvous), runs ``NetworkCheck`` with ``--timeout``
seconds and prints one JSON line: ``{"run", "rank", "seconds", "result"}`` (the CheckResult's
record). A store it cannot reach prints ``{"rank", "error"}`` and exits 2. The master waits for
every driver's end before its store goes away.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch.distributed as dist

from fsm_agent.node_checks import CheckRound
from fsm_agent.plugins.node_check_network import NetworkCheck


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--master", action="store_true")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--expect", type=int, required=True, help="drivers taking part (the absent ones left out)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0, help="the round's seconds (--node-check-timeout)")
    parser.add_argument("--connect-timeout", type=float, default=20.0)
    args = parser.parse_args()
    host, port = args.store.rsplit(":", 1)
    try:
        store = dist.TCPStore(
            host,
            int(port),
            is_master=args.master,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=args.connect_timeout),
        )
    except Exception as exc:  # the store is unreachable: say so, the test expects it for a down host
        print(json.dumps({"rank": args.rank, "error": " ".join(str(exc).split())[:300]}), flush=True)
        return 2
    store.set_timeout(datetime.timedelta(seconds=60))
    check = NetworkCheck()
    for run in range(args.runs):
        scoped = dist.PrefixStore(f"run{run}", store)  # each run a fresh key space, as each agent round
        if scoped.add("ready", 1) == args.expect:
            scoped.set("go", "1")
        scoped.wait(["go"])
        started = time.monotonic()
        round_ = CheckRound(
            store=scoped,
            key_prefix="",
            group_rank=args.rank,
            group_world_size=args.world,
            node_addr=args.addr,
            hostname=f"node{args.rank}",
            timeout_s=args.timeout,
            deadline=started + args.timeout,
        )
        result = check.fsm_agent_node_check(round_)
        record = {"run": run, "rank": args.rank, "seconds": time.monotonic() - started, "result": result.record()}
        print(json.dumps(record), flush=True)
        scoped.add("done", 1)
    if args.master:  # keep the store up until every driver finished its last run
        last = dist.PrefixStore(f"run{args.runs - 1}", store)
        until = time.monotonic() + 60
        while last.add("done", 0) < args.expect and time.monotonic() < until:
            time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
