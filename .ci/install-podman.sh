#!/usr/bin/env bash
# Install Debian's podman (with runc, conmon, the CNI plugins and catatonit) for the Kubernetes pod
# tests (tests/schedulers/kubernetes/test_pods.py, marker `kubernetes`), idempotent: exits at once
# when everything is there. Nothing is configured or started here and /etc is not edited: the
# tests write a containers.conf of their own (CONTAINERS_CONF) and remove every pod, container,
# network and image they make.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
if have podman && have runc && have conmon && { have catatonit || [ -x /usr/libexec/podman/catatonit ]; } \
    && [ -x /usr/lib/cni/bridge ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends podman runc conmon containernetworking-plugins catatonit >/dev/null
podman --version
