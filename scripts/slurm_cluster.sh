#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, with job accounting, for the launcher tests and
# for trying `hydra/launcher=slurm` without a cluster. Debian's packages (slurm-wlm 22.05, slurmdbd,
# munge, mariadb-server), daemons started by hand (no systemd needed). Needs root.
#
#   scripts/slurm_cluster.sh start    # install what is missing, configure, start; waits until idle
#   scripts/slurm_cluster.sh stop     # stop the daemons
#   scripts/slurm_cluster.sh status   # sinfo
#   scripts/slurm_cluster.sh --help   # this text (no argument: a usage line, exit 2; nothing starts)
#
# Exit status: 0 up, 1 a daemon did not start, 2 not root or bad usage, 3 packages could not be
# installed (no apt-get, no mirror).
#
# Accounting (slurmdbd on MariaDB) is not optional here: without it submitit cannot see a job that
# died before writing its result, and waits for it forever.
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
case "${1:-}" in  # before anything else runs: no argument or a bad one starts nothing
start | stop | status) ((${#} == 1)) || { echo "usage: $0 start|stop|status (one argument)" >&2; exit 2; } ;;
-h | --help) usage; exit 0 ;;
'') echo "usage: $0 start|stop|status (--help: what each does)" >&2; exit 2 ;;
*) echo "usage: $0 start|stop|status, not '$1' (--help: what each does)" >&2; exit 2 ;;
esac
# runuser, mysqld and the Slurm daemons live in sbin, which a non-login shell's PATH may lack
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

CLUSTER=attnbench
HOST=$(hostname -s)
CONF=/etc/slurm
LOG=/var/log/slurm
DB_PASS=attnbench

say() { echo "[slurm_cluster] $*"; }

install() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v slurmdbd >/dev/null || missing+=(slurmdbd)
    command -v munged >/dev/null || missing+=(munge)
    command -v mariadbd >/dev/null || command -v mysqld >/dev/null || missing+=(mariadb-server)
    if ((${#missing[@]})); then
        say "installing ${missing[*]} (Debian packages)"
        export DEBIAN_FRONTEND=noninteractive
        command -v apt-get >/dev/null || { say "no apt-get: install ${missing[*]} by hand"; exit 3; }
        # exit 3: could not install (no network, no mirror): the caller may skip rather than fail
        apt-get update -q >/dev/null || { say "apt-get update failed"; exit 3; }
        apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null || {
            say "apt-get install ${missing[*]} failed"
            exit 3
        }
    fi
}

start_munge() {
    pgrep -x munged >/dev/null && return
    mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
    [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown -R munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge
    chmod 0700 /etc/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- munged
    say "munged started"
}

start_mariadb() {
    if ! mysqladmin ping --silent >/dev/null 2>&1; then
        mkdir -p /run/mysqld
        chown mysql:mysql /run/mysqld
        (mysqld_safe --user=mysql >/dev/null 2>&1 &)
        for _ in $(seq 60); do mysqladmin ping --silent >/dev/null 2>&1 && break; sleep 0.5; done
        mysqladmin ping --silent >/dev/null 2>&1 || { say "MariaDB did not start"; exit 1; }
        say "MariaDB started"
    fi
    mysql -u root <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '${DB_PASS}';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
SQL
}

write_config() {
    local cpus mem_mb
    cpus=$(nproc)
    mem_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512))
    mkdir -p "$CONF" "$LOG" /var/spool/slurmctld /var/spool/slurmd /run/slurm
    cat >"$CONF/slurm.conf" <<EOF
ClusterName=${CLUSTER}
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=${LOG}/slurmctld.log
SlurmdLogFile=${LOG}/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$CONF/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=${LOG}/slurmdbd.log
PidFile=/run/slurm/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=${DB_PASS}
StorageLoc=slurm_acct_db
EOF
    chmod 0600 "$CONF/slurmdbd.conf"
}

start() {
    [ "$(id -u)" = 0 ] || { say "needs root"; exit 2; }
    install
    start_munge
    start_mariadb
    write_config
    if ! pgrep -x slurmdbd >/dev/null; then
        slurmdbd
        for _ in $(seq 60); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
        say "slurmdbd started"
    fi
    sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true
    # A controller started from down starts empty (-c): this cluster is for trials and tests, and the
    # jobs of its last life have no processes left. Recovered, one such job stayed RUNNING on the
    # node until its time limit and held every core, so the next sweep waited behind it (CI failed).
    pgrep -x slurmctld >/dev/null || { slurmctld -c && say "slurmctld started (no jobs kept from before)"; }
    pgrep -x slurmd >/dev/null || { slurmd && say "slurmd started"; }
    for _ in $(seq 120); do
        if sinfo -h -o %T 2>/dev/null | grep -q -E '^(idle|mixed|allocated)'; then
            say "cluster '${CLUSTER}' is up: $(sinfo -h -o '%P %D %T %C')"
            return
        fi
        scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
        sleep 0.5
    done
    say "the node did not come up:"
    sinfo || true
    tail -n 20 "$LOG/slurmctld.log" "$LOG/slurmd.log" || true
    exit 1
}

stop() {
    for d in slurmd slurmctld slurmdbd; do pkill -x "$d" || true; done
    mysqladmin shutdown 2>/dev/null || true
    pkill -x munged || true
    say "stopped"
}

case "$1" in
start) start ;;
stop) stop ;;
status) sinfo ;;
esac
