"""Lets the tests run from a plain checkout: without ``pip install -e plugins/fsm-agent-example``
the package is imported from ``src`` (the entry-point tests then skip). The fixtures the tests
use (``make_agent``, ``hook_recorder``) come from fsm-agent itself, through its pytest11 entry point."""

from __future__ import annotations

import importlib.util
import os
import sys

if importlib.util.find_spec("fsm_agent_example") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
