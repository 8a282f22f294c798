#!/usr/bin/env bash
# local-slurm.sh — a real two-node Slurm cluster on this one machine, for tests.
#
#   bash scripts/local-slurm.sh install   # apt-get install slurm-wlm munge (skipped if present)
#   bash scripts/local-slurm.sh start     # munged + slurmctld + slurmd n1/n2; waits until both idle
#   bash scripts/local-slurm.sh stop      # stops only the daemons this script started (by pid file)
#   bash scripts/local-slurm.sh status    # pids, liveness, sinfo -N
#
# Debian's slurm-wlm 22.05 runs as root; two slurmd daemons pose as nodes n1 and n2 on this host
# (same NodeHostname, different ports, per-node spool/pid/log files via %n).
# See /work/shared/reference/local-slurm.md for the recipe this follows.
#
# Environment:
#   GRPO_SLURM_DIR    state dir (default /tmp/grpo-slurm): slurm.conf, run/*.pid, spool/, log/
#   GRPO_SLURM_CPUS   CPUs per pseudo-node (default: nproc)
#   GRPO_SLURM_MEM    RealMemory (MB) per pseudo-node (default 8000)
#   GRPO_SLURM_PORT   slurmctld port (default 6817); slurmd ports are 17001/17002
#
# slurm.conf choices (see write_conf):
#   SelectType=select/cons_tres + CR_Core_Memory with DefMemPerCPU=1000: a job that asks for no
#   memory gets 1000 MB per CPU instead of the whole node, so a job with --nodes=2 --ntasks-per-node=1
#   --cpus-per-task=1 takes 1 of the nproc CPUs on each pseudo-node and two such jobs run at once
#   (on a 2-core machine). The two pseudo-nodes each claim all cores: they share the real ones.
#   OverSubscribe=YES lets jobs that ask for --oversubscribe share CPUs as well.
#   JobRequeue=1, KillWait=10, MinJobAge=300 (finished jobs stay visible to scontrol/squeue 5 min),
#   ReturnToService=2 (nodes come back idle after a restart).
set -euo pipefail

DIR="${GRPO_SLURM_DIR:-/tmp/grpo-slurm}"
CONF="$DIR/slurm.conf"
ETC_CONF=/etc/slurm/slurm.conf
MARK="# Written by grpo-launcher scripts/local-slurm.sh"
NODES=(n1 n2)
START_TIMEOUT=60
STOP_TIMEOUT=30

log() { echo "[local-slurm] $*"; }
die() { echo "[local-slurm] ERROR: $*" >&2; exit 1; }

