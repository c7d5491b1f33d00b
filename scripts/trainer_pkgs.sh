#!/usr/bin/env bash
# Install the drafter trainers whose own reader code tests/system/test_trainers.py checks harvest's
# exports with: SpecForge 0.2.0, speculators 0.9.0 and hs-connectors 0.9.0, from PyPI, without their
# dependency trees (those pull CUDA builds, vLLM, Mooncake...). Their readers, collators, target
# computations and speculators' training entry point import only what harvest's dev environment has,
# plus the small packages below: speculators imports openai and loguru at module level, and openai needs
# sniffio and jiter besides what the dev extras bring (anyio, httpx2, pydantic); installed without their
# dependencies, every package they import is named here. pydantic-settings and rich usually come with the
# dev extras already, through moto and typer.
#
#   scripts/trainer_pkgs.sh        # idempotent: pip skips what is installed; ~10 s, ~15 MB
set -euo pipefail
python3 -m pip install -q --no-deps specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
python3 -m pip install -q --no-deps openai==3.57.0 loguru==0.7.3 jiter==0.19.0 sniffio==1.3.1
python3 -m pip install -q 'pydantic-settings>=2' 'rich>=13'
python3 -c 'import specforge.runtime.data_plane.offline_reader, specforge.modeling.target.target_head, speculators.train.cli'
