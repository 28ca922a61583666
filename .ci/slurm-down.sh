#!/usr/bin/env bash
# Remove what .ci/slurm-up.sh started, from what it recorded in SLURMCI_DIR: cancel the jobs, stop
# every process left in the nodes' namespaces, the daemons (by their saved pids), munged if it started
# one, then delete the namespaces, the veths, the bridge and SLURMCI_DIR itself. Safe to run twice.
set -u
D=${SLURMCI_DIR:?set SLURMCI_DIR}
[ -d "$D" ] || exit 0
export SLURM_CONF=$D/slurm.conf
if [ -e "$SLURM_CONF" ] && timeout 5 scontrol ping 2>/dev/null | grep -q UP; then
    jobs=$(squeue -h -o %i 2>/dev/null)
    if [ -n "$jobs" ]; then
        # shellcheck disable=SC2086
        scancel $jobs
        for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
    fi
fi
alive() { for p in "$@"; do [ -d "/proc/$p" ] && return 0; done; return 1; }
pids=()
for f in "$D"/pid.slurmd-node* "$D/pid.slurmctld" "$D/pid.munged"; do
    [ -e "$f" ] || continue
    p=$(cat "$f")
    if [ -d "/proc/$p" ]; then kill -TERM "$p" 2>/dev/null && pids+=("$p"); fi
done
for _ in $(seq 100); do alive "${pids[@]}" || break; sleep 0.1; done
for p in "${pids[@]}"; do [ -d "/proc/$p" ] && kill -KILL "$p" 2>/dev/null; done
# Whatever still runs inside a node's namespace (a task slurmd left, a lost node's processes) was
# started by this cluster: SIGKILL it by pid.
if [ -e "$D/netns" ]; then
    while read -r ns; do
        left=$(ip netns pids "$ns" 2>/dev/null)
        # shellcheck disable=SC2086
        [ -n "$left" ] && kill -KILL $left 2>/dev/null
    done < "$D/netns"
fi
if [ -e "$D/links" ]; then
    # 'ip netns del' is asynchronous about the veths in it: delete them explicitly first.
    tac "$D/links" | while read -r link; do ip link del "$link" 2>/dev/null; done
fi
if [ -e "$D/netns" ]; then
    while read -r ns; do ip netns del "$ns" 2>/dev/null; done < "$D/netns"
fi
rm -rf "$D"
exit 0
