#!/usr/bin/env bash
# launch_multi_node.sh: train a recipe on several machines with torchrun; run it once on every machine.
#
# Static (as the source does it): every node is told the node count and its own rank.
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 ./launch_multi_node.sh ddp --epochs 3   # on 10.0.0.1
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=1 ./launch_multi_node.sh ddp --epochs 3   # on the other one
# Elastic: torchrun's c10d rendezvous numbers the nodes; a failed group restarts (from the newest checkpoint).
#   MASTER_ADDR=10.0.0.1 NNODES=2 RDZV_ID=job7 MAX_RESTARTS=3 ./launch_multi_node.sh ddp --ckpt-every 50 --resume auto
#
# Environment:
#   NNODES          nodes in the job (default 1); elastic: MIN:MAX, e.g. 2:4
#   NODE_RANK       this node's rank, 0..NNODES-1; node 0 hosts the rendezvous (static mode only)
#   NPROC_PER_NODE  processes on this node, the same on every node (default: the GPUs, or 2 on CPU)
#   MASTER_ADDR     node 0's address (static) or the rendezvous host (elastic), as the other nodes reach it
#   MASTER_PORT     rendezvous port on MASTER_ADDR (default 29500; open it in the firewall)
#   RDZV_ID         elastic mode: a job id, the same on every node (NNODES=MIN:MAX needs it)
#   MAX_RESTARTS    how often torchrun restarts the group after a failure (default 0; elastic: 3)
#   RDZV_TIMEOUT    seconds to wait for the other nodes at start-up (default 300)
#   IFNAME          network interface to talk over (default: the one that routes to MASTER_ADDR).
#                   Exported as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME: without it gloo takes the
#                   address of the hostname, which is 127.0.0.1 on many machines, and the job dies
#                   with "Connection refused".
#
# A run that does not finish ends with one `error:` line: the rank that failed and why (a rank's own
# traceback above it, once), or the signal that stopped it (SIGTERM, SIGINT, SIGHUP: the exit status is
# 128 + the signal), the last step and the checkpoint kept. docs/multinode.md: "What the launchers say".
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
note() { echo "launch_multi_node: $*" >&2; }

need_runtime
need_tmpdir
pick_target "$@"  # `./launch_multi_node.sh --max-steps 2` means ddp, as on a single node

# Check everything that can be checked here, one line each, before any port is taken.
nnodes="${NNODES:-1}"
rdzv_id="${RDZV_ID:-}"
if [[ "$nnodes" == *:* && -z "$rdzv_id" ]]; then
  fail "NNODES=$nnodes is elastic (MIN:MAX): also set RDZV_ID to a job id shared by every node"
fi
if [[ -n "$rdzv_id" ]]; then
  [[ "$nnodes" =~ ^([0-9]+)(:([0-9]+))?$ ]] || fail "NNODES=$nnodes: use a count (2) or MIN:MAX (2:4)"
  min_nodes="${BASH_REMATCH[1]}"; max_nodes="${BASH_REMATCH[3]:-$min_nodes}"
  (( min_nodes >= 1 && min_nodes <= max_nodes )) || fail "NNODES=$nnodes: need 1 <= MIN <= MAX"
else
  is_uint "$nnodes" && (( nnodes >= 1 )) || fail "NNODES=$nnodes: use the number of nodes, 1 or more"
  max_nodes="$nnodes"
  node_rank="${NODE_RANK:-0}"
  is_uint "$node_rank" || fail "NODE_RANK=$node_rank: use this node's rank, 0..$((nnodes - 1))"
  (( node_rank < nnodes )) || fail "NODE_RANK=$node_rank but NNODES=$nnodes: node ranks run 0..$((nnodes - 1))"
fi
port="${MASTER_PORT:-29500}"
need_port MASTER_PORT "$port"
rdzv_timeout="${RDZV_TIMEOUT:-300}"
is_uint "$rdzv_timeout" && (( rdzv_timeout >= 1 )) || fail "RDZV_TIMEOUT=$rdzv_timeout: use seconds, 1 or more"
max_restarts="${MAX_RESTARTS:-$([[ -n "$rdzv_id" ]] && echo 3 || echo 0)}"
is_uint "$max_restarts" || fail "MAX_RESTARTS=$max_restarts: use 0 or more"
if [[ -z "${MASTER_ADDR:-}" ]]; then
  (( max_nodes == 1 )) || fail "MASTER_ADDR is not set: set it to node 0's address on every node"
fi
master="${MASTER_ADDR:-127.0.0.1}"

if [[ -n "${NPROC_PER_NODE:-}" ]]; then
  nproc="$NPROC_PER_NODE"
  need_count NPROC_PER_NODE "$nproc" 1 "use 1 or more processes"
else
  nproc=$(default_nproc)
