"""``python -m fsm_agent.store --host H --port P``: the ``fsm`` rendezvous store as a process of
its own, outside any agent (give the agents ``is_host=0``). The store itself lives with the
backend it serves, in ``fsm_agent.plugins.rendezvous_fsm.store``; this module is only that
command's stable name."""

import sys

from fsm_agent.plugins.rendezvous_fsm.store import main

if __name__ == "__main__":
    sys.exit(main())
