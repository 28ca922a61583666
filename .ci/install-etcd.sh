#!/usr/bin/env bash
# Install an etcd server for plugins/fsm-agent-etcd's tests (idempotent): Debian's etcd-server
# package puts the binary at /usr/bin/etcd. The tests start their own etcd on free 127.0.0.1
# ports; stop the service the package may enable, if a service manager started it.
set -euo pipefail
# openssl: plugins/fsm-agent-etcd/tests/test_etcd_cluster.py makes a test CA and certificate for its https members.
if [ -x /usr/bin/etcd ] && command -v openssl >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq etcd-server openssl >/dev/null
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
    $SUDO systemctl stop etcd || true
fi
/usr/bin/etcd --version | head -1
