"""Undoing the final norm for speculators: `y / w` is what its trainer's norm maps back onto
the stored post-norm state; (1 + w) norms and zero weights are refused."""

import pytest
import torch

from harvest.read.final_norm import FinalNorm, FinalNormError


def _rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_unapply_then_the_trainers_norm_gives_the_stored_state_back():
    g = torch.Generator().manual_seed(0)
    w = torch.empty(64).uniform_(0.3, 2.0, generator=g)
    x = torch.randn(50, 64, generator=g) * 7  # the real pre-norm state: any scale
    y = _rms_norm(x, w, 1e-6)
    z = FinalNorm(w, 1e-6).unapply(y)
    assert z.dtype == torch.float32
    assert torch.allclose(z, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), rtol=1e-5, atol=1e-6)
    back = _rms_norm(z, w, 1e-6)
    assert (back - y).abs().max() / y.abs().max() < 1e-5
    assert (_rms_norm(y, w, 1e-6) - y).abs().max() > 0.1  # the norm applied twice is far off: why it matters


def test_unapply_refuses_what_it_cannot_invert():
    with pytest.raises(
        FinalNormError, match=r"model type 'gemma2' scales its final norm by \(1 \+ w\).*--format specforge"
    ):
        norm = FinalNorm(torch.ones(8), 1e-6, offset=True)
        norm.model_type = "gemma2"
        norm.unapply(torch.ones(2, 8))
    w = torch.ones(8)
    w[3] = 0
    with pytest.raises(FinalNormError, match=r"the final norm's weight is 0 at 1 channels \(first \[3\]\)"):
        FinalNorm(w, 1e-6).unapply(torch.ones(2, 8))
