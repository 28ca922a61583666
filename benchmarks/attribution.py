"""Root-cause attribution against ground truth (issue #35): every fault kind under each launcher.

Runs each kind of ``tests/attribution/faults.py`` (a real gloo training job on loopback, one fault
injected on purpose, the injected ranks written down as the ground truth) under fsm-agent and under
torchrun, and prints a Markdown table: whether fsm-agent's job verdict names a ground-truth rank as
THE root cause (on every node; its ``verdict`` record), whether torchrun's "first observed failure"
does (every node that printed one), how fsm-agent classed the ranks outside the truth, and the
seconds from the fault to the last agent's end. Details per node follow the table.

    python benchmarks/attribution.py
    python benchmarks/attribution.py --only slow_rank --launchers fsm-agent
    python benchmarks/attribution.py --markdown out.md --keep /tmp/fault-logs

A run that has not ended after ``--deadline`` seconds is killed and counted as a hang (torchrun's
300 s exit barrier, for one). Each run takes 5 to 20 s on a 2-core machine; all kinds under both
launchers, several minutes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.attribution.faults import CATALOGUE, get  # noqa: E402
from tests.attribution.harness import DEADLINE_S, LAUNCHERS, Outcome, describe, judge, run_fault  # noqa: E402


def seconds_to_end(outcome: Outcome | None) -> str:
    """Seconds from the fault to the last agent's end (the harness's injected nodes aside); "hang"
    when one had not ended by the deadline."""
    if outcome is None:
        return "-"
    if outcome.timed_out and any(n.exit_code is None and not n.injected for n in outcome.nodes):
        return "hang"
    ends = [n.seconds_to_end for n in outcome.nodes if not n.injected and n.seconds_to_end is not None]
    return f"{max(ends):.1f}" if ends else "-"


def mark(outcome: Outcome | None) -> str:
    if outcome is None:
        return "-"
    return "yes" if judge(outcome).right else "**no**"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="a fault kind (repeatable; default: every kind)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma separated: fsm-agent,torchrun")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds before a run counts as a hang")
    parser.add_argument("--markdown", type=Path, help="also write the table and details to this file")
    parser.add_argument("--keep", type=Path, help="keep the runs' logs and events files in this folder")
    args = parser.parse_args(argv)
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    for name in launchers:
        if name not in LAUNCHERS:
            parser.error(f"--launchers: {name!r} is not one of {', '.join(LAUNCHERS)}")
    faults = [get(name) for name in args.only] if args.only else list(CATALOGUE)

    results: dict[tuple[str, str], Outcome] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="attribution-") as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for fault in faults:
            for launcher in launchers:
                outcome = run_fault(fault, launcher, folder, args.seed, deadline=args.deadline)
                results[fault.name, launcher] = outcome
                verdict = judge(outcome)
                print(
                    f"{fault.name:<20} {launcher:<9} {'right' if verdict.right else 'WRONG'}"
                    f" ({outcome.wall_s:.1f} s){': ' + '; '.join(verdict.reasons) if verdict.reasons else ''}",
                    file=sys.stderr,
                    flush=True,
                )

    lines = [
        "| fault kind | named root cause right (fsm-agent) | torchrun's first failure right | "
        "collateral ranks classed (fsm-agent) | seconds to end (fsm-agent, torchrun) |",
        "|---|---|---|---|---|",
    ]
    for fault in faults:
        fsm, torch = results.get((fault.name, "fsm-agent")), results.get((fault.name, "torchrun"))
        lines.append(
            f"| {fault.name} | {mark(fsm)} | {mark(torch)} | {judge(fsm).collateral_text() if fsm else '-'} | "
            f"{seconds_to_end(fsm)}, {seconds_to_end(torch)} |"
        )
    for launcher in launchers:
        right = sum(judge(results[f.name, launcher]).right for f in faults)
        lines.append(f"\n{launcher}: {right} of {len(faults)} kinds right.")
    lines.append(f"\n{len(results)} runs in {time.monotonic() - started:.0f} s.\n\n## Details\n")
    for fault in faults:
        lines.append(f"- `{fault.name}`: {fault.description}; ground truth {sorted(fault.truth)}")
        for launcher in launchers:
            outcome = results[fault.name, launcher]
            verdict = judge(outcome)
            lines += ["  ```", *("  " + line for line in describe(outcome).splitlines())]
            lines += [
                f"  judged {'right' if verdict.right else 'wrong'}: {'; '.join(verdict.reasons) or 'ok'}",
                "  ```",
            ]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
