#!/usr/bin/env bash
# Re-record the CPU figures of docs/performance.md: every CPU bench command the page prints, each
# into its own log (the bench's header, then its table), on a machine with nothing else running.
# One torch thread where a command says so: on a shared machine two threads spin-wait for each
# other when one is descheduled, and the timings swing far more than with one.
# Paste each log's header and table into its section, replacing the table that is there.
#
#   bash scripts/record_cpu_benches.sh [OUT_DIR]    # default outputs/cpu_benches
#   ONLY="generate moe" bash scripts/record_cpu_benches.sh # some of them (the names below)
#
# TRL (a test reference: pip install -e ".[test]") must be importable for the grpo rows.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-outputs/cpu_benches}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ date -u; uptime; lscpu; } > "$out/machine.txt" 2>&1

run() {  # run NAME CMD...: the command's output in OUT_DIR/NAME.log
  local name=$1; shift
  [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0
  local t0=$SECONDS
  echo "=== $name: $*"
  "$@" > "$out/$name.log" 2>&1
  echo "=== $name: rc=$? in $((SECONDS - t0)) s"
}

# the order of docs/performance.md's CPU sections
run grpo "$PY" -m bench.grpo_step --steps 6 --repeats 3 --threads 1 \
  --engines tandem,trl,tandem-onednn,trl-default
run grpo_ac "$PY" -m bench.grpo_step --steps 6 --repeats 3 --threads 1 --activation-checkpoint full \
  --engines tandem,trl
run exact "$PY" -m bench.grpo_step --steps 3 --repeats 3 --threads 1 --engines tandem,tandem-exact
run exact_small "$PY" -m bench.grpo_step --prompts 2 --steps 2 --repeats 3 --threads 1 \
  --engines tandem,tandem-exact
run generate "$PY" -m bench.generate --threads 1 --layout-row
run moe "$PY" -m bench.moe --threads 1
run paged env OMP_NUM_THREADS=1 "$PY" -m bench.paged_attention --preset small
run logprobs "$PY" -m bench.logprobs_memory --repeats 1
run checkpoint "$PY" -m bench.checkpoint
run checkpoint2 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.checkpoint
run restart "$PY" -m bench.restart
run reshard "$PY" -m bench.reshard
run reshard_06b "$PY" -m bench.reshard --size 0.6b --nproc 2
run serve "$PY" -m bench.serve --seconds 15
ls -l "$out"
