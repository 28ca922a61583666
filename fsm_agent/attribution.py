"""Root-cause attribution: which failed rank caused the failure, and which failed because of it.

torch names the first failure it noticed (``get_first_failure``); in a collective job that is often
a rank that failed *because* a peer died ("Connection closed by peer", a collective timeout). Here
every failed rank of the job is a ``FailureReport`` (what its agent knows: exit code or signal,
times, the error message, the last lines of its traceback or stderr, where a hung rank is stuck),
and ``attribute`` classes each one:

- ``collateral``: its error is what a rank sees when a *peer* fails (a closed connection, a
  collective timeout, a hung rank waiting inside a collective): it failed because another did;
- ``root_cause``: the first failure that is its own (an exception, an exit code, a signal): the
  verdict names it, and the job's exit code is its code;
- ``own``: a later failure that is also its own (two independent faults);
- ``unknown``: nothing tells (no failure of its own anywhere, no rank that could have caused it).

When every failure is collateral, the ranks that had *not* failed (still running, hung outside a
collective, or exited early) while their peers failed waiting for them are the root cause, if they
are fewer than the collateral ones; a lost node's ranks likewise.

Rules are ordered questions ``classify(report) -> "collateral" | "own" | None``: hook
``fsm_agent_classify_failure`` (a site's rules first), then ``builtin_class``. The decision is a
pure function of the reports (sorted, no clock read), so ``fsm-agent replay`` recomputes it from
the events file and gets the same verdict. Imports nothing but the standard library and attrs.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

ROOT_CAUSE = "root_cause"
OWN = "own"
COLLATERAL = "collateral"
UNKNOWN = "unknown"
#: Every class, in the order the summary lists them.
CLASSES = (ROOT_CAUSE, OWN, COLLATERAL, UNKNOWN)
#: At most this many trailing lines of a rank's traceback or stderr travel in its report.
TAIL_LINES = 30
#: At most this many characters of a rank's error message travel in its report.
MESSAGE_CHARS = 500

#: What a rank's error says when a *peer* failed: gloo's and NCCL's closed connections and
#: collective timeouts. Matched case-insensitively against the message and the tail.
PEER_FAILURE_SIGNATURES = (
    r"connection closed by peer",
    r"read error \[[^\]]*\]: connection",
    r"timed out waiting [0-9]+ ?ms for (?:recv|send)",
    r"application timeout caused pair closure",
    r"watchdog caught collective operation timeout",
    r"collective operation timeout",
    r"nccl communicator was aborted",
    r"ncclRemoteError",
    r"remote process exited or there was a network error",
    r"DistNetworkError",
    r"failed to recv, got 0 bytes",
    r"gloo::EnforceNotMet.*(?:closed|timeout)",
    r"Timed out (?:after|waiting).*(?:barrier|all_?reduce|broadcast|collective)",
)
#: Network errors any program can raise (a Redis or HTTP client in the user's code): a peer's
#: failure only when the traceback shows them inside torch.distributed, gloo, c10d or NCCL.
GENERIC_NETWORK_SIGNATURES = (
    r"connection reset by peer",
    r"broken pipe",
    r"\bECONNRESET\b",
    r"\bEPIPE\b",
    r"socket timeout",
    r"connection refused",
)
_PEER_FAILURE = re.compile("|".join(PEER_FAILURE_SIGNATURES), re.IGNORECASE)
_GENERIC_NETWORK = re.compile("|".join(GENERIC_NETWORK_SIGNATURES), re.IGNORECASE)
_DISTRIBUTED_CONTEXT = re.compile(r"torch[/\\]distributed|gloo|c10d|nccl", re.IGNORECASE)
#: Where a hung rank that waits for its peers is stuck: inside ``torch.distributed`` (a collective's
#: or a point-to-point op's wait), as stack dumps by py-spy or faulthandler show it.
DISTRIBUTED_FRAME = re.compile(r"torch[/\\]distributed[/\\]")
#: Point-to-point ops: a hung rank in one of these while its peers wait in a collective is the odd one.
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
#: When every failure is collateral, a rank that failed this many seconds after the first of them
#: failed late: its peers gave up waiting for it (a slow rank, a late collective), it is a suspect.
LATE_S = 1.0
_FAULTHANDLER_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+ in (\w+)', re.MULTILINE)
_PY_SPY_FRAME = re.compile(r"^\s*(\w+) \(([^)]+)\)\s*$", re.MULTILINE)
_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) .*$", re.MULTILINE)


@attrs.frozen
class FailureReport:
    """One failed rank, as its agent saw it: the attributor's input (JSON in the store and the events).

    Attributes:
        global_rank / local_rank: the worker's ranks.
        group_rank / hostname: its agent's rank among the agents and its host.
        exitcode: the exit code, or -N for a death by signal N (torch's convention).
        failure_class: ``fsm_agent.worker.FailureClass`` value (``exit_code``, ``signal``, ``hang``, ...).
        time: when it failed, seconds since the epoch: its error file's time, else its exit time.
        message: the first line of its error (at most ``MESSAGE_CHARS``).
        tail: the last ``TAIL_LINES`` lines of its traceback, its stderr, or (hung) its stacks.
    """

    global_rank: int
    local_rank: int = 0
    group_rank: int = 0
    hostname: str = ""
    exitcode: int = 1
    failure_class: str = "exit_code"
    time: float = 0.0
    message: str = ""
    tail: str = ""

    def record(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> FailureReport:
        """The report from its ``record()`` (unknown keys ignored: a newer agent's report)."""
        names = {field.name for field in attrs.fields(cls)}
        return cls(**{key: value for key, value in record.items() if key in names})


@attrs.frozen
class Verdict:
    """The job's root cause and a class for every failed rank (``attribute``'s answer).

    Attributes:
        root_causes: global ranks to blame, the root cause first (then independent faults); empty
            when nothing tells.
        classes: ``{global_rank: class}`` for every failed rank and every blamed rank that had not failed.
        reasons: ``{global_rank: one line}``: the rule that classed it.
        exit_code: the code every agent of the job ends with: the root cause's shell code (128+N for
            signal N), 1 when it has none (a rank that had not failed, or none named).
        summary: one line: the root cause, and the collateral ranks counted.
    """

    root_causes: tuple[int, ...]
    classes: dict[int, str]
    reasons: dict[int, str]
    exit_code: int
    summary: str

    def record(self) -> dict[str, Any]:
        """JSON-ready (keys of ``classes`` and ``reasons`` as strings)."""
        return {
            "root_causes": list(self.root_causes),
            "classes": {str(rank): cls for rank, cls in sorted(self.classes.items())},
            "reasons": {str(rank): why for rank, why in sorted(self.reasons.items())},
            "exit_code": self.exit_code,
            "summary": self.summary,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Verdict:
        return cls(
            root_causes=tuple(int(rank) for rank in record.get("root_causes", ())),
            classes={int(rank): str(cls) for rank, cls in dict(record.get("classes", {})).items()},
            reasons={int(rank): str(why) for rank, why in dict(record.get("reasons", {})).items()},
            exit_code=int(record.get("exit_code", 1)),
            summary=str(record.get("summary", "")),
        )


def stuck_in(stacks: str) -> str | None:
    """The ``torch.distributed`` function a hung rank's main thread is stuck in (``all_reduce``,
    ``recv``, ``barrier``, ...), from a faulthandler or py-spy dump; None when it is stuck elsewhere
    (its own code) or the dump shows no frame. The main thread is faulthandler's "Current thread"
    (the SIGABRT that made it dump runs there), py-spy's ``MainThread``, else the first listed."""
    main = _main_thread(stacks)
    if not main:
        return None
    frames = [(path, func) for path, func in _FAULTHANDLER_FRAME.findall(main)]
    frames += [(where, func) for func, where in _PY_SPY_FRAME.findall(main)]
    if not frames:
        return None
    # innermost frame first: waiting for a peer means stuck inside torch.distributed (the C++ wait
    # has no Python frame of its own); the outermost public function there is the op it called
    if not DISTRIBUTED_FRAME.search(frames[0][0]):
        return None
    inside: list[str] = [str(func) for path, func in frames if DISTRIBUTED_FRAME.search(path)]
    public = [func for func in inside if not func.startswith("_") and func != "wrapper"]
    return public[-1] if public else inside[-1]


def _main_thread(stacks: str, or_first: bool = True) -> str:
    """The main thread's block of a dump: faulthandler's "Current thread" (the SIGABRT that made it
    dump runs there), py-spy's ``MainThread``, else (``or_first``) the first listed, else ""."""
    blocks = _thread_blocks(stacks)
    main = next((b for b in blocks if b.startswith("Current thread") or '"MainThread"' in b.splitlines()[0]), "")
    return main or (blocks[0] if blocks and or_first else "")


def _thread_blocks(stacks: str) -> list[str]:
    starts = [m.start() for m in _THREAD_HEADER.finditer(stacks)]
    if not starts:
        return [stacks] if stacks.strip() else []
    return [stacks[a:b] for a, b in zip(starts, [*starts[1:], len(stacks)])]


def handling_an_error(stacks: str) -> bool:
    """Whether a hung rank's main thread was caught formatting or recording an exception (torch's
    ``@record`` wrapper, ``traceback``): it was failing already, typically because a peer died."""
    return bool(
        re.search(r"\b(record_exception|format_exc|format_exception|print_exc)\b", _main_thread(stacks, or_first=False))
    )


def waits_in_collective(stacks: str) -> bool:
    """Whether a hung rank's stack dump shows it waiting inside ``torch.distributed`` (for a peer)."""
    return stuck_in(stacks) is not None


def builtin_class(report: FailureReport) -> str:
    """fsm-agent's own rules: ``collateral`` when the error is a peer's failure seen from here (a
    closed connection, a collective timeout) or a hung rank waits inside a collective; else ``own``
    (an exception, an exit code, a signal: the rank's own fault)."""
    if report.failure_class == "hang":
        waiting = waits_in_collective(report.tail) or handling_an_error(report.tail)
        return COLLATERAL if waiting or _peer_failure(report.tail) else OWN
    text = f"{report.message}\n{report.tail}"
    if report.exitcode == -signal.SIGABRT:  # NCCL's watchdog aborts the rank that timed out waiting
        return COLLATERAL if _PEER_FAILURE.search(text) else OWN
    if report.exitcode < 0:  # a signal: SIGSEGV, SIGKILL (the OOM killer), ...
        return OWN
    return COLLATERAL if _peer_failure(text) else OWN


def _peer_failure(text: str) -> bool:
    if _PEER_FAILURE.search(text):
        return True
    return bool(_GENERIC_NETWORK.search(text) and _DISTRIBUTED_CONTEXT.search(text))


def shell_code(exitcode: int) -> int:
    """The code a shell reports: the exit code, or 128+N for a death by signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _what(report: FailureReport) -> str:
    if report.exitcode < 0:
        try:
            name = signal.Signals(-report.exitcode).name
        except ValueError:
            name = f"signal {-report.exitcode}"
        return f"killed by {name}"
    first = report.message.splitlines()[0] if report.message else f"exit code {report.exitcode}"
    return first[:160]


def attribute(
    reports: Iterable[FailureReport],
    world_size: int,
    classify: Callable[[FailureReport], str | None] | None = None,
    unfailed_known: Mapping[int, str] | None = None,
) -> Verdict:
    """Decide the root cause(s) and class every failed rank.

    Args:
        reports: every failed rank's report (any order; a rank reported twice keeps its earliest).
        world_size: the job's ``WORLD_SIZE`` (ranks not reported had not failed).
        classify: a site's rules first (hook ``fsm_agent_classify_failure``): ``"collateral"``,
            ``"own"`` or None (no opinion: ``builtin_class`` decides).
        unfailed_known: ``{global_rank: why}`` for ranks that had not failed but are known to be
            gone (their node lost): blamed before ranks merely still running.

    Returns:
        The Verdict. Deterministic: the same reports give the same verdict.

    Raises:
        ValueError: a rule answered something other than ``collateral``, ``own`` or None.
    """
    earliest: dict[int, FailureReport] = {}
    for report in reports:
        kept = earliest.get(report.global_rank)
        if kept is None or report_order(report) < report_order(kept):
            earliest[report.global_rank] = report
    ordered = sorted(earliest.values(), key=lambda r: (r.time, r.global_rank))
    hints: dict[int, str] = {}
    for report in ordered:
        hint = classify(report) if classify is not None else None
        if hint not in (None, COLLATERAL, OWN):
            raise ValueError(
                f"a failure rule answered {hint!r} for rank {report.global_rank}: expected collateral, own or None"
            )
        hints[report.global_rank] = hint or builtin_class(report)
    classes: dict[int, str] = {}
    reasons: dict[int, str] = {}
    own = [r for r in ordered if hints[r.global_rank] == OWN]
    collateral = [r for r in ordered if hints[r.global_rank] == COLLATERAL]
    root_causes: list[int] = []
    exit_code = 1
    if own:
        first = own[0]
        root_causes = [r.global_rank for r in own]
        exit_code = shell_code(first.exitcode) or 1
        for report in own:
            classes[report.global_rank] = ROOT_CAUSE if report is first else OWN
            reasons[report.global_rank] = (
                f"{'first' if report is first else 'another'} failure of its own: {_what(report)}"
            )
        for report in collateral:
            classes[report.global_rank] = COLLATERAL
            reasons[report.global_rank] = f"failed because a peer did: {_what(report)}"
    else:
        root_causes = _blame_the_unfailed(collateral, set(earliest), world_size, unfailed_known or {}, classes, reasons)
    return Verdict(
        root_causes=tuple(root_causes),
        classes=classes,
        reasons=reasons,
        exit_code=exit_code,
        summary=_summary(root_causes, classes, reasons, earliest),
    )


def _blame_the_unfailed(
    collateral: list[FailureReport],
    failed: set[int],
    world_size: int,
    unfailed_known: Mapping[int, str],
    classes: dict[int, str],
    reasons: dict[int, str],
) -> list[int]:
    """Every failure is collateral: blame a lost node's ranks, else the hung ranks in an odd op,
    else the ranks that had not failed or failed late, if fewer than those that waited for them;
    fills ``classes`` and ``reasons``, returns the root causes (empty: unknown)."""
    gone = {rank: why for rank, why in unfailed_known.items() if rank not in failed and 0 <= rank < world_size}
    running = [rank for rank in range(world_size) if rank not in failed and rank not in gone]
    odd = _odd_ones_out(collateral)
    first_time = collateral[0].time if collateral else 0.0
    late = [r.global_rank for r in collateral if r.time > first_time + LATE_S]
    suspects = sorted(gone) if gone else sorted(odd) if odd else sorted({*running, *late})
    why = dict(gone)
    if not gone:
        why.update({rank: f"hung in {op} while its peers waited in another op for it" for rank, op in odd.items()})
        if not odd:
            why.update(
                {rank: "failed last, after its peers had given up waiting for it (a slow rank)" for rank in late}
            )
    waiting = [r for r in collateral if r.global_rank not in suspects]
    # a lost node is blamed whatever its size, failures here or not; ranks merely still running
    # only when fewer than the ranks that failed waiting for them (else no one of them stands out)
    if not gone and not (waiting and suspects and len(suspects) <= len(waiting)):
        for report in collateral:
            classes[report.global_rank] = UNKNOWN
            reasons[report.global_rank] = (
                f"looks like a peer's failure ({_what(report)}), but no rank to blame was found"
            )
        return []
    for rank in suspects:
        classes[rank] = ROOT_CAUSE
        reasons[rank] = why.get(rank) or (
            "had not failed while its peers failed waiting for it in a collective (hung, slow or exited early)"
        )
    for report in waiting:
        classes[report.global_rank] = COLLATERAL
        reasons[report.global_rank] = f"failed because a peer did: {_what(report)}"
    return suspects


def _odd_ones_out(collateral: list[FailureReport]) -> dict[int, str]:
    """Hung ranks waiting in a ``torch.distributed`` op that differs from their peers': ``{rank: op}``.
    The ranks in the rarer op (a rank in ``recv`` while three wait in ``all_reduce``) or, on a tie, in a
    point-to-point op while the others are in a collective, are the odd ones: their peers wait for them."""
    ops = {r.global_rank: op for r in collateral if r.failure_class == "hang" and (op := stuck_in(r.tail))}
    kinds = sorted(set(ops.values()))
    if len(kinds) < 2:
        return {}
    counts = {op: sum(1 for o in ops.values() if o == op) for op in kinds}
    fewest = min(counts.values())
    rare = [op for op in kinds if counts[op] == fewest]
    if len(rare) == len(kinds):  # a tie: point-to-point ops against collectives
        rare = [op for op in kinds if op in P2P_OPS]
        if not rare or len(rare) == len(kinds):
            return {}
    return {rank: op for rank, op in ops.items() if op in rare}


def report_order(report: FailureReport) -> tuple[Any, ...]:
    """A total order on reports: the earliest first, then every field, so ties never depend on arrival."""
    return (report.time, report.exitcode, report.message, report.tail, report.failure_class, report.hostname)


def _summary(
    root_causes: list[int], classes: Mapping[int, str], reasons: Mapping[int, str], reports: Mapping[int, FailureReport]
) -> str:
    if not root_causes:
        unknown = sorted(rank for rank, cls in classes.items() if cls == UNKNOWN)
        return f"root cause unknown: {_plural(unknown)} failed as if a peer had" if unknown else "no failure"
    first = root_causes[0]
    report = reports.get(first)
    where = f" on {report.hostname}" if report is not None and report.hostname else ""
    what = _what(report) if report is not None else reasons.get(first, "had not failed while its peers waited for it")
    text = f"rank {first}{where}: {what}"
    others = [rank for rank in root_causes[1:]]
    if others:
        text += f"; also failed by {'themselves' if len(others) > 1 else 'itself'}: {_plural(others)}"
    collateral = sorted(rank for rank, cls in classes.items() if cls == COLLATERAL)
    if collateral:
        text += f"; collateral: {_plural(collateral)} failed because of it"
    return text


def _plural(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {rank_spans(ranks)}"


def rank_spans(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: a thousand collateral ranks stay one short line."""
    spans: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
