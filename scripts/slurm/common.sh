# shellcheck shell=bash
# Shared by train.sbatch, train_single_node.sbatch and node.sh; sourced, not run.
# See docs/fault-tolerance.md ("Slurm") for the whole signal path.

tandem_log() { echo "$(date -Is) $*"; }

tandem_fail() {  # one clear line, exit 2 (a usage or setup error: nothing ran)
  echo "error: $*" >&2
  exit 2
}

tandem_positive_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

# Sets NPROC (torchrun processes per node), THREADS (CPU threads per process) and
# WHAT (how to say it); exports OMP_NUM_THREADS. GPUs: one process per GPU Slurm
# gave. CPU nodes: TANDEM_NPROC_PER_NODE processes (default 1). Threads: the CPUs
# Slurm gave the task, split between the processes, unless TANDEM_THREADS_PER_PROC.
# shellcheck disable=SC2034  # NPROC, THREADS and WHAT are for the caller
tandem_resources() {
  local gpus=${SLURM_GPUS_ON_NODE:-0}
  local cpus=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-$(nproc)}}
  [[ "${gpus}" =~ ^[0-9]+$ ]] || gpus=0
  [ -z "${TANDEM_GPUS_PER_NODE:-}" ] ||
    tandem_fail "TANDEM_GPUS_PER_NODE was renamed: set TANDEM_NPROC_PER_NODE"
  NPROC=${TANDEM_NPROC_PER_NODE:-}
  if [ -z "${NPROC}" ]; then
    if [ "${gpus}" -gt 0 ]; then NPROC=${gpus}; else NPROC=1; fi
  fi
  tandem_positive_int "${NPROC}" ||
    tandem_fail "TANDEM_NPROC_PER_NODE must be a positive integer, got '${NPROC}'"
  if [ -n "${TANDEM_THREADS_PER_PROC:-}" ]; then
    THREADS=${TANDEM_THREADS_PER_PROC}
    tandem_positive_int "${THREADS}" ||
      tandem_fail "TANDEM_THREADS_PER_PROC must be a positive integer, got '${THREADS}'"
  else
    THREADS=$(( cpus / NPROC ))
    [ "${THREADS}" -ge 1 ] || THREADS=1
  fi
  export OMP_NUM_THREADS=${THREADS}
  if [ "${gpus}" -gt 0 ]; then
    WHAT="${NPROC} processes on ${gpus} GPUs, OMP_NUM_THREADS=${THREADS}"
  else
    WHAT="${NPROC} processes on CPU, OMP_NUM_THREADS=${THREADS}"
  fi
}

