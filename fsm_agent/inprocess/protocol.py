"""The in-process restart protocol: what the agents and the workers say to each other, in one place.

Both sides use one torch ``TCPStore`` per round, hosted by the agent of group rank 0 at the
round's ``MASTER_ADDR:MASTER_PORT`` (the workers are all clients: ``TORCHELASTIC_USE_AGENT_STORE``
is True, as torch's own agent store). Every key below lives under :func:`attempt_prefix`, so an
attempt (a whole-group restart, ``TORCHELASTIC_RESTART_COUNT``) never reads another's keys.

A *generation* is one process group of an attempt: generation 0 is the first, and each in-process
recovery starts the next one. The protocol, key by key:

``enrolled`` (counter)
    Each worker process adds 1 when it enters ``fsm_agent.inprocess.run``. An agent recovers in
    process only when it is at least ``WORLD_SIZE``: every rank uses the API.
``generation`` (counter)
    The newest generation; absent is 0. The agent that replaces a failed rank adds 1 (two agents
    that do so at once make it 2 higher: everyone goes to the newest).
``gen<g>/replaced`` (JSON list of global ranks)
    Set by that agent *before* ``gen<g>/begun``: the ranks whose processes are new in generation
    ``g`` (they restore from a survivor: the agent-held checkpoint is staged for whole-group restarts only).
``gen<g>/begun`` (any value)
    Set by that agent once ``generation`` reached ``g``: the survivors' watchers wait on it (a
    blocking ``TCPStore.wait``, no polling) and interrupt ``train_fn``.
``gen<g>/arrived`` (counter)
    Each rank adds 1 when it is ready for generation ``g`` (its old process group destroyed, or a
    new process). The arrival that makes it ``WORLD_SIZE`` tries to complete the barrier.
``gen<g>/state`` (``ready`` or ``abandoned``, set once: ``compare_set`` from absent)
    ``ready``: the barrier completed, and every rank that arrived calls
    ``init_process_group(store=PrefixStore(pg_prefix(g), store))``; a newer generation then
    interrupts them all together. ``abandoned``: a rank that arrived left for a newer generation
    before the barrier completed (its arrival no longer counts), so every rank of ``g`` leaves for
    the newest. One ``compare_set`` decides between the two, so no rank enters ``g`` alone. The
    agent that began ``g`` waits for ``ready``, up to ``FSM_AGENT_INPROCESS_TIMEOUT`` seconds
    (following a newer generation), and falls back to a whole-group restart when it does not come.
"""

from __future__ import annotations

#: ``host:port`` of the round's in-process store (a torch ``TCPStore``; workers are clients).
ENV_STORE = "FSM_AGENT_INPROCESS_STORE"
#: The key prefix of this attempt (:func:`attempt_prefix`).
ENV_PREFIX = "FSM_AGENT_INPROCESS_PREFIX"
#: Seconds a recovery may take, fault to ``ready`` (``--inprocess-timeout``); the workers wait
#: longer (:func:`worker_wait_s`), so that the agent's fallback, not their own timeout, ends it.
ENV_TIMEOUT = "FSM_AGENT_INPROCESS_TIMEOUT"
#: The generation this process was started for (0 for the attempt's first processes; ``g`` for
#: a rank that replaces a failed one in generation ``g``).
ENV_GENERATION = "FSM_AGENT_INPROCESS_GENERATION"

ENROLLED = "enrolled"
GENERATION = "generation"


def attempt_prefix(run_id: str, restart_count: int) -> str:
    """The keys of one attempt of one job: ``fsm_agent/inprocess/<run_id>/<restart_count>``."""
    return f"fsm_agent/inprocess/{run_id}/{restart_count}"


def replaced_key(generation: int) -> str:
    return f"gen{generation}/replaced"


def begun_key(generation: int) -> str:
    return f"gen{generation}/begun"


def arrived_key(generation: int) -> str:
    return f"gen{generation}/arrived"


def state_key(generation: int) -> str:
    return f"gen{generation}/state"


#: The values of :func:`state_key`.
READY = b"ready"
ABANDONED = b"abandoned"


def pg_prefix(generation: int) -> str:
    """The prefix of generation ``generation``'s process-group keys (torch's own, under it)."""
    return f"gen{generation}/pg"


def worker_wait_s(timeout_s: float) -> float:
    """Seconds a worker waits for a barrier or a new generation when the agent's timeout is
    ``timeout_s``: past the agent's own fallback, which stops it first."""
    return 2 * timeout_s + 5.0
