"""Mamba ops of the test-only stand-in for SGLang's CPU kernels: none implemented (see sgl_kernel)."""

from sgl_kernel import _missing

chunk_gated_delta_rule_cpu = _missing("chunk_gated_delta_rule_cpu")
causal_conv1d_fn_cpu = _missing("causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = _missing("causal_conv1d_update_cpu")
