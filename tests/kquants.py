"""A small reference encoder for llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K), which gguf 0.19 reads but cannot
write: float weights [N, K] (K a multiple of 256) -> raw blocks [N, K / 256 * bytes] (uint8), laid out as
ggml-quants.c lays them out. Not llama.cpp's search for the best scales (any valid blocks test a kernel): each
sub-block's scale and minimum from its range, rounded to 6 bits (8 for Q6_K) against the super-block's float16 d.
`gguf.quants.dequantize` reads what this writes (tests/unit/test_block_tiles.py checks the round trip)."""

import numpy as np

QK_K = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], 2)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and minimums [..., 8] into 12 bytes (ggml's get_scale_min_k4 reads them back)."""
    low = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    mid = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    high = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([low, mid, high], axis=-1).astype(np.uint8)


def _scales_and_minimums(blocks: np.ndarray, levels: int):
    """Per super-block d, dmin (float16-rounded) and per sub-block 6-bit sc, mn and integer q (0..levels)."""
    lows = np.minimum(blocks.min(axis=-1), 0)  # [n, s, 8]
    scales = (blocks.max(axis=-1) - lows) / levels
    d = (scales.max(axis=-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lows).max(axis=-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.clip(np.rint(scales / d), 1, 63), 1).astype(np.uint8)
        mn = np.where(dmin > 0, np.clip(np.rint(-lows / dmin), 0, 63), 0).astype(np.uint8)
        step = d * sc
        q = np.where(step[..., None] > 0, np.rint((blocks + (dmin * mn)[..., None]) / step[..., None]), 0)
    return d, dmin, sc, mn, np.clip(q, 0, levels).astype(np.uint8)


def encode(weights: np.ndarray, kind: str) -> np.ndarray:
    n, k = weights.shape
    s = k // QK_K
    if kind in ("Q4_K", "Q5_K"):
        d, dmin, sc, mn, q = _scales_and_minimums(weights.reshape(n, s, 8, 32).astype(np.float32),
                                                  15 if kind == "Q4_K" else 31)
        pairs = (q & 15).reshape(n, s, 4, 2, 32)
        qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, s, 128)
        parts = [_f16(d), _f16(dmin), _pack_k_scales(sc, mn)]
        if kind == "Q5_K":  # bit t of byte l: sub-block t's weight l, fifth bit
            parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=2))
        raw = np.concatenate(parts + [qs], axis=-1)
    elif kind == "Q6_K":
        blocks = weights.reshape(n, s, 16, 16).astype(np.float32)
        scales = np.abs(blocks).max(axis=-1) / 31
        d = (scales.max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.where(d > 0, np.clip(np.rint(scales / d), 1, 127), 1).astype(np.int8)
            step = (d * sc)[..., None]
            q = (np.clip(np.where(step > 0, np.rint(blocks / step), 0), -32, 31) + 32).astype(np.uint8)
        q = q.reshape(n, s, 2, 4, 32)  # weight h * 128 + part * 32 + l
        ql = np.concatenate([(q[:, :, :, 0:2] & 15).reshape(n, s, 2, 64) | ((q[:, :, :, 2:4] & 15).reshape(
            n, s, 2, 64) << 4)], axis=-1).reshape(n, s, 128)
        qh = np.bitwise_or.reduce((q >> 4) << np.array([0, 2, 4, 6], np.uint8)[:, None], axis=3).reshape(n, s, 64)
        raw = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=-1)
    else:
        raise ValueError(kind)
    return np.ascontiguousarray(raw.reshape(n, -1), dtype=np.uint8)
