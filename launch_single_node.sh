#!/usr/bin/env bash
# launch_single_node.sh: train a recipe on this machine, one process per GPU (or 2 on CPU), with torchrun.
#
#   ./launch_single_node.sh                          # the ddp recipe on the embedded digits data
#   ./launch_single_node.sh ddp --epochs 3 --lr 3e-3 # a recipe and its options (see: python -m recipes run ddp --help)
#   ./launch_single_node.sh --max-steps 20           # options alone mean ddp
#   ./launch_single_node.sh train.py --epochs 3      # a recipe copied out with `python -m recipes cp`
#
# Environment:
#   NPROC_PER_NODE  processes to start (default: the number of GPUs, or 2 on a CPU-only machine)
#   MASTER_PORT     rendezvous port (default: none: the ranks meet through a private file and a store
#                   on 127.0.0.1, so nothing listens beyond this machine and jobs never collide. Set,
#                   torchrun's store listens on MASTER_PORT on every interface, as torch binds it)
#   MAX_RESTARTS    how often torchrun restarts the whole group after a failure (default 0)
#
# A run that does not finish ends with one `error:` line: the rank that failed and why (a rank's own
# traceback above it, once), or the signal that stopped it (SIGTERM, SIGINT, SIGHUP: the exit status is
# 128 + the signal), the last step and the checkpoint kept. docs/multinode.md: "What the launchers say".
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

need_runtime
need_tmpdir
pick_target "$@"

# Check everything here, one line each, before any process or port is taken.
max_restarts="${MAX_RESTARTS:-0}"
need_count MAX_RESTARTS "$max_restarts" 0 "use how often to restart the group after a failure, 0 or more"
max_restarts=$(( 10#$max_restarts ))
if [[ -n "${NPROC_PER_NODE:-}" ]]; then
  need_count NPROC_PER_NODE "$NPROC_PER_NODE" 1 "use the number of processes to start, 1 or more"
  nprocs=$(( 10#$NPROC_PER_NODE ))
fi
if [[ -n "${MASTER_PORT:-}" ]]; then
  need_port MASTER_PORT "$MASTER_PORT"
  port_free "$MASTER_PORT" || fail "MASTER_PORT=$MASTER_PORT is already in use on this machine: pick a free port, or unset MASTER_PORT (the ranks then meet through a private file)"
fi
[[ -z "${GLOO_SOCKET_IFNAME:-}" ]] || need_interfaces GLOO_SOCKET_IFNAME "$GLOO_SOCKET_IFNAME"
if [[ -z "${nprocs:-}" ]]; then
  nprocs=$(default_nproc)
fi
case "$recipe" in
  dp|pipeline_naive) nprocs=1 ;;  # one process drives every local device
esac
precheck "$nprocs"
# Share the cores between the processes (torchrun would otherwise set 1 and warn about it).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / nprocs > 0 ? $(nproc) / nprocs : 1 ))}"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/launch_single_node.XXXXXX")
if [[ -n "${MASTER_PORT:-}" ]]; then
  rendezvous=(--nnodes 1 --master-addr 127.0.0.1 --master-port "$MASTER_PORT")
else
  # torchrun --standalone's stores listen on every interface (torch's TCPStore binds them all). Instead:
  # the agent meets itself in a file, and rank 0 hosts the workers' store on 127.0.0.1 (tools/join.py).
  rendezvous=(--nnodes 1 --rdzv-backend c10d --rdzv-endpoint "$tmp/rdzv" --rdzv-conf store_type=file
              --rdzv-id "single-$$" --local-addr 127.0.0.1)
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # the workers' own store, not one in the agent
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"  # gloo would bind the hostname's address, maybe eth0's
fi
# A restarted group must not reuse the first round's store: stale gloo addresses in it make the
# new workers dial dead ones ("Connection refused"); see pytorch/pytorch#135712.
if (( max_restarts > 0 )); then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
fi

# From here this shell is tools/supervise.py: torchrun, and one closing line for a failure or a stop.
supervise --what "$recipe" --note launch_single_node --max-restarts "$max_restarts" --remove "$tmp" -- \
  torchrun "${rendezvous[@]}" --nproc-per-node "$nprocs" --max-restarts "$max_restarts" \
  "${worker[@]}" "${target[@]}" ${args[@]+"${args[@]}"}
