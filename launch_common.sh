# launch_common.sh: what launch_single_node.sh and launch_multi_node.sh share. Sourced, not run.
#   fail / need_count / need_port      one `error:` line naming the variable, the value and the fix
#   need_runtime / need_tmpdir         torchrun on PATH, a usable TMPDIR: one line each, before anything starts
#   need_interfaces NAME VALUE         every interface in VALUE (a,b) exists on this machine
#   port_free PORT                     nothing listens on PORT here (torchrun's store would fail to bind)
#   pick_target ARGS...                the recipe name (default ddp) and how to start it
#   default_nproc                      one process per GPU torch sees, or 2 on a machine without GPUs
#   precheck WORLD_SIZE                the package's pre-check of the job, one line for what would fail (a copy: none)
#   supervise OPTIONS -- torchrun ...  become tools/supervise.py: torchrun, its ranks wrapped by tools/worker.py,
#                                      and one closing line for a failure or a stop (see that file)

fail() { echo "error: $*" >&2; exit 2; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
# need_count NAME VALUE MIN FIX: a whole number >= MIN (10# so that 08 is eight, not bad octal)
need_count() { is_uint "$2" && (( 10#$2 >= $3 )) || fail "$1=$2: $4"; }
need_port() { is_uint "$2" && (( 10#$2 >= 1 && 10#$2 <= 65535 )) || fail "$1=$2: use a TCP port, 1..65535"; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

need_runtime() {
  local activate="activate the Python environment torch is installed in (e.g. source .venv/bin/activate)"
  command -v python >/dev/null || fail "python is not on PATH: $activate"
  command -v torchrun >/dev/null || fail "torchrun is not on PATH: $activate; torchrun comes with torch, in its bin/ folder"
}

need_tmpdir() {
  [[ -z "${TMPDIR:-}" || ( -d "$TMPDIR" && -w "$TMPDIR" ) ]] \
    || fail "TMPDIR=$TMPDIR is not a writable folder: create it, or unset TMPDIR (then /tmp)"
}

need_interfaces() {
  local name
  for name in ${2//,/ }; do
    [[ -e "/sys/class/net/$name" ]] \
      || fail "$1=$2: no interface $name on this machine (have: $(ls /sys/class/net | tr '\n' ' ' | sed 's/ $//')); name one of those, or unset $1"
  done
}

# A machine without a GPU driver (no /dev/nvidia0, no ROCm's /dev/kfd) has no GPU torch could see: 2 processes, and
# no python started only to import torch (seconds) and count none.
default_nproc() {
  local gpus=0
  if compgen -G "/dev/nvidia[0-9]*" >/dev/null || [[ -e /dev/kfd ]]; then
    gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
  fi
  echo $(( gpus > 0 ? gpus : 2 ))
}

port_free() { python -c 'import socket, sys; socket.create_server(("", int(sys.argv[1])))' "$1" 2>/dev/null; }

# Sets `recipe` and `target` (the command a rank runs) and `args` (the recipe's options). A first argument
# that is an option (`--max-steps 2`) means the default recipe, ddp.
pick_target() {
  recipe=ddp
  if [[ $# -gt 0 && "$1" != -* ]]; then recipe="$1"; shift; fi
  # -u: unbuffered, as torchrun starts python itself; tools/worker.py sits between torchrun and the rank
  local py
  py=$(command -v python || echo python)
  if [[ "$recipe" == *.py ]]; then target=("$py" -u "$recipe"); else target=("$py" -u -m recipes run "$recipe"); fi
  [[ "$recipe" != *.py || -f "$recipe" ]] \
    || fail "$recipe: no such file; name a recipe file (python -m recipes cp NAME FILE writes one) or a recipe, e.g. ddp"
  worker=(--no-python "$py" "$here/tools/worker.py")
  args=("$@")
}

# Bad recipe options, factories, a resume that can't continue at this world size: one line, here, before torchrun
# (tools/precheck.py, through `recipes run NAME ... --dry-run`). It dies with this shell (TDR_DIE_WITH_PARENT: its PID),
# so a SIGTERM to the launcher ends it too. --dry-run among the options: the check is the whole job, its lines shown.
# A recipe file (a copy, standalone or not) has no pre-check and no --dry-run: its ranks check their options as they start.
precheck() {
  [[ "$recipe" != *.py ]] || return 0
  if [[ " ${args[*]-} " == *" --dry-run "* ]]; then
    TDR_DIE_WITH_PARENT=$$ WORLD_SIZE="$1" "${target[@]}" "${args[@]}"
    exit 0
  fi
  TDR_DIE_WITH_PARENT=$$ WORLD_SIZE="$1" "${target[@]}" ${args[@]+"${args[@]}"} --dry-run >/dev/null
  export TDR_PRECHECKED=1  # the ranks skip the pre-check this has just run (python -m recipes run reads it)
}

# This shell becomes the supervisor (same PID: a signal to the launcher is a signal to it).
supervise() { exec python "$here/tools/supervise.py" "$@"; }