need_root() { [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd/munged need it)"; }

# ---------------------------------------------------------------- pid helpers
ctld_pidfile() { echo "$DIR/run/slurmctld.pid"; }
slurmd_pidfile() { echo "$DIR/run/slurmd-$1.pid"; }

# pid_alive PIDFILE COMM: the pid in PIDFILE is alive and its command name is COMM
# (guards against a stale pid file whose pid was reused by another process).
pid_alive() {
    local f=$1 comm=$2 pid
    [[ -s $f ]] || return 1
    pid=$(tr -dc '0-9' <"$f")
    [[ -n $pid ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$comm" ]]
}
pid_of() { [[ -r $1 ]] && tr -dc '0-9' <"$1" || true; }

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

all_up() {
    pid_alive "$(ctld_pidfile)" slurmctld || return 1
    local n
    for n in "${NODES[@]}"; do pid_alive "$(slurmd_pidfile "$n")" slurmd || return 1; done
}

# ---------------------------------------------------------------- install
cmd_install() {
    need_root
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v munged >/dev/null && command -v sbatch >/dev/null; then
        log "slurm-wlm and munge already installed ($(slurmctld -V 2>/dev/null || echo '?'))"
        return 0
    fi
    export DEBIAN_FRONTEND=noninteractive
    # -o DPkg::Lock::Timeout: scripts/gym-install.sh may be installing build packages beside us (scripts/test.sh)
    local t0=$SECONDS
    # apt-get update only when the package lists do not know slurm-wlm yet.
    if ! apt-cache policy slurm-wlm 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        log "apt-get update"
        apt-get -o DPkg::Lock::Timeout=600 update -qq
    fi
    log "apt-get install slurm-wlm munge"
    if ! apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends slurm-wlm munge >"/tmp/local-slurm-apt.log" 2>&1; then
        # stale lists can 404: refresh once and retry
        log "install failed; apt-get update and retry (log: /tmp/local-slurm-apt.log)"
        apt-get -o DPkg::Lock::Timeout=600 update -qq
        apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends slurm-wlm munge >"/tmp/local-slurm-apt.log" 2>&1 \
            || { tail -n 30 /tmp/local-slurm-apt.log >&2; die "apt-get install failed"; }
    fi
    log "installed $(slurmctld -V) in $((SECONDS - t0)) s"
}

# ---------------------------------------------------------------- config
write_conf() {
    local host cpus mem port tmp
    host=$(hostname -s)
    cpus=${GRPO_SLURM_CPUS:-$(nproc)}
    mem=${GRPO_SLURM_MEM:-8000}
    port=${GRPO_SLURM_PORT:-6817}
    mkdir -p "$DIR/run" "$DIR/log" "$DIR/spool/ctld" "$DIR/spool/n1" "$DIR/spool/n2"
    tmp=$(mktemp "$DIR/slurm.conf.XXXXXX")
    cat >"$tmp" <<EOF
$MARK
# state dir: $DIR — regenerate with: bash scripts/local-slurm.sh start
ClusterName=grpo-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=300
SlurmdTimeout=60
MpiDefault=none
MailProg=/bin/true
StateSaveLocation=$DIR/spool/ctld
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmdSpoolDir=$DIR/spool/%n
SlurmdLogFile=$DIR/log/slurmd-%n.log
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=17001 CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=17002 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    if [[ -f $CONF ]] && cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"
    else
        if [[ -f $CONF ]] && all_up; then
            log "WARNING: slurm.conf changed while daemons run; run 'stop' then 'start' to apply"
        fi
        mv -f "$tmp" "$CONF"
        chmod 644 "$CONF"
    fi
    # /etc/slurm/slurm.conf lets plain sbatch/sinfo work without SLURM_CONF; only ever
    # (over)write it when it is absent or carries our marker.
    if [[ ! -e $ETC_CONF ]] || head -n 1 "$ETC_CONF" | grep -qxF "$MARK"; then
        mkdir -p "$(dirname "$ETC_CONF")"
        cmp -s "$CONF" "$ETC_CONF" 2>/dev/null || cp -f "$CONF" "$ETC_CONF"
    else
        log "NOTE: $ETC_CONF exists and was not written by us; left alone (use SLURM_CONF)"
    fi
}

# ---------------------------------------------------------------- start
start_munge() {
    if munge_ok; then
        log "munged already running"
        return 0
    fi
    [[ -s /etc/munge/munge.key ]] || die "/etc/munge/munge.key missing (run: $0 install)"
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    local before after
    before=$(pid_of /run/munge/munged.pid)
    munged --force >"$DIR/log/munged-start.log" 2>&1 \
        || { cat "$DIR/log/munged-start.log" >&2; die "munged failed to start"; }
    for _ in $(seq 50); do munge_ok && break; sleep 0.2; done
    munge_ok || { cat "$DIR/log/munged-start.log" >&2; die "munged started but munge -n | unmunge fails"; }
    after=$(pid_of /run/munge/munged.pid)
    [[ -n $after && $after != "$before" ]] || die "munged runs but its pid file /run/munge/munged.pid is unreadable"
    echo "$after" >"$DIR/run/munged.ours"   # we started it: 'stop' may stop it
    log "munged started (pid $after)"
}

tail_logs() {
    local f
    for f in "$DIR"/log/slurmctld.log "$DIR"/log/slurmd-n1.log "$DIR"/log/slurmd-n2.log; do
        echo "----- tail $f" >&2
        tail -n 20 "$f" >&2 2>/dev/null || echo "(missing)" >&2
    done
}

export_line() { echo "export SLURM_CONF=$CONF"; }

# Nodes whose slurmd this run launched (name=epoch): sinfo may show such a node idle from the
# controller's saved state before the new slurmd has registered, so also wait until the node's
# SlurmdStartTime (set when slurmd registers) is not older than the launch.
declare -A LAUNCHED=()
registered() {
    local n ts epoch
    for n in "${!LAUNCHED[@]}"; do
        ts=$(SLURM_CONF=$CONF scontrol show node "$n" -o 2>/dev/null | grep -oE 'SlurmdStartTime=[^ ]+' | cut -d= -f2)
        epoch=$(date -d "$ts" +%s 2>/dev/null) || return 1
        ((epoch >= LAUNCHED[$n])) || return 1
    done
}

wait_idle() {
    local deadline=$((SECONDS + START_TIMEOUT)) out=""
    while ((SECONDS < deadline)); do
        out=$(SLURM_CONF=$CONF sinfo -N -h -o '%N %t' 2>/dev/null | sort -u || true)
        # idle, or busy with jobs (mix/alloc) after a restart: both mean the node is up
        if [[ $(grep -cE '^n[12] (idle|mix|alloc)$' <<<"$out") -eq 2 ]] && registered; then
            log "nodes up: $(tr '\n' ' ' <<<"$out")"
            return 0
        fi
        # a node left down/drained by a previous run: resume it
        local n
        for n in "${NODES[@]}"; do
            if grep -qE "^$n (down|drain|drng|fail)" <<<"$out"; then
                SLURM_CONF=$CONF scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
            fi
        done
        sleep 1
    done
    echo "[local-slurm] ERROR: nodes not idle (or slurmd not registered) after ${START_TIMEOUT}s; sinfo -N says:" >&2
    echo "${out:-(no answer from slurmctld)}" >&2
    tail_logs
    exit 1
}

cmd_start() {
    need_root
    command -v slurmctld >/dev/null || die "slurm not installed (run: $0 install)"
    mkdir -p "$DIR"
    local t0=$SECONDS
    if all_up && munge_ok; then
        write_conf
        log "already running (slurmctld pid $(pid_of "$(ctld_pidfile)"), slurmd n1 pid" \
            "$(pid_of "$(slurmd_pidfile n1)"), n2 pid $(pid_of "$(slurmd_pidfile n2)"))"
        wait_idle
        export_line
        return 0
    fi
    write_conf
    start_munge
    if pid_alive "$(ctld_pidfile)" slurmctld; then
        log "slurmctld already running (pid $(pid_of "$(ctld_pidfile)"))"
    else
        rm -f "$(ctld_pidfile)"
        slurmctld -f "$CONF" || { tail_logs; die "slurmctld failed to start"; }
    fi
    local n
    for n in "${NODES[@]}"; do
        if pid_alive "$(slurmd_pidfile "$n")" slurmd; then
            log "slurmd $n already running (pid $(pid_of "$(slurmd_pidfile "$n")"))"
        else
            rm -f "$(slurmd_pidfile "$n")"
            LAUNCHED[$n]=$(date +%s)
            slurmd -f "$CONF" -N "$n" || { tail_logs; die "slurmd -N $n failed to start"; }
        fi
    done
    wait_idle
    log "started in $((SECONDS - t0)) s; state dir $DIR"
    export_line
}

# ---------------------------------------------------------------- stop
stop_pid() {  # stop_pid NAME PID: SIGTERM, wait, SIGKILL as a last resort
    local name=$1 pid=$2 deadline
    kill -TERM "$pid" 2>/dev/null || return 0
    deadline=$((SECONDS + STOP_TIMEOUT))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT}s; SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
    fi
    log "stopped $name (pid $pid)"
}

cmd_stop() {
    need_root
    if pid_alive "$(ctld_pidfile)" slurmctld; then
        local active
        active=$(SLURM_CONF=$CONF squeue -h -t RUNNING,COMPLETING -o %i 2>/dev/null | wc -l || echo 0)
        if ((active > 0)); then
            log "NOTE: $active job(s) still running; their slurmstepd processes survive and" \
                "reattach on the next start (scancel them first to end them)"
        fi
    fi
    local n f
    for n in "${NODES[@]}"; do
        f=$(slurmd_pidfile "$n")
        if pid_alive "$f" slurmd; then stop_pid "slurmd $n" "$(pid_of "$f")"; else log "slurmd $n not running"; fi
        rm -f "$f"
    done
    f=$(ctld_pidfile)
    if pid_alive "$f" slurmctld; then stop_pid slurmctld "$(pid_of "$f")"; else log "slurmctld not running"; fi
    rm -f "$f"
    f="$DIR/run/munged.ours"
    if [[ -s $f ]]; then
        local mp
        mp=$(pid_of "$f")
        if [[ -n $mp ]] && kill -0 "$mp" 2>/dev/null && [[ $(cat "/proc/$mp/comm" 2>/dev/null) == munged ]]; then
            stop_pid munged "$mp"
        else
            log "munged (pid ${mp:-?}, started by us) already gone"
        fi
        rm -f "$f"
    else
        log "munged not started by us; left running"
    fi
}

# ---------------------------------------------------------------- status
cmd_status() {
    local n f
    show() {  # show LABEL PIDFILE COMM
        if pid_alive "$2" "$3"; then echo "$1: pid $(pid_of "$2") alive"
        elif [[ -s $2 ]]; then echo "$1: pid $(pid_of "$2") NOT alive (stale pid file)"
        else echo "$1: not running"; fi
    }
    echo "state dir: $DIR"
    show slurmctld "$(ctld_pidfile)" slurmctld
    for n in "${NODES[@]}"; do show "slurmd $n" "$(slurmd_pidfile "$n")" slurmd; done
    if munge_ok; then
        if [[ -s $DIR/run/munged.ours ]]; then echo "munged: running (pid $(pid_of "$DIR/run/munged.ours"), started by us)"
        else echo "munged: running (not started by us)"; fi
    else
        echo "munged: not running"
    fi
    if [[ -f $CONF ]] && command -v sinfo >/dev/null; then
        SLURM_CONF=$CONF sinfo -N 2>&1 || true
    fi
    export_line
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 {install|start|stop|status}" >&2; exit 2 ;;
esac