fi
# The network, before the pre-check's seconds: which address is MASTER_ADDR, is it this node, and which
# interface reaches it.
if [[ "$master" =~ ^[0-9.]+$ ]]; then
  master_ip="$master"
else
  master_ip=$(getent ahostsv4 "$master" | awk 'NR == 1 {print $1}') || true
  [[ -n "$master_ip" ]] || fail "MASTER_ADDR=$master: this node cannot resolve that name; use node 0's IP address"
fi
route=$(ip -o route get "$master_ip" 2>/dev/null) || route=""
[[ "$route" == local* || "$master_ip" == 127.* ]] && master_is_here=1 || master_is_here=0
if [[ -n "${IFNAME:-}" ]]; then
  need_interfaces IFNAME "$IFNAME"
  ifname="$IFNAME"
elif [[ -z "$route" ]]; then
  fail "MASTER_ADDR=$master ($master_ip): no route from this node; check the address or set IFNAME"
elif (( master_is_here )); then  # the route is via lo: take the interface that holds the address
  ifname=$(ip -o addr show to "$master_ip" | awk 'NR == 1 {print $2}')
else
  ifname=$(awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}' <<<"$route")
fi
[[ -n "${ifname:-}" ]] || fail "cannot tell which interface reaches MASTER_ADDR=$master: set IFNAME"
local_ip=$(ip -o -4 addr show dev "$ifname" | awk 'NR == 1 {split($4, a, "/"); print a[1]}')
[[ -n "$local_ip" ]] || fail "IFNAME=$ifname has no IPv4 address on this node; set IFNAME to the one that does"
if [[ "$ifname" == lo ]] && (( max_nodes > 1 )); then
  note "warning: MASTER_ADDR=$master is a loopback address here, so other nodes cannot reach this one; use node 0's network address"
fi
note "talking over $ifname ($local_ip); set IFNAME to choose another interface"
export GLOO_SOCKET_IFNAME="$ifname" NCCL_SOCKET_IFNAME="$ifname"

# Fail fast and clearly where torchrun would print a traceback: node 0 not on MASTER_ADDR, the
# port taken there, or (after the pre-check) MASTER_ADDR not reachable from the other nodes.
port_open() { timeout 3 bash -c ": >/dev/tcp/$master_ip/$port" 2>/dev/null; }
is_host=0 waits=0
if [[ -z "$rdzv_id" && "$node_rank" == 0 ]]; then
  (( master_is_here )) || fail "NODE_RANK=0 hosts the rendezvous but MASTER_ADDR=$master is not this node: run node 0 there"
elif [[ -n "$rdzv_id" ]] && (( master_is_here )) && ! port_open; then
  is_host=1  # the c10d store lives in this node's agent
else
  waits=1  # another node hosts the rendezvous
fi
(( waits )) || port_free "$port" \
  || fail "MASTER_PORT=$port is already in use on this node: pick another port (the same on every node)"

precheck $(( nproc * max_nodes ))  # the job's world size at its largest (elastic: MAX nodes)

if (( waits )); then
  deadline=$(( SECONDS + rdzv_timeout ))
  until port_open; do
    (( SECONDS < deadline )) || fail "cannot reach MASTER_ADDR:MASTER_PORT $master_ip:$port from this node via $ifname within ${rdzv_timeout}s: is node 0 up, the address right, the port open in its firewall?"
    [[ -n "${waited:-}" ]] || note "waiting up to ${rdzv_timeout}s for the rendezvous at $master_ip:$port ..."
    waited=1
    sleep 1
  done
fi

if [[ -n "$rdzv_id" ]]; then
  # The c10d store runs inside the agent on the node that holds MASTER_ADDR (say so explicitly:
  # torchrun guesses it from the hostname, which fails where the hostname means 127.0.0.1).
  rendezvous=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-endpoint "$master_ip:$port" --rdzv-id "$rdzv_id"
              --rdzv-conf "join_timeout=$rdzv_timeout,is_host=$is_host" --local-addr "$local_ip")
  # Workers get a store of their own, announced afresh every round. With torchrun's default (the
  # rank-0 agent's store, shared) the address is written only in that agent's first round, so a
  # node started again after a failure waits for MASTER_ADDR in round 1 until join_timeout.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
else
  rendezvous=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$master_ip" --master-port "$port"
              --rdzv-conf "timeout=$rdzv_timeout")
fi

# From here this shell is tools/supervise.py: torchrun, and one closing line for a failure or a stop
# (with this node's and node 0's addresses: a connection lost to a rank here is not the lost peer).
supervise --what "this node ($local_ip)" --note launch_multi_node --max-restarts "$max_restarts" \
  --this-node "$local_ip" --master "$master_ip:$port" -- \
  torchrun "${rendezvous[@]}" --nproc-per-node "$nproc" --max-restarts "$max_restarts" \
  "${worker[@]}" "${target[@]}" ${args[@]+"${args[@]}"}
