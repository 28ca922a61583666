"""torchrun-parity tests: the same scenario under torchrun and fsm-agent (see conftest.py)."""
