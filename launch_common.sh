# launch_common.sh: what launch_single_node.sh and launch_multi_node.sh share. Sourced, not run.
#   fail / need_count / need_port      one `error:` line naming the variable, the value and the fix
#   pick_target ARGS...                the recipe name (default ddp) and how to start it
#   run_torchrun LOG ARGS...           torchrun in the background, dying with this script, its stderr kept
#   failure_cause LOG [THIS_NODE]      one line for why the run failed, from what torchrun and the ranks printed

fail() { echo "error: $*" >&2; exit 2; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
# need_count NAME VALUE MIN FIX: a whole number >= MIN (10# so that 08 is eight, not bad octal)
need_count() { is_uint "$2" && (( 10#$2 >= $3 )) || fail "$1=$2: $4"; }
need_port() { is_uint "$2" && (( 10#$2 >= 1 && 10#$2 <= 65535 )) || fail "$1=$2: use a TCP port, 1..65535"; }

# Sets `recipe` and `target` (python's arguments) and `args` (the recipe's options). A first argument
# that is an option (`--max-steps 2`) means the default recipe, ddp.
pick_target() {
  recipe=ddp
  if [[ $# -gt 0 && "$1" != -* ]]; then recipe="$1"; shift; fi
  if [[ "$recipe" == *.py ]]; then target=("$recipe"); else target=(-m recipes run "$recipe"); fi
  args=("$@")
}

# torchrun with its stderr copied to LOG, in the background so that TERM/INT to the launcher reach it.
# PR_SET_PDEATHSIG (kept across exec): a launcher killed with -9 takes torchrun, and so its workers, along.
run_torchrun() {
  local log="$1"; shift
  exec 4> >(tee "$log" >&2)
  local tee_pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
  python -c 'import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
os.execvp(sys.argv[1], sys.argv[1:])' torchrun "$@" 2>&4 &
  pid=$!
  rc=0
  wait "$pid" || rc=$?
  while kill -0 "$pid" 2>/dev/null; do wait "$pid" || rc=$?; done  # wait again after a trapped signal
  exec 4>&-
  wait "$tee_pid" 2>/dev/null || true  # all of torchrun's report is out before the closing line
  return "$rc"
}

# The cause, most specific first: a rank's own `error:` line; the exception a rank raised (the last
# one in the log that is not a network error: the others are ranks that lost that rank); a lost peer;
# a collective timeout (a rank hung, or the network is cut); torchrun's first observed failure. Empty: nothing recognised.
failure_cause() {
  # THIS_NODE (the multi-node launcher's own address): a connection that a rank of this very node closed is
  # that rank exiting (after its own timeout, say), not the lost peer: the cause is what made it exit.
  local log="$1" this_node="${2:-}" line
  if line=$(grep -a '^error: ' "$log" | tail -n 1) && [[ -n "$line" ]]; then
    echo "${line#error: }"
  elif line=$(grep -aE '^(\[rank[0-9]+\]: )?[A-Za-z_][A-Za-z0-9_.]*(Error|Exception|Interrupt)(: |$)' "$log" \
                | grep -avE 'DistNetworkError|DistBackendError|DistStoreError|ChildFailedError|SignalException|pair closure|Connection (reset|closed|refused)|Broken pipe|Timed out|timed out|Socket Timeout' \
                | tail -n 1) && [[ -n "$line" ]]; then
    if [[ "$line" =~ ^\[rank([0-9]+)\]:\ (.*)$ ]]; then
      echo "rank ${BASH_REMATCH[1]} raised ${BASH_REMATCH[2]:0:200} (its traceback is above)"
    else
      echo "a rank raised ${line:0:200} (its traceback is above)"
    fi
  elif line=$(grep -aoE '(Connection (reset|closed|refused)[a-z ]*|Broken pipe)[^[]*\[[0-9a-f.:]+\]|\[[0-9a-f.:]+\]:[0-9]+: (Connection (reset|closed|refused)[a-z ]*|Broken pipe)' \
                "$log" | grep -avF "[${this_node:-none}]" | sed -n 1p) && [[ -n "$line" ]]; then
    local peer what
    peer=$(grep -oE '\[[0-9a-f.:]+\]' <<<"$line" | tr -d '[]' | sed -n 1p)
    what=$(grep -oE 'Connection [a-z]+( by peer)?|Broken pipe' <<<"$line" | sed -n 1p)
    echo "lost the connection to peer $peer ($what): that node stopped or the network to it failed; see its log"
  elif line=$(grep -aoE 'Timed out waiting [0-9]+ms for (send|recv)|Application timeout caused pair closure|[Ww]atchdog caught collective operation timeout|hang-rank[0-9]+\.txt' "$log" | sed -n 1p) && [[ -n "$line" ]]; then
    echo "a collective timed out ($line): a rank hung or stopped answering within --timeout-s; see the hang reports and tracebacks above"
  elif line=$(awk '/Root Cause/ {found = 1} found && /rank *:/ {r = $3} found && /exitcode *:/ {print "rank " r " exited with code " $3; exit}' "$log") \
       && [[ -n "$line" ]]; then
    echo "$line; see torchrun's report above"
  fi
  return 0
}