# True when process $1 has a handler for SIGUSR1 (bit 10 of SigCgt in /proc/PID/status).
# torchrun installs its handlers only once it starts its workers; before that a
# SIGUSR1 would kill it (status 138).
tandem_catches_usr1() {
  local key value mask=
  {
    while read -r key value; do
      if [ "${key}" = "SigCgt:" ]; then mask=${value}; fi
    done < "/proc/$1/status"
  } 2>/dev/null  # gone: no mask
  [ -n "${mask}" ] && (( (16#${mask: -4} >> 9) & 1 ))
}

# Waits for background child $1 to end, sets STATUS to its exit status. A trapped
# signal interrupts `wait` (status 128+n) while the child still runs: wait again.
tandem_execd() {  # has child $1 exec'd its program? Between fork and exec it is a copy of
  # node.sh, with node.sh's USR1 trap: a USR1 sent then is taken by that trap and lost
  local cmd
  cmd=$(tr '\0' ' ' < "/proc/$1/cmdline" 2>/dev/null) || return 1
  [[ -n "${cmd}" && "${cmd}" != *node.sh* ]]
}

tandem_wait() {
  local pid=$1 rc rc2
  while true; do
    wait "${pid}"
    rc=$?
    if kill -0 "${pid}" 2>/dev/null; then continue; fi
    if [ "${rc}" -gt 128 ]; then  # the child's own status, or a signal that interrupted wait as it ended
      wait "${pid}" 2>/dev/null
      rc2=$?
      [ "${rc2}" -eq 127 ] || rc=${rc2}  # 127: already reported, rc was the child's
    fi
    STATUS=${rc}
    return
  done
}

# Why the job is stopping, as Slurm sees it; prints one word:
#   requeued   Slurm requeues it itself (`scontrol requeue`, a requeueing preemption):
#              its Restarts count is already past this allocation's SLURM_RESTART_COUNT
#   cancelled  `scancel`: the job completes with neither Reason=TimeLimit nor a PreemptTime
#              (while a job completes, JobState reads COMPLETING whatever ended it)
#   other      a time limit, a preemption, a signal to a running job: requeue it
# If Slurm cannot be asked, it says so and prints "other".
tandem_stop_kind() {
  local info
  if ! info=$(scontrol show job -o "${SLURM_JOB_ID}" 2>&1); then
    tandem_log "cannot read the job's state (${info}); treating the stop as a preemption" >&2
    echo other
    return
  fi
  if [[ "${info}" =~ Restarts=([0-9]+) ]] && [ "${BASH_REMATCH[1]}" -gt "${SLURM_RESTART_COUNT:-0}" ]; then
    echo requeued
  elif [[ "${info}" == *"JobState=CANCELLED"* ]]; then
    echo cancelled
  elif [[ "${info}" != *"JobState=COMPLETING"* ]] || [[ "${info}" == *"Reason=TimeLimit"* ]]; then
    echo other
  elif [[ "${info}" =~ PreemptTime=([^ ]+) ]] && [ "${BASH_REMATCH[1]}" != None ]; then
    echo other
  else
    echo cancelled
  fi
}

# Sets STOP_FILE and traps for the batch shell: SIGUSR1 (the time-limit warning, or
# `scancel --signal=USR1 --batch`) creates STOP_FILE, which node.sh on every node turns
# into one SIGUSR1 for torchrun as soon as torchrun can take it; SIGTERM (scancel, time
# limit, preemption) reaches every process of the job from Slurm itself, so it is only
# noted. Call after DUMP and STAMP are set; it replays a signal the early trap kept.
tandem_batch_traps() {
  STOP_FILE="${DUMP}/.job-${SLURM_JOB_ID}-stop-${SLURM_RESTART_COUNT:-0}"
  export TANDEM_STOP_FILE=${STOP_FILE}
  rm -f "${STOP_FILE}"
  STOPPED=0
  on_usr1() {
    STOPPED=1
    touch "${STOP_FILE}"
    tandem_log "batch shell got USR1: torchrun will be told to checkpoint and stop"
  }
  on_term() {
    STOPPED=1
    tandem_log "batch shell got TERM: the workers are checkpointing"
  }
  trap on_usr1 USR1
  trap on_term TERM
  if [ "${EARLY_USR1:-0}" -eq 1 ]; then on_usr1; fi
  if [ "${EARLY_TERM:-0}" -eq 1 ]; then on_term; fi
}

# After torchrun ended with STATUS: exit 0 if the run finished; after a stop (status 75,
# a preempt marker of this allocation, or a signal to this shell) requeue the job and
# exit 75, unless an operator cancelled it (then exit with STATUS) or Slurm requeues it
# already (exit 75); otherwise print tandem-diagnose's report and exit with STATUS.
tandem_finish() {
  local marked
  tandem_log "torchrun ended with status ${STATUS}"
  if [ "${STATUS}" -eq 0 ]; then exit 0; fi
  # torchrun reports a worker's 75 as a failure (status 1): look for this allocation's markers too
  marked=$(find "${DUMP}/preempt" -name 'rank-*.json' -newer "${STAMP}" 2>/dev/null | head -n 1)
  if [ "${STATUS}" -eq 75 ] || [ -n "${marked}" ] || [ "${STOPPED}" -eq 1 ]; then
    case $(tandem_stop_kind) in
      cancelled)
        tandem_log "job ${SLURM_JOB_ID} was cancelled: not requeueing; its checkpoints stay in ${DUMP}"
        exit "${STATUS}" ;;
      requeued)
        tandem_log "Slurm is requeueing job ${SLURM_JOB_ID} itself; it resumes from ${DUMP}"
        exit 75 ;;
    esac
    if [ "${SLURM_RESTART_COUNT:-0}" -lt "${MAX_REQUEUES}" ]; then
      tandem_log "preempted: requeueing job ${SLURM_JOB_ID}; it resumes from ${DUMP}"
      scontrol requeue "${SLURM_JOB_ID}" || tandem_log "scontrol requeue failed (Slurm may requeue it itself)"
    else
      tandem_log "preempted, but already requeued ${SLURM_RESTART_COUNT} times: not requeueing"
    fi
    exit 75
  fi
  python -m tandem.diagnose "${DUMP}" || true
  exit "${STATUS}"
}
