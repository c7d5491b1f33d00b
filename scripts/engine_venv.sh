# Shared by scripts/vllm_venv.sh and scripts/sglang_venv.sh (sourced, not run): the steps every
# engine venv starts with. Expects VENV, PYTHON and TORCH_VERSION to be set by the script.

# The venv's site-packages, where the harvest-repo.pth that points at this checkout goes.
venv_site() {
  "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

# A new, empty venv at $VENV with CPU torch first, so the engine's own pins cannot pull a CUDA
# build. Where no local CPU wheel is configured (pip find-links), set TORCH_INDEX_URL, e.g.
# https://download.pytorch.org/whl/cpu, or plain PyPI hands Linux a multi-GB CUDA build.
# Leaves `pip` (an array: the venv's quiet pip install) for the script's own installs.
fresh_venv_with_cpu_torch() {
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q)
  "${pip[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
}
