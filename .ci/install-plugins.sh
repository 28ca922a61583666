#!/usr/bin/env bash
# Install the three plugin distributions in plugins/ (editable, with their dependencies and the
# OTLP extra their tests use) and the etcd server their tests start (idempotent).
# fsm-agent itself is named too, so pip resolves the plugins' "fsm-agent" dependency to this
# checkout (never to a registry), with the torch build .ci/run pins.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install --disable-pip-version-check -q 'torch==2.13.0' -e . \
    -e plugins/fsm-agent-prometheus \
    -e plugins/fsm-agent-etcd \
    -e 'plugins/fsm-agent-otel[otlp]' \
    -e plugins/fsm-agent-example
bash .ci/install-etcd.sh
