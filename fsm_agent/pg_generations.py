"""Process-group generations: a worker may destroy and re-create its process group, repeatedly.

Runs inside worker processes (never in the agent). ``init_process_group`` -> ``destroy_process_group``
-> ``init_process_group`` (evaluation loops, Megatron's re-initialization; pytorch #114585) fails
under torchrun in two ways: a store that outlives the group hands the second group the first one's
keys (torch names the default group "0" again after a destroy, so gloo reads the old addresses),
and a store re-created by rank 0 races with the old one (a fast rank > 0 connects to rank 0's
previous server before rank 0's destroy frees it, then loses that connection).

This module replaces torch's ``env://`` rendezvous handler in the worker with one that keeps the
first store it makes (per MASTER_ADDR, MASTER_PORT, rank and world size) for the life of the
process and hands each later ``init_process_group`` a fresh key prefix on it: generation 0 gets
torch's own store unchanged, generation g >= 1 gets ``PrefixStore("fsm_agent/pg_generation_<g>",
store)``. The server never goes away under a rank that re-initializes early, and no generation
reads another's keys. Ranks agree on g because every rank re-creates the group the same number of
times (a collective requirement anyway). Other init methods (``tcp://``, ``file://``, ``store=``)
are untouched.

The launchers install it: the subprocess launcher through ``fsm_agent/_worker_site/sitecustomize.py``
on the worker's PYTHONPATH (removed again at start-up, so the worker's environment is torchrun's),
the preload launcher in its forked worker, callables in their process. A worker started with
``python -S`` or ``-I`` (or a non-Python ``--no-python`` program) runs with torch's handler.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlparse

#: The torch module whose ``env`` handler is replaced, once it has been imported.
RENDEZVOUS_MODULE = "torch.distributed.rendezvous"

#: Key prefix of generation g >= 1 (generation 0 uses the store as torch made it).
GENERATION_PREFIX = "fsm_agent/pg_generation_{}"

#: The folder whose sitecustomize.py installs the generations in a ``python`` worker at start-up.
WORKER_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker_site")

# (MASTER_ADDR, MASTER_PORT, rank, world size) -> [store, times handed out]
_stores: dict[tuple[str, str, int, int], list[Any]] = {}


def with_generations_site(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`WORKER_SITE` first on PYTHONPATH (the worker removes it at start-up)."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": WORKER_SITE + (os.pathsep + path if path else "")}


def install() -> None:
    """Replace torch's ``env://`` rendezvous handler in this process, now or when torch imports it.

    Never imports torch itself (a worker that does not use torch pays nothing).
    """
    module = sys.modules.get(RENDEZVOUS_MODULE)
    if module is not None:
        _replace_env_handler(module)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _replace_env_handler(module: Any) -> None:
    handlers = module._rendezvous_handlers  # torch's registry; register_rendezvous_handler refuses a second "env"
    torch_handler = handlers.get("env")
    if torch_handler is None or getattr(torch_handler, "_fsm_agent_generations", False):
        return

    def env_handler_with_generations(
        url: str, timeout: timedelta = module.default_pg_timeout, **kwargs: Any
    ) -> Iterator[tuple[Any, int, int]]:
        # rank and world size as torch's handler reads them: the URL's query (init_process_group
        # puts explicit ones there), else the environment
        query = dict(parse_qsl(urlparse(url).query))
        rank = int(query.get("rank") or os.environ.get("RANK") or -1)
        world_size = int(query.get("world_size") or os.environ.get("WORLD_SIZE") or -1)
        key = (os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), rank, world_size)
        entry = _stores.get(key)
        if entry is None:  # generation 0: torch's own handler and store, unchanged
            store, rank, world_size = next(torch_handler(url, timeout, **kwargs))
            _stores[key] = [store, 1]
        else:
            from torch.distributed import PrefixStore  # type: ignore[attr-defined]

            store = PrefixStore(GENERATION_PREFIX.format(entry[1]), entry[0])
            entry[1] += 1
        yield store, rank, world_size
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")  # as torch's handler

    env_handler_with_generations._fsm_agent_generations = True  # type: ignore[attr-defined]
    handlers["env"] = env_handler_with_generations


class _AfterImport(importlib.abc.MetaPathFinder):
    """Replaces the handler right after ``torch.distributed.rendezvous`` has run (Python has no
    post-import hook; this finder wraps that one module's loader, then leaves ``sys.meta_path``)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != RENDEZVOUS_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            _replace_env_handler(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
