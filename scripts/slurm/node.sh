#!/bin/bash
# One node's torchrun agent, started by the sbatch scripts (under srun in train.sbatch):
#
#   bash scripts/slurm/node.sh torchrun [ARGS ...]
#
# Runs the command and returns its exit status. When the batch shell asks for a stop
# (it creates $TANDEM_STOP_FILE, in the dump folder all nodes share), this sends one
# SIGUSR1 to torchrun as soon as torchrun has its handler for it; torchrun forwards it
# to the workers, which checkpoint and exit 75. Signals are not passed down the job
# instead, because srun and `scancel --signal` signal every process of the step at
# once: torchrun still starting would die of SIGUSR1 (status 138), and a second signal
# while torchrun shuts its workers down interrupts that shutdown.

# shellcheck source=scripts/slurm/common.sh
source "$(dirname "$0")/common.sh"

# SIGTERM comes to every process of the job from Slurm (scancel, time limit,
# preemption) and SIGUSR1 from `scancel --signal=USR1 <job>`: torchrun gets its own
# copy, so here they are only noted; this shell lives on to report torchrun's status.
trap 'tandem_log "node.sh on $(hostname -s) got TERM"' TERM
trap 'tandem_log "node.sh on $(hostname -s) got USR1 (torchrun has its own)"' USR1

"$@" &
CHILD=$!
SENT=0
while kill -0 "${CHILD}" 2>/dev/null; do
  if [ "${SENT}" -eq 0 ] && [ -n "${TANDEM_STOP_FILE:-}" ] && [ -e "${TANDEM_STOP_FILE}" ] &&
     tandem_execd "${CHILD}" && tandem_catches_usr1 "${CHILD}"; then
    kill -s USR1 "${CHILD}" 2>/dev/null && SENT=1 &&
      tandem_log "node.sh on $(hostname -s): sent USR1 to torchrun (pid ${CHILD})"
  fi
  sleep 1
done
tandem_wait "${CHILD}"
exit "${STATUS}"
