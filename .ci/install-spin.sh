#!/usr/bin/env bash
# Install the SPIN model checker (Debian's spin, 6.5) for tests/rendezvous/test_rendezvous_model.py, which checks the fsm
# rendezvous protocol's Promela model; the model's verifier is compiled with gcc. Idempotent.
set -euo pipefail
if command -v spin >/dev/null 2>&1 && command -v gcc >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq spin gcc >/dev/null
spin -V
