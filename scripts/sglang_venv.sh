#!/usr/bin/env bash
# Build the SGLang engine's own virtual environment for SGLang's CPU engine (SGLang 0.5.23).
#
# Why a separate venv: sglang pins CUDA packages (sglang-kernel, torch 2.14.1) and versions of
# transformers harvest does not use. Here sglang is installed without its pins (--no-deps) over
# CPU torch and a locked dependency set (scripts/sglang_cpu.lock, a freeze of a working venv).
# Harvest's repo is put on the venv's path with a .pth (the `harvest` plugin is found through
# SGLANG_PLUGINS=harvest and the entry point registered below), as is the test-only stand-in
# for SGLang's CPU kernels (tests/support/sgl_kernel_standin: PyPI has no CPU sgl-kernel).
#
#   scripts/sglang_venv.sh            # builds $HARVEST_SGLANG_VENV or ~/.cache/harvest/sglang-venv
#   HARVEST_SGLANG_VENV=/opt/sglang scripts/sglang_venv.sh
#
# Idempotent: a marker file (.harvest-complete, holding a hash of this script and the lock) is
# written last; a venv without it, or built by another version of either, is rebuilt from
# scratch. Each run rewrites the .pth to the checkout it runs from. Prints the venv's python.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${HARVEST_SGLANG_VENV:-$HOME/.cache/harvest/sglang-venv}"
MARKER="$VENV/.harvest-complete"
TORCH_VERSION="2.13.0"
SGLANG_VERSION="0.5.23"
PYTHON="${PYTHON:-python3}"
# shellcheck source=scripts/engine_venv.sh
. "$REPO/scripts/engine_venv.sh"
STAMP="$(cat "$REPO/scripts/sglang_venv.sh" "$REPO/scripts/engine_venv.sh" "$REPO/scripts/sglang_cpu.lock" | sha256sum | cut -c1-16)"

point_at_repo() {
  local site
  site="$(venv_site)"
  printf '%s\n%s\n' "$REPO" "$REPO/tests/support/sgl_kernel_standin" > "$site/harvest-repo.pth"
  # SGLang finds plugins by entry point (group sglang.srt.plugins); harvest is not pip-installed
  # here, so its entry point is declared by a minimal dist-info that names no files.
  local di="$site/harvest_sglang_plugin-0.0.0.dist-info"
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: harvest-sglang-plugin\nVersion: 0.0.0\n' > "$di/METADATA"
  printf '[sglang.srt.plugins]\nharvest = harvest.engines.sglang_plugin:register\n' > "$di/entry_points.txt"
  : > "$di/RECORD"
}

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$STAMP" ]]; then
  point_at_repo
  echo "$VENV/bin/python"
  exit 0
fi

fresh_venv_with_cpu_torch
"$VENV/bin/python" -c 'import sys, torch; sys.exit("need a CPU-only torch, got CUDA " + str(torch.version.cuda) if torch.version.cuda else 0)'
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" -r "$REPO/scripts/sglang_cpu.lock"
"${pip[@]}" --no-deps torchvision==0.28.0 xgrammar==0.2.7 compressed-tensors==0.18.0
# torchvision 0.28.0 on PyPI is a CUDA build whose _C.so cannot load; SGLang only needs
# torchvision.transforms. Skip the two fake-kernel registrations that need _C.
tv="$("$VENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')"
sed -i 's|^@torch.library.register_fake("torchvision::\(q\?nms\)")|@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))|' \
  "$tv/_meta_registrations.py"

point_at_repo
# Smoke check: SGLang's CPU engine modules, the stand-in and harvest's plugin import, and the entry point is seen.
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" - <<'PY' >/dev/null
from importlib.metadata import entry_points

import sgl_kernel
import sglang.srt.mem_cache.allocation  # noqa: F401  (imports assign_req_to_token_pool_cpu)
import torchvision.transforms  # noqa: F401

import harvest.engines.sglang_plugin  # noqa: F401

assert "standin" in sgl_kernel.__version__
assert [e for e in entry_points(group="sglang.srt.plugins") if e.name == "harvest"]
PY
echo "$STAMP" > "$MARKER"
echo "$VENV/bin/python"
