"""GPU check of the PyTorch FP8 peer's grouped product (``bench_torch_moe._fp8_grouped_mm``:
``torch._scaled_grouped_mm`` with rowwise scales, its backward as torchao writes it) against
the same recipe emulated in float64 numpy: the operands quantised by the same helpers
(``e4m3_rowwise``, ``e4m3_token_groups``) from the same bfloat16 values, the products summed
exactly. Checks the kernel's operand layouts, the scale shapes and order (per row, per output
column ``[E, N]``, group-major ``[G * n]`` in the weight gradient's 2d x 2d form) and the
padded token groups, with an empty expert and groups that are not multiples of 16.

Tolerances: the quantised operands are bit-identical (the same float32 division and
round-to-nearest-even cast), so the GPU differs only by its accumulation (fast accumulation:
no promotion, about 14 bits kept) and the bfloat16 output: the forward and input gradient
(contraction 64 or 48) are held to 1e-2 of the peak output, the weight gradient (a contraction
over an expert's tokens) to 2e-2. A wrong layout or scale index gives errors of order 1.
Skipped without torch, CUDA, ``torch._scaled_grouped_mm`` or a GPU of compute capability 9.0+.

Run on the GPU host::

    PYTHONPATH=src:tests python -m pytest tests/bench/test_bench_torch_moe_fp8_gpu.py -q -n 0
"""

import bench_torch_moe
import ml_dtypes
import numpy as np
import pytest
from helpers import peak_rel_err

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not hasattr(torch, "_scaled_grouped_mm"), reason="torch has no _scaled_grouped_mm"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
        reason="torch._scaled_grouped_mm needs compute capability 9.0+",
    ),
]

ALIGN = bench_torch_moe.FP8_ROW_ALIGN


def numpy_cast(x):
    return x.astype(ml_dtypes.float8_e4m3fn)


def dequantised_rowwise(x, axis):
    q, scale = bench_torch_moe.e4m3_rowwise(x, axis, np, numpy_cast)
    shape = list(x.shape)
    shape[axis] = 1
    return q.astype(np.float64) * scale.reshape(shape)


def dequantised_token_groups(x, group_of_chunk, num_groups):
    def reduce(chunk_amax, groups):
        out = np.zeros((num_groups, chunk_amax.shape[1]), np.float32)
        np.maximum.at(out, groups, chunk_amax)
        return out

    q, scale = bench_torch_moe.e4m3_token_groups(x, group_of_chunk, reduce, np, numpy_cast)
    per_row = np.repeat(scale.reshape(num_groups, -1)[group_of_chunk], ALIGN, axis=0)
    return q.astype(np.float64) * per_row


def test_fp8_grouped_mm_forward_and_backward_match_the_recipe():
    rng = np.random.default_rng(0)
    counts = np.array([37, 0, 5, 90], np.int32)
    num_groups, k, n = len(counts), 64, 48
    group_ends = np.cumsum(counts).astype(np.int32)
    padded_ends, shift, total = bench_torch_moe.padded_groups(group_ends, int(counts.sum()))
    sorted_expert = np.repeat(np.arange(num_groups), counts)
    position = np.arange(counts.sum()) + shift[sorted_expert]
    group_of_chunk = bench_torch_moe.group_of_chunks(padded_ends, np.arange(total // ALIGN) * ALIGN)

    def bf16(array):
        return torch.from_numpy(array.astype(np.float32)).cuda().to(torch.bfloat16)

    rows = np.zeros((total, k), np.float32)
    rows[position] = rng.standard_normal((len(position), k))
    rows[position[3], 7] = 40.0  # an outlier: its row's and its group's scales follow it
    dy = np.zeros((total, n), np.float32)
    dy[position] = rng.standard_normal((len(position), n))
    rows_t, dy_t = bf16(rows).requires_grad_(True), bf16(dy)
    weight_t = bf16(rng.standard_normal((num_groups, k, n)) / 8).requires_grad_(True)
    offs = torch.from_numpy(padded_ends.astype(np.int32)).cuda()
    chunks = torch.from_numpy(group_of_chunk.astype(np.int64)).cuda()

    out_t = bench_torch_moe._fp8_grouped_mm()(rows_t, weight_t, offs, chunks)
    grad_rows_t, grad_weight_t = torch.autograd.grad(out_t, (rows_t, weight_t), dy_t)

    def numpy(t):
        return t.detach().float().cpu().numpy()

    x, w, g = numpy(rows_t), numpy(weight_t), numpy(dy_t)  # the bfloat16 values
    x_q = dequantised_rowwise(x, 1)
    w_q = dequantised_rowwise(w, 1)  # per output column: along K
    g_q = dequantised_rowwise(g, 1)
    wt_q = dequantised_rowwise(w, 2)  # the input gradient's: along N
    x_tok = dequantised_token_groups(x, group_of_chunk, num_groups)
    g_tok = dequantised_token_groups(g, group_of_chunk, num_groups)
    out = np.zeros((total, n))
    grad_rows = np.zeros((total, k))
    grad_weight = np.zeros((num_groups, k, n))
    starts = np.concatenate([[0], padded_ends[:-1]])
    for e in range(num_groups):
        part = slice(starts[e], padded_ends[e])
        out[part] = x_q[part] @ w_q[e]
        grad_rows[part] = g_q[part] @ wt_q[e].T
        grad_weight[e] = x_tok[part].T @ g_tok[part]
    assert peak_rel_err(numpy(out_t), out) < 1e-2
    assert peak_rel_err(numpy(grad_rows_t), grad_rows) < 1e-2
    assert peak_rel_err(numpy(grad_weight_t), grad_weight) < 2e-2
    assert not np.any(numpy(grad_weight_t)[1])  # the empty expert: no tokens, no gradient
