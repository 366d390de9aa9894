#!/usr/bin/env bash
# launch_single_node.sh: train a recipe on this machine, one process per GPU (or 2 on CPU), with torchrun.
#
#   ./launch_single_node.sh                          # the ddp recipe on the embedded digits data
#   ./launch_single_node.sh ddp --epochs 3 --lr 3e-3 # a recipe and its options (see: python -m recipes run ddp --help)
#   ./launch_single_node.sh train.py --epochs 3      # a recipe copied out with `python -m recipes cp`
#
# Environment:
#   NPROC_PER_NODE  processes to start (default: the number of GPUs, or 2 on a CPU-only machine)
#   MASTER_PORT     rendezvous port (default: torchrun picks a free one, so jobs never collide)
#   MAX_RESTARTS    how often torchrun restarts the whole group after a failure (default 0)
set -euo pipefail

recipe=ddp
if [[ $# -gt 0 && "$1" != -* ]]; then  # `./launch_single_node.sh --epochs 3` still means ddp
  recipe="$1"
  shift
fi
if [[ "$recipe" == *.py ]]; then
  target=("$recipe")
else
  target=(-m recipes run "$recipe")
fi

# Bad options fail here, once, with one line, before any process or port is taken.
python "${target[@]}" "$@" --dry-run >/dev/null

if [[ -n "${NPROC_PER_NODE:-}" ]]; then
  nprocs="$NPROC_PER_NODE"
else
  gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
  nprocs=$(( gpus > 0 ? gpus : 2 ))
fi
case "$recipe" in
  dp|pipeline_naive) nprocs=1 ;;  # one process drives every local device
esac
# Share the cores between the processes (torchrun would otherwise set 1 and warn about it).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / nprocs > 0 ? $(nproc) / nprocs : 1 ))}"

if [[ -n "${MASTER_PORT:-}" ]]; then
  rendezvous=(--nnodes 1 --master-addr 127.0.0.1 --master-port "$MASTER_PORT")
else
  rendezvous=(--standalone)  # a free port on localhost, chosen by torchrun
fi

# A restarted group must not reuse the first round's store: stale gloo addresses in it make the
# new workers dial dead ones ("Connection refused"); see pytorch/pytorch#135712.
if [[ "${MAX_RESTARTS:-0}" != 0 ]]; then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
fi

exec torchrun "${rendezvous[@]}" --nproc-per-node "$nprocs" --max-restarts "${MAX_RESTARTS:-0}" \
  "${target[@]}" "$@"
