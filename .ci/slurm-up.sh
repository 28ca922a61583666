#!/usr/bin/env bash
# Start a private Slurm cluster on this machine for tests/schedulers/slurm: munge (unless one answers already),
# slurmctld, and N slurmd compute nodes node1..nodeN, each in its own network namespace with its own
# address (10.77.0.1I/24 on a bridge in the root namespace, the controller at .1) and hostname.
#
#   SLURMCI_DIR=/tmp/x [SLURMCI_NODES=2] [SLURMCI_CPUS=2] [SLURMCI_SUBNET=10.77.0] bash .ci/slurm-up.sh
#
# Every pid, namespace and link it creates is recorded under SLURMCI_DIR, so .ci/slurm-down.sh removes
# exactly those (it is also run here when starting fails). Then: export SLURM_CONF=$SLURMCI_DIR/slurm.conf.
# Partitions: "debug" (default, preemptable: requeued after a GraceTime of SLURMCI_GRACE seconds) and
# "urgent" (a higher PriorityTier: a job there preempts debug jobs). Needs root (namespaces, daemons).
set -euo pipefail
D=${SLURMCI_DIR:?set SLURMCI_DIR to a fresh directory}
N=${SLURMCI_NODES:-2}; CPUS=${SLURMCI_CPUS:-2}; NET=${SLURMCI_SUBNET:-10.77.0}; GRACE=${SLURMCI_GRACE:-20}
HERE=$(cd "$(dirname "$0")" && pwd)
export SLURM_CONF=$D/slurm.conf
# Refuse before anything is created (and before the ERR trap would clean up): another cluster's
# directory or bridge must not be touched.
if [ -e "$D/nodes" ]; then echo "slurm-up: $D already holds a cluster; run .ci/slurm-down.sh first" >&2; exit 1; fi
if ip link show fsmslurm0 >/dev/null 2>&1; then
    echo "slurm-up: bridge fsmslurm0 exists: another test cluster runs on this machine" >&2; exit 1
fi
mkdir -p "$D/state" "$D/log"
echo "$N" > "$D/nodes"
trap 'echo "slurm-up: failed; removing what was started" >&2; bash "$HERE/slurm-down.sh"' ERR

if ! (munge -n </dev/null | unmunge >/dev/null) 2>/dev/null; then
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    cp /run/munge/munged.pid "$D/pid.munged"
    for _ in $(seq 50); do (munge -n </dev/null | unmunge >/dev/null) 2>/dev/null && break; sleep 0.1; done
fi

CTL=$(hostname -s)
cat > "$SLURM_CONF" <<CONF
ClusterName=fsmci
SlurmctldHost=$CTL($NET.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
KillWait=10
SlurmdTimeout=5
MinJobAge=600
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MailProg=/bin/true
CONF
for i in $(seq 1 "$N"); do
    echo "NodeName=node$i NodeHostname=node$i NodeAddr=$NET.$((10 + i)) CPUs=$CPUS RealMemory=1000 State=UNKNOWN"
done >> "$SLURM_CONF"
cat >> "$SLURM_CONF" <<CONF
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
CONF

{ echo "127.0.0.1 localhost"; echo "$NET.1 $CTL"; for i in $(seq 1 "$N"); do echo "$NET.$((10 + i)) node$i"; done; } > "$D/hosts"
ip link add fsmslurm0 type bridge && echo fsmslurm0 >> "$D/links"
ip addr add "$NET.1/24" dev fsmslurm0
ip link set fsmslurm0 up
for i in $(seq 1 "$N"); do
    ip netns add "fsmslurm_n$i" && echo "fsmslurm_n$i" >> "$D/netns"
    ip link add "fsmslurm_h$i" type veth peer name "fsmslurm_c$i" && echo "fsmslurm_h$i" >> "$D/links"
    ip link set "fsmslurm_h$i" master fsmslurm0
    ip link set "fsmslurm_h$i" up
    ip link set "fsmslurm_c$i" netns "fsmslurm_n$i"
    ip -n "fsmslurm_n$i" link set "fsmslurm_c$i" name eth0
    ip -n "fsmslurm_n$i" addr add "$NET.$((10 + i))/24" dev eth0
    ip -n "fsmslurm_n$i" link set eth0 up
    ip -n "fsmslurm_n$i" link set lo up
done

setsid /usr/sbin/slurmctld -D -f "$SLURM_CONF" >"$D/log/slurmctld.out" 2>&1 </dev/null &
echo $! > "$D/pid.slurmctld"
for _ in $(seq 300); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
scontrol ping | grep -q UP || { echo "slurmctld did not come up:" >&2; cat "$D/log/slurmctld.out" >&2; false; }
for i in $(seq 1 "$N"); do
    mkdir -p "$D/spool/node$i"
    # One script per node, so that a test can start a node again after killing it (a lost node).
    # nsenter + unshare rather than 'ip netns exec', which remounts /sys (slurmd then finds no cgroup fs).
    cat > "$D/start-node$i.sh" <<NODE
setsid nsenter --net=/run/netns/fsmslurm_n$i unshare --uts --mount bash -c \\
    "mount --bind $D/hosts /etc/hosts && hostname node$i && exec /usr/sbin/slurmd -D -N node$i -f $SLURM_CONF" \\
    >>"$D/log/slurmd-node$i.out" 2>&1 </dev/null &
echo \$! > "$D/pid.slurmd-node$i"
NODE
    bash "$D/start-node$i.sh"
done
idle() { sinfo -h -N -p debug -t idle -o %N 2>/dev/null | sort -u | wc -l; }
for _ in $(seq 300); do [ "$(idle)" = "$N" ] && break; sleep 0.1; done
[ "$(idle)" = "$N" ] || { echo "the $N nodes did not become idle:" >&2; sinfo -N -l >&2; false; }
trap - ERR
