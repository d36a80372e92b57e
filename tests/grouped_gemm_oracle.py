"""grouped_matmul's maths in plain numpy (float64 from the inputs' values), one
group at a time, for tests/test_grouped_gemm.py and its GPU twin."""

import numpy as np


def offsets(sizes):
    """Start row of each group: the exclusive cumsum of sizes."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def forward(x, w, sizes, rows=None):
    """y [M, N]: x[m] @ w[g(m)] on group rows, 0 past them. `rows` (optional)
    limits the work to those row indices (the others stay 0)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x.shape[0], w.shape[2]))
    for g, start in enumerate(offsets(sizes)):
        sel = _rows_of(start, sizes[g], rows)
        y[sel] = x[sel] @ w[g]
    return y


def input_grad(dy, w, sizes, rows=None):
    """dx [M, K]: dy[m] @ w[g(m)]^T on group rows, 0 past them."""
    dy, w = np.asarray(dy, np.float64), np.asarray(w, np.float64)
    dx = np.zeros((dy.shape[0], w.shape[1]))
    for g, start in enumerate(offsets(sizes)):
        sel = _rows_of(start, sizes[g], rows)
        dx[sel] = dy[sel] @ w[g].T
    return dx


def weight_grad(x, dy, sizes, groups=None):
    """dw [G, K, N]: x_g^T dy_g; `groups` (optional) limits the work to those groups."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    dw = np.zeros((len(sizes), x.shape[1], dy.shape[1]))
    for g, start in enumerate(offsets(sizes)):
        if groups is None or g in groups:
            dw[g] = x[start : start + sizes[g]].T @ dy[start : start + sizes[g]]
    return dw


def _rows_of(start, size, rows):
    sel = np.arange(start, start + size)
    return sel if rows is None else np.intersect1d(sel, rows)


def fp8_row_parts(a):
    """a [..., C] -> (FP8 values as float32 [..., C], float32 scales [..., 1]): each
    row quantized to float8_e4m3fn with one scale, as grouped_matmul's FP8 path
    does (oracle's FP8 with one block per row and amax floored only at 1e-30)."""
    from oracle import fp8_scales, fp8_values

    a = np.asarray(a, np.float32)
    scales = fp8_scales(a, block=a.shape[-1], min_amax=1e-30)
    return fp8_values(a, scales, block=a.shape[-1]), scales


def fp8_rows(a):
    """a [..., C] as grouped_matmul's FP8 path sees it (float64), quantized per row."""
    values, scales = fp8_row_parts(a)
    return values.astype(np.float64) * scales


def fp8_weight_grad(x, dy, sizes):
    """dw [G, K, N] of grouped_matmul's FP8 path: x's FP8 values (per-row
    quantization) against z = dy * x's row scales (float32, 0 past the groups)
    quantized per column."""
    x_values, x_scales = fp8_row_parts(x)
    z = np.asarray(dy, np.float32) * x_scales
    z[int(np.sum(sizes)) :] = 0
    return weight_grad(x_values, fp8_rows(z.T).T, sizes)


def fp8_weights(w):
    """(forward, input gradient) copies of w [G, K, N] as grouped_matmul's
    FP8 path sees them, both [G, K, N] float64: one scale per column of w[g]
    (the forward's output channel), one per row (the input gradient's)."""
    return np.swapaxes(fp8_rows(np.swapaxes(np.asarray(w, np.float32), 1, 2)), 1, 2), fp8_rows(w)
