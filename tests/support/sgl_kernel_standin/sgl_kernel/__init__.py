"""sgl_kernel: test-only stand-in for SGLang's CPU kernels. Never use it to serve a model.

Why it exists: PyPI publishes no CPU build and no sdist of sgl-kernel / sglang-kernel, yet
SGLang 0.5.23's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports a few of its CPU ops at module
load even without Intel AMX. scripts/sglang_venv.sh puts this directory on the SGLang venv's
path so that a real SGLang server runs in CI (tests/system/test_sglang_live.py).

What it does: `assign_req_to_token_pool_cpu`, the one op the plain prefill path calls
(mem_cache/allocation.py, on every prefill), is implemented in torch. Every other name SGLang
imports raises NotImplementedError naming itself, so a path that needs the real kernels fails
loudly instead of computing something else.

What it deliberately leaves out: `torch.ops.sgl_kernel.convert_weight_packed` is not
registered, so SGLang's `_is_intel_amx_backend_available()` stays False and every AMX path
stays off (those would call kernels this stand-in does not have).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__version__ = "0.0.0+harvest.test.standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th request's slice of
    out_cache_loc (the slices lie back to back), as SGLang's triton `assign_req_to_token_pool`."""
    pos = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=False):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += max(n, 0)


def _missing(name: str) -> Callable[..., None]:
    def op(*args, **kwargs) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name}: not in harvest's test-only stand-in for SGLang's CPU kernels "
            "(needs the real CPU build of sgl-kernel)"
        )

    op.__name__ = op.__qualname__ = name
    return op


# Imported at module load by SGLang 0.5.23's CPU engine (kvcache/cache_move.py, speculative/*), never called
# by the plain prefill/decode path.
copy_all_layer_kv_cache_cpu = _missing("copy_all_layer_kv_cache_cpu")
rotate_input_ids_cpu = _missing("rotate_input_ids_cpu")
fill_accept_out_cache_loc_cpu = _missing("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _missing("fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = _missing("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _missing("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _missing("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _missing("verify_tree_greedy_cpu")
