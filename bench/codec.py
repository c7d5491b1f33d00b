"""Which lossless codec pays for stored hidden states, by how much, and at what speed?

Each candidate compresses one sample's hidden states of one capture point (`[T, H]`, the bytes
a shard stores for it) and decompresses them again, on one thread (MB/s per core, of raw bytes),
checked bit-identical. Candidates:

- `blosc2-zstd`: blosc2, byte shuffle (the byte planes split per block) then zstd level 1:
  harvest's `--codec blosc2-zstd` (harvest.formats.codec);
- `blosc2-bdelta`: the same with bytedelta between them (each plane delta-coded along the
  hidden dimension): it measures worse on both kinds of data, so harvest leaves it out;
- `zstd-planes`: the byte planes split with numpy (`view(uint8).reshape(-1, itemsize).T`), then
  `zstandard` level 1 over them;
- `pcodec`: pcodec's standalone format at its default level, on the values as integers of their
  width (bf16 as uint16; no fp8: pcodec takes no 8-bit type).

Per storage dtype (bf16, fp16, fp32, fp8_e4m3 with harvest's per-row scales, whose bytes are
the fp8 values only) it prints each capture point's ratio, the ratio of all of them, and encode
and decode MB/s, on two kinds of data:

- `tiny`: a randomly initialised Llama (`--tiny-layers`, `--tiny-hidden` wide) run on random
  tokens, like the tests' tiny models: its residual streams are near-Gaussian, with no outlier
  dimensions;
- `trained`: synthetic states built to the published statistics of trained LLM residual streams
  (`--hidden` wide, `--layers` deep, captured at the EAGLE-3 preset 2, L/2, L-3 and L):
  * heavy tails: Student-t values with 4 degrees of freedom, times a per-dimension scale drawn
    log-normal (sigma 0.6), fixed across tokens and layers (outlier feature dimensions);
  * massive activations: 4 fixed dimensions holding values 50-400 times the row's median
    magnitude from the early layers on, with the first token (an attention sink) larger still;
  * norm growing with depth: the row RMS rises geometrically from 1 at layer 0 to 40 at layer L-1;
  * the final point is post-norm (RMSNorm with a log-normal weight): RMS near 1, massive
    dimensions damped.
  The numbers are rough: measure a real model's ratio on your own run (`harvest ratio`).

    python bench/codec.py --tokens 512 --hidden 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from harvest.formats.fp8 import quantize  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8_e4m3": None}


def _blosc2(bytedelta: bool) -> tuple[Callable[[np.ndarray], bytes], Callable[[bytes, np.ndarray], np.ndarray]]:
    import blosc2

    filters = [blosc2.Filter.SHUFFLE] + ([blosc2.Filter.BYTEDELTA] if bytedelta else [])

    def enc(a: np.ndarray) -> bytes:
        return blosc2.compress2(
            a,
            typesize=a.itemsize,
            clevel=1,
            codec=blosc2.Codec.ZSTD,
            filters=filters,
            filters_meta=[0] * len(filters),
            nthreads=1,
        )

    def dec(b: bytes, like: np.ndarray) -> np.ndarray:
        return np.frombuffer(blosc2.decompress2(b, nthreads=1), dtype=like.dtype)

    return enc, dec


def _zstd_planes() -> tuple[Callable, Callable]:
    import zstandard

    cctx, dctx = zstandard.ZstdCompressor(level=1, threads=0), zstandard.ZstdDecompressor()

    def enc(a: np.ndarray) -> bytes:
        planes = np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T)
        return cctx.compress(planes.tobytes())

    def dec(b: bytes, like: np.ndarray) -> np.ndarray:
        planes = np.frombuffer(dctx.decompress(b), dtype=np.uint8).reshape(like.itemsize, -1)
        return np.ascontiguousarray(planes.T).view(like.dtype).reshape(-1)

    return enc, dec


def _pcodec() -> tuple[Callable, Callable]:
    from pcodec import ChunkConfig, standalone

    def enc(a: np.ndarray) -> bytes:
        return standalone.simple_compress(a, ChunkConfig())

    def dec(b: bytes, like: np.ndarray) -> np.ndarray:
        return standalone.simple_decompress(b)

    return enc, dec


CODECS = {
    "blosc2-zstd": lambda: _blosc2(False),
    "blosc2-bdelta": lambda: _blosc2(True),
    "zstd-planes": _zstd_planes,
    "pcodec": _pcodec,
}


def tiny_states(tokens: int, hidden: int, layers: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """`[T, K, H]` float32 states of a random Llama at the EAGLE-3 points (2, L/2, L-3, L)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(4096, tokens),
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 512, (1, tokens))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    points = [2, layers // 2, layers - 3, layers]
    return torch.stack([hs[p][0] for p in points], dim=1), points


def trained_states(tokens: int, hidden: int, layers: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """`[T, K, H]` float32 synthetic states with the statistics the docstring lists."""
    g = torch.Generator().manual_seed(seed)
    dim_scale = torch.exp(0.6 * torch.randn(hidden, generator=g))
    massive = torch.randperm(hidden, generator=g)[:4]
    massive_gain = torch.tensor([400.0, -250.0, 120.0, -50.0])
    norm_weight = torch.exp(0.3 * torch.randn(hidden, generator=g))
    points = [2, layers // 2, layers - 3, layers]
    out = []
    t_dist = torch.distributions.StudentT(4.0)
    base = t_dist.sample((tokens, hidden)) * dim_scale  # a token's stream is mostly carried through the layers
    for p in points:
        depth = min(p, layers - 1) / max(layers - 1, 1)
        x = 0.7 * base + 0.7 * t_dist.sample((tokens, hidden)) * dim_scale
        med = x.abs().median(dim=-1, keepdim=True).values
        grow = min(1.0, p / 3)  # massive activations appear in the first layers and then stay
        x[:, massive] = med * massive_gain * grow
        x[0, massive] *= 4  # the attention sink
        x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * 40.0**depth
        if p == layers:  # post-norm final state
            x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * norm_weight
        out.append(x)
    return torch.stack(out, dim=1), points


def stored(states: torch.Tensor, dtype: str) -> torch.Tensor:
    """`states` `[T, K, H]` as the shard stores them."""
    if DTYPES[dtype] is None:
        return quantize(states)[0]
    return states.to(DTYPES[dtype])


def as_numpy(t: torch.Tensor, codec: str) -> np.ndarray:
    """A point's `[T, H]` values as the flat array a codec is handed (pcodec: an integer of the width)."""
    raw = t.contiguous().view(torch.uint8).numpy()
    width = t.element_size()
    if codec == "pcodec" or t.dtype in (torch.bfloat16,) or width == 1:
        kind = {1: np.uint8, 2: np.uint16, 4: np.float32 if t.dtype == torch.float32 else np.uint32}[width]
    else:
        kind = {2: np.float16, 4: np.float32}[width]
    return raw.view(kind).reshape(-1)


def measure(codec: str, arrays: list[np.ndarray], repeats: int) -> tuple[list[float], float, float] | None:
    """(ratio per array, encode MB/s, decode MB/s), medians over `repeats`; None where the codec
    takes no such values."""
    enc, dec = CODECS[codec]()
    raw = sum(a.nbytes for a in arrays)
    enc_t, dec_t, sizes = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            coded = [enc(a) for a in arrays]
        except (TypeError, ValueError, RuntimeError):
            return None
        t1 = time.perf_counter()
        back = [dec(b, a) for b, a in zip(coded, arrays, strict=False)]
        t2 = time.perf_counter()
        for a, b in zip(arrays, back, strict=False):
            if a.view(np.uint8).tobytes() != np.asarray(b).view(np.uint8).tobytes():
                raise AssertionError(f"{codec}: not lossless")
        enc_t.append(t1 - t0)
        dec_t.append(t2 - t1)
        sizes = [len(b) for b in coded]
    return (
        [a.nbytes / s for a, s in zip(arrays, sizes, strict=False)] + [raw / sum(sizes)],
        raw / statistics.median(enc_t) / 1e6,
        raw / statistics.median(dec_t) / 1e6,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=4096, help="width of the trained-like states")
    ap.add_argument("--layers", type=int, default=32, help="depth of the trained-like model")
    ap.add_argument("--tiny-hidden", type=int, default=256)
    ap.add_argument("--tiny-layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kinds = {
        "tiny": tiny_states(args.tokens, args.tiny_hidden, args.tiny_layers, args.seed),
        "trained": trained_states(args.tokens, args.hidden, args.layers, args.seed),
    }
    for kind, (states, points) in kinds.items():
        print(f"\n{kind}: [T={states.shape[0]}, K={states.shape[1]}, H={states.shape[2]}], points {points}")
        cols = " ".join(f"{'p' + str(p):>6}" for p in points)
        print(f"{'dtype':9} {'codec':13} {cols} {'all':>6} {'enc MB/s':>9} {'dec MB/s':>9}")
        for dtype in DTYPES:
            s = stored(states, dtype)
            for codec in args.codecs.split(","):
                arrays = [as_numpy(s[:, k], codec) for k in range(s.shape[1])]
                got = measure(codec, arrays, args.repeats)
                if got is None:
                    print(f"{dtype:9} {codec:13} (takes no {dtype})")
                    continue
                ratios, e, d = got
                print(f"{dtype:9} {codec:13} " + " ".join(f"{r:6.2f}" for r in ratios) + f" {e:9.0f} {d:9.0f}")


if __name__ == "__main__":
    main()
