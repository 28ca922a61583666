#!/usr/bin/env bash
# Install Debian's Slurm (slurm-wlm: slurmctld, slurmd, srun/sbatch/salloc/scontrol) and munge, for
# tests/schedulers/slurm (idempotent). Nothing is started here: .ci/slurm-up.sh starts a private cluster and
# .ci/slurm-down.sh removes it. The packages' own services are not started by a fresh install on a
# machine without systemd; where a service manager did start them, they are stopped.
set -euo pipefail
if [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/bin/srun ] && [ -x /usr/sbin/munged ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq slurm-wlm munge >/dev/null
if command -v systemctl >/dev/null 2>&1; then
    for service in slurmctld slurmd munge; do
        if systemctl is-active --quiet "$service" 2>/dev/null; then $SUDO systemctl stop "$service" || true; fi
    done
fi
slurmctld -V  # srun --version needs a configuration source, which only slurm-up.sh writes
