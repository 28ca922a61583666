#!/usr/bin/env bash
# Everything the test suite needs on a fresh machine, idempotent:
#   fsm-agent with its test extras (torch pinned to the CPU build on disk), the plugin packages
#   in plugins/ (which pulls in an etcd 3.4 server from Debian), the Mermaid parser (npm), and
#   Debian's slurm-wlm and munge for the private Slurm cluster tests/schedulers/slurm starts, and Debian's
#   spin (the model checker tests/rendezvous/test_rendezvous_model.py runs on the fsm rendezvous protocol), and
#   Debian's podman (tests/schedulers/kubernetes/test_pods.py plays examples/kubernetes as real pods).
set -euo pipefail
cd "$(dirname "$0")/.."
pip install --disable-pip-version-check -q 'torch==2.13.0' -e '.[test]'
bash .ci/install-plugins.sh
bash .ci/install-mermaid.sh
bash .ci/install-slurm.sh
bash .ci/install-spin.sh
bash .ci/install-podman.sh
