"""Start-up hook of workers the subprocess launcher starts (see fsm_agent/pg_generations.py).

The launcher puts this folder first on the worker's PYTHONPATH, so Python's ``site`` imports this
file as ``sitecustomize``. It removes the folder from ``sys.path`` and ``PYTHONPATH`` again (the
worker's environment stays torchrun's; the worker's own children do not inherit it), runs the
``sitecustomize`` this one shadows (the user's or the distribution's), then installs the
process-group generations and the hang detector's stack dump (fsm_agent/stack_dump.py). A Python without fsm_agent (``--no-python`` running another
interpreter) only loses the generations.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _leave_path():
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    value = os.environ.get("PYTHONPATH", "")
    entries = value.split(os.pathsep)
    if entries and os.path.abspath(entries[0] or ".") == _HERE:
        rest = os.pathsep.join(entries[1:])
        if rest:
            os.environ["PYTHONPATH"] = rest
        else:
            del os.environ["PYTHONPATH"]


def _run_shadowed_sitecustomize():
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_leave_path()
_run_shadowed_sitecustomize()
try:
    from fsm_agent.pg_generations import install
    from fsm_agent.stack_dump import install as install_stack_dump
except ImportError:
    pass
else:
    install()
    install_stack_dump()
