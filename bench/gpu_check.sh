#!/usr/bin/env bash
# GPU check: every recipe for a few steps on a CUDA machine, in well under 5 minutes. CI never needs it.
#
#   bench/gpu_check.sh            # from anywhere; prints one line per check and exits non-zero on a failure
#
# 1. each recipe on nccl at world size 1;
# 2. each recipe as 2 processes over gloo sharing one GPU (TDR_BACKEND=gloo);
# 3. ddp_amp with fp16 (GradScaler) and bf16; the GPU-only options (bf16 comm hook, channels-last, --debug);
# 4. the tiny GPT on ddp: step time, tokens/s and MFU (fp32 and --compile);
# 5. the memory plan against torch.cuda.max_memory_allocated per recipe, and the fixed terms no tracker sees
#    (CUDA context, NCCL buffers, allocator slack), on 1 process (nccl) and 2 sharing the GPU (gloo);
# 6. the fixed terms the plan adds (tools/plan_fixed.py) beside this GPU's: the CUDA context and cuBLAS's workspace.
# A recipe that refuses a world size (a one-line `error:`, e.g. a pipeline with one stage) is a skip, not a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi -L || true
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "no CUDA GPU visible"; exit 1; }

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
export OMP_NUM_THREADS=4 GLOO_SOCKET_IFNAME=lo PYTHONUNBUFFERED=1
failures=0
launch() { python -m torch.distributed.run --standalone --nproc-per-node "$@"; }

check() {  # check LABEL COMMAND...: ok with the summary line, skip on a one-line refusal, FAIL otherwise
  local label=$1; shift
  local started=$SECONDS
  if timeout 150 "$@" --out "$OUT/runs" >"$OUT/log" 2>&1; then
    printf 'ok    %-44s %3ss  %s\n' "$label" $((SECONDS - started)) "$(grep '^summary' "$OUT/log" | tail -1 | cut -c9-150)"
  elif grep -q '^error: ' "$OUT/log" && ! grep -q Traceback "$OUT/log"; then
    printf 'skip  %-44s %s\n' "$label" "$(grep -m1 '^error: ' "$OUT/log" | cut -c1-150)"; return 1
  else
    printf 'FAIL  %-44s\n' "$label"; tail -15 "$OUT/log" | sed 's/^/      /'; failures=$((failures + 1)); return 1
  fi
}

last_train() {  # the last train record of the newest run: step time, throughput, MFU
  python - "$OUT/runs" <<'EOF'
import json, sys, pathlib
run = max(pathlib.Path(sys.argv[1]).glob("*-*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
r = [json.loads(l) for l in run.read_text().splitlines() if '"kind": "train"' in l][-1]
print(f"      step {r.get('step_ms', float('nan')):.2f} ms  {r.get('tokens_per_s', r['samples_per_s']):.0f} tokens/s  "
      f"MFU {100 * r.get('mfu', float('nan')):.2f}%  peak mem {r.get('peak_mem_mb', 0):.0f} MB")
EOF
}

for recipe in $(python -m recipes ls | awk 'NR > 1 {print $1}'); do
  check "$recipe: nccl x1" launch 1 -m recipes run "$recipe" --max-steps 20 --log-every 10
  check "$recipe: gloo x2 on one GPU" env TDR_BACKEND=gloo \
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m recipes run "$recipe" --max-steps 10 --log-every 5
done

check "ddp_amp: fp16 + GradScaler" launch 1 -m recipes run ddp_amp --precision fp16 --max-steps 30 --log-every 10
check "ddp_amp: bf16" launch 1 -m recipes run ddp_amp --precision bf16 --max-steps 30 --log-every 10
check "ddp_monitored: --comm-hook bf16 (nccl)" launch 1 -m recipes run ddp_monitored --comm-hook bf16 --max-steps 20 \
  --log-every 10
check "ddp_monitored: cnn --channels-last" launch 1 -m recipes run ddp_monitored --model cnn --channels-last \
  --max-steps 20 --log-every 10
check "ddp_monitored: --debug (DETAIL, flight recorder)" launch 1 -m recipes run ddp_monitored --debug --max-steps 10 \
  --log-every 5
check "ddp_monitored: --ckpt-async (pinned host copy)" launch 1 -m recipes run ddp_monitored --ckpt-async \
  --ckpt-every 10 --max-steps 30 --log-every 10
check "ddp_monitored: gpt fp32, 200 steps" launch 1 -m recipes run ddp_monitored --model gpt --data text \
  --batch-size 64 --max-steps 200 --log-every 50 && last_train
check "ddp_monitored: gpt --compile, 200 steps" launch 1 -m recipes run ddp_monitored --model gpt --data text \
  --batch-size 64 --compile --max-steps 200 --log-every 50 && last_train

for plan_world in 1 2; do  # 5. the table of bench/bench_plan.py --gpu; two processes share the GPU over gloo
  extra=(); [ "$plan_world" = 2 ] && extra=(env TDR_BACKEND=gloo)
  if ! timeout 300 "${extra[@]}" python -m torch.distributed.run --standalone --nproc-per-node "$plan_world" \
      bench/bench_plan.py --gpu 2>"$OUT/plan.log" | grep -v '^{'; then
    printf 'FAIL  %-44s\n' "memory plan on $plan_world process(es)"; tail -15 "$OUT/plan.log" | sed 's/^/      /'
    failures=$((failures + 1))
  fi
done

# 6. The plan's fixed terms (docs/memory-plan.md) against this GPU, one fresh process on an otherwise idle GPU: the
# context as used minus reserved, after the first tensor and after the first matmul (lazy loading loads its kernels
# then); the workspace as what the allocator keeps after the first matmul, less its output. NCCL's buffers and the
# allocator's slack are bench_plan.py's lines of step 5, next to the plan's figures printed here.
if ! timeout 120 python - <<'EOF'
import torch

from tools.plan_fixed import MIB, fixed_terms

torch.empty(1, device="cuda")
free, total = torch.cuda.mem_get_info()
first = total - free - torch.cuda.memory_reserved()
a = torch.randn(1024, 1024, device="cuda")
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
c = a @ a
torch.cuda.synchronize()
workspace = torch.cuda.memory_allocated() - before - c.untyped_storage().nbytes()
context = total - torch.cuda.mem_get_info()[0] - torch.cuda.memory_reserved()
plan = fixed_terms(dims={}, world_size=2)  # the defaults on this GPU (TDR_FIXED, CUDA_MODULE_LOADING read as set)
print(f"fixed terms on {torch.cuda.get_device_name()}, measured (plan's figure):")
print(f"      CUDA context {first / MIB:.0f} MiB after the first tensor, {context / MIB:.0f} MiB after a matmul "
      f"({plan.context_bytes / MIB:.0f}); cuBLAS workspace {workspace / MIB:.2f} MiB ({plan.workspace_bytes / MIB:.2f})")
print(f"      NCCL buffers: step 5's ({plan.nccl_bytes_each / MIB:.0f} MiB per communicator); allocator slack: step "
      f"5's slack column ({plan.headroom:.0%} of the peak)")
EOF
then
  printf 'FAIL  %-44s\n' "fixed terms measured"; failures=$((failures + 1))
fi

echo "$failures failure(s)"
exit $((failures > 0))
