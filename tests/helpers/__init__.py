"""Plain helpers that the tests of several folders share (fixtures are in ``tests/conftest.py``).

- ``events``: an agent's events file as records, and its transitions.
- ``processes``: a command run to the end in a session of its own (its process group killed past
  its timeout); ``fsm-agent`` as a subprocess; the fuzzers' ``fsm-agent run``; the environment of
  a subprocess that imports this checkout.
- ``install``: projects pip-installed into a folder (``--target``) that subprocesses get on
  ``PYTHONPATH``; the shared environment is never changed.
- ``fuzz``: the fuzzers' hypothesis settings, their script that does not exist, a clean environment.

Nothing here is a fixture or a test: pytest collects none of it.
"""
