"""Built-in plugin ``health-check``: a node health check by command, while the workers run.

``--health-check-command CMD`` (``FSM_AGENT_HEALTH_CHECK_COMMAND``, ``[plugins.health-check]
command``) runs ``CMD`` with ``/bin/sh -c`` every ``--health-check-interval`` seconds (default 30)
while the worker group is HEALTHY. An exit code other than 0, or no exit within
``--health-check-timeout`` seconds (default 10), marks the node unhealthy: every local worker
fails with class ``health_check`` and the restart policy decides (restart, give up, or with
``--exclude-node-on health_check`` take this node out of the job so the others carry on).

Typical commands: ``nvidia-smi -q -d ECC | grep -q 'Pending Page Blacklist *: No'``, a check
of free disk space, or a site script. The check runs in the agent's loop, so keep it short; the
timeout bounds it. With no command configured the plugin registers nothing, so the agent does not
tick for it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

from fsm_agent.interrupts import STOP_LOOK_S, stop_taken
from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.registry import positive_seconds

log = logging.getLogger(__name__)
PLUGIN_NAME = "health-check"


@hookimpl
def fsm_agent_addoption(options):
    options.add(
        "command",
        type=str,
        default="",
        flag="--health-check-command",
        env="FSM_AGENT_HEALTH_CHECK_COMMAND",
        help="shell command run while the workers run; a non-zero exit marks the node unhealthy (default: none)",
    )
    options.add(
        "interval",
        type=float,
        default=30.0,
        flag="--health-check-interval",
        env="FSM_AGENT_HEALTH_CHECK_INTERVAL",
        check=positive_seconds,
        help="seconds between health checks (the first runs one interval after the workers start)",
    )
    options.add(
        "timeout",
        type=float,
        default=10.0,
        flag="--health-check-timeout",
        env="FSM_AGENT_HEALTH_CHECK_TIMEOUT",
        check=positive_seconds,
        help="seconds a health check may take before it counts as failed",
    )


class CommandHealthCheck:
    """Runs one shell command every ``interval`` seconds (``timeout`` seconds at most each)."""

    def __init__(self, command: str, interval: float = 30.0, timeout: float = 10.0):
        self.command, self.interval, self.timeout = command, interval, timeout
        self._due: float | None = None

    @hookimpl
    def fsm_agent_workers_started(self, worker_group, pids):
        self._due = time.monotonic() + self.interval  # each attempt starts a fresh interval

    @hookimpl
    def fsm_agent_health_check(self, worker_group):
        now = time.monotonic()
        if self._due is None or now < self._due:
            return None
        self._due = now + self.interval
        return self.run()

    def run(self) -> str | None:
        """Run the command once: None when it exits 0, else what went wrong (one line)."""
        # Its own session, so a timeout can kill what the command started, not only the shell.
        proc = subprocess.Popen(
            ["/bin/sh", "-c", self.command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.timeout
        while True:  # in slices: a stop signal to the agent must not wait for the command
            try:
                _, err = proc.communicate(timeout=min(STOP_LOOK_S, max(0.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                stopping = stop_taken() is not None
                if not stopping and time.monotonic() < deadline:
                    continue
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                if stopping:  # the agent is on its way out: no verdict on the node
                    return None
                return f"`{self.command}` did not finish within {self.timeout:g} s"
        if proc.returncode == 0:
            return None
        last = (err.decode(errors="replace").strip().splitlines() or [""])[-1][:200]
        return f"`{self.command}` exited with {proc.returncode}" + (f": {last}" if last else "")


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    command = (options.get("command") or "").strip()
    if command:
        check = CommandHealthCheck(
            command, interval=options.get("interval") or 30.0, timeout=options.get("timeout") or 10.0
        )
        agent.plugin_manager.register(check, f"{PLUGIN_NAME}-{id(agent)}")
        log.info("health check every %gs: %s", check.interval, command)
