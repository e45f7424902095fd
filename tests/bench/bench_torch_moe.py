"""The PyTorch MoE peer: the same layer on ``torch._grouped_mm``, eager and ``torch.compile``d.

What torchtitan-style stacks run: route in float32 (softmax, top-k, renormalised weights; or
for a case with router fields the DeepSeek-style router as torchtitan's
``TokenChoiceTopKRouter`` writes it: sigmoid scores, the balance bias added for the choice
only, group-limited routing by the sum of each group's two best scores, the weights scaled),
sort the token copies by expert, three grouped matmuls (``torch._grouped_mm`` with the
cumulative group ends as ``offs``) with the SwiGLU between them in float32, then a float32
``index_add`` of the weighted copies back to their tokens, plus the shared expert. Same weights
(converted from the JAX parameters), same inputs and cotangent as the tilax rows; gradients come
from PyTorch autograd. bfloat16 only (``_grouped_mm``'s dtype on CUDA).

impl ``torch_grouped_mm`` runs eagerly, ``torch_grouped_mm_compile`` through
``torch.compile(dynamic=False)`` (the first call, timed as ``compile_s``, compiles forward and
backward). Only the benchmark uses this; it is not part of the package.

FP8 (a case with ``quantize="fp8"``, beside tilax's ``MoEConfig(quantize="fp8")`` rows; same
impl names, the rows pair by config): the three expert products run on
``torch._scaled_grouped_mm`` with e4m3 operands, everything else (router, sort, SwiGLU in
float32, combine, the bfloat16 shared expert) as above. The recipe is torchao's
``FP8_ROWWISE`` MoE training recipe (``torchao.prototype.moe_training``,
``_Float8GroupedMM``), written here with plain torch ops so the peer needs no torchao:

- scales from the data: ``amax`` in float32, ``scale = amax / 448`` (values multiplied by
  ``448 / amax``, clipped to +-448, cast to ``float8_e4m3fn``); a slice of zeros gets
  float32's smallest normal as its scale (its values stay 0). Not rounded to powers of two
  (torchao rounds them; tilax does not, and this peer keeps tilax's scale values);
- forward ``rows @ w[e]``: one scale per row of the activations and one per output column of
  each expert's weight (the contraction is the other axis);
- input gradient ``dy @ w[e].T``: ``dy`` per row, the weight per row of ``w[e]`` (its output
  column after the transpose), again rowwise;
- weight gradient ``rows.T @ dy`` per expert: ``torch._scaled_grouped_mm``'s 2d x 2d form with
  the groups along the tokens, both operands quantised along the tokens, one scale per
  (expert's token group, column): FP8 as torchao does (no bfloat16 fallback);
- ``use_fast_accum=True`` as torchao passes it (no per-128 promotion of the accumulator).

This is a coarser recipe than tilax's (1 x 128 tiles of activations and gradients, 128 x 128
blocks of weights, 128-token tiles for the weight gradient, each 128-deep partial product
promoted to float32): one scale covers a whole row (512 to 1024 values), or a whole expert's
tokens for the weight gradient. ``torch._scaled_grouped_mm`` has no autograd formula (torch's
``derivatives.yaml`` gives ``_grouped_mm`` one, not the scaled op, whose operands are float8):
the backward is the ``torch.autograd.Function`` of :func:`_fp8_grouped_mm`, as torchao's
``_Float8GroupedMM`` writes it. The kernel wants ``mat_a`` row-major and ``mat_b``
column-major (stride 1 on the second-to-last axis), 16-byte aligned rows, ``offs`` the int32
cumulative group ends, float32 scales (1-D per row of a 2-D operand, ``[E, N]`` for a 3-D
``mat_b``, group-major ``[G * n]`` in the 2d x 2d form), ``out_dtype`` bfloat16, and a GPU of
compute capability 9.0 or later.
Each expert's token group is padded with zero rows to a multiple of 16
(:data:`FP8_ROW_ALIGN`, the FP8 token-group alignment torchtitan pads to), so that every
group starts 16-byte aligned in both layouts; the padding rows are zeros and change no sum.
Errors against the float32 reference are checked against :data:`FP8_REL_ERR_BOUND_OUT` and
:data:`FP8_REL_ERR_BOUND_GRAD`.
"""

from __future__ import annotations

import functools

import numpy as np
from bench_harness import Unavailable, torch_device_memory

TORCH_IMPLS = ("torch_grouped_mm", "torch_grouped_mm_compile")
PARAM_NAMES = ("router", "w_gate", "w_up", "w_down")
SHARED_NAMES = ("w_gate", "w_up", "w_down")
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
MIN_SCALE = 2.0**-126  # float32's smallest normal: the scale of a slice of zeros
# Rows per alignment unit of each expert's token group on the FP8 path (16 e4m3 values are
# 16 bytes, the alignment the scaled grouped kernel's operands need; torchtitan pads FP8 token
# groups to 16 too).
FP8_ROW_ALIGN = 16
# Norm-wise relative errors of the FP8 peer against the float32 reference above which its row
# gets a ``numerics_error`` (the values stay recorded): the output, and the gradients. tilax's
# FP8 layer (1 x 128 / 128 x 128 scales, promoted accumulation) is about 0.06 from bfloat16 and
# its tests hold outputs and gradients under 0.1: e4m3's 3-bit mantissa alone gives 2-4% per
# operand. Rowwise scales cost little more on such data (e4m3's relative error does not depend
# on the scale until values reach its subnormals), but fast accumulation does where the
# contraction is long: the weight gradient sums an expert's tens of thousands of tokens with no
# promotion, hence the looser gradient bound. A wrong layout, group offset or scale index gives
# errors of order 1.
FP8_REL_ERR_BOUND_OUT = 0.1
FP8_REL_ERR_BOUND_GRAD = 0.2
# What the FP8 rows record in extra_info (the case adds it): the recipe and the weight
# gradient's precision.
FP8_RECIPE = {
    "fp8_scaling": "rowwise",  # torchao FP8_ROWWISE; tilax: 1x128 / 128x128 tiles
    "fp8_weight_grad": "fp8",  # 2d x 2d _scaled_grouped_mm, scales per expert token group
    "fp8_fast_accum": True,
    "fp8_bound_out": FP8_REL_ERR_BOUND_OUT,
    "fp8_bound_grad": FP8_REL_ERR_BOUND_GRAD,
}


def _import_torch():
    try:
        import torch
    except ModuleNotFoundError as exc:  # not installed: not attempted; any other error fails
        raise Unavailable(
            f"unavailable: torch or a module it needs is not installed here ({exc})") from exc
    if not hasattr(torch, "_grouped_mm"):
        raise Unavailable(f"unavailable: torch {torch.__version__} has no torch._grouped_mm")
    return torch


def route(logits, params: dict, top_k: int, router: tuple = ()):
    """``(weights, expert_ids)`` of float32 ``logits: [T, E]``: the softmax top-k with
    renormalised weights, or with ``router = (score_func, expert_groups, group_top_k,
    routed_scale)`` the layer of ``tilax.MoEConfig``'s routing fields (``params`` holds
    ``router_bias`` when the balance bias is on)."""
    import torch

    if not router:
        probs = torch.softmax(logits, dim=-1)
        weights, expert_ids = torch.topk(probs, top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), expert_ids
    score_func, expert_groups, group_top_k, routed_scale = router
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, -1)
    selection = scores.detach()  # the choice takes no gradient
    if "router_bias" in params:
        selection = selection + params["router_bias"]
    if expert_groups > 1:
        num_tokens, num_experts = selection.shape
        grouped = selection.view(num_tokens, expert_groups, num_experts // expert_groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(group_top_k, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best_groups, True)
        selection = grouped.masked_fill(~kept[..., None], float("-inf")).view(
            num_tokens, num_experts)
    expert_ids = torch.topk(selection, top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scale, expert_ids


def e4m3_rowwise(x, axis: int, xp, cast):
    """``(q, scale)``: float32 ``x`` quantised to e4m3 with one scale per slice along ``axis``
    (``scale = amax / 448``, shaped as ``x`` without ``axis``; at least :data:`MIN_SCALE`),
    ``q = cast(clip(x / scale, -448, 448))``. ``xp`` is ``numpy`` or ``torch`` (the ops used
    here mean the same in both), ``cast`` the cast to ``float8_e4m3fn``."""
    amax = xp.amax(xp.abs(x), axis)
    scale = amax / E4M3_MAX
    scale = xp.where(scale > MIN_SCALE, scale, MIN_SCALE)
    shape = list(x.shape)
    shape[axis] = 1
    return cast(xp.clip(x / scale.reshape(shape), -E4M3_MAX, E4M3_MAX)), scale


def e4m3_token_groups(x, group_of_chunk, group_amax, xp, cast):
    """``(q, scale)``: float32 ``x: [M, C]`` quantised along its rows (the tokens) with one
    scale per (token group, column), the weight gradient's operands. The rows come in chunks
    of :data:`FP8_ROW_ALIGN`, chunk ``i`` in group ``group_of_chunk[i]`` (a group is whole
    chunks); ``group_amax(chunk_amax, group_of_chunk)`` reduces ``[chunks, C]`` to
    ``[G, C]`` by maximum. ``scale`` is group-major ``[G * C]``, the 2d x 2d layout of
    ``torch._scaled_grouped_mm``."""
    rows, cols = x.shape
    chunks = x.reshape(rows // FP8_ROW_ALIGN, FP8_ROW_ALIGN, cols)
    scale = group_amax(xp.amax(xp.abs(chunks), 1), group_of_chunk) / E4M3_MAX
    scale = xp.where(scale > MIN_SCALE, scale, MIN_SCALE)
    scaled = chunks / scale[group_of_chunk].reshape(rows // FP8_ROW_ALIGN, 1, cols)
    return cast(xp.clip(scaled.reshape(rows, cols), -E4M3_MAX, E4M3_MAX)), scale.reshape(-1)


def padded_groups(group_ends, num_rows: int):
    """``(padded_ends, shift, total)`` of the FP8 path's row layout: each expert's rows (group
    ``e`` ends at ``group_ends[e]``, cumulative, over ``num_rows`` sorted rows) padded with
    zero rows to a multiple of :data:`FP8_ROW_ALIGN`, into ``total`` rows (static: the rows
    rounded up plus one alignment unit per group; the last group takes the spare rows).
    Sorted row ``r`` of expert ``e`` lands at ``r + shift[e]``. Array ops common to numpy and
    torch (integer arrays)."""
    align = FP8_ROW_ALIGN
    counts = group_ends * 1
    counts[1:] = group_ends[1:] - group_ends[:-1]
    padded_sizes = (counts + (align - 1)) // align * align
    padded_ends = padded_sizes.cumsum(0)
    shift = (padded_ends - padded_sizes) - (group_ends - counts)
    total = (-(-num_rows // align) + group_ends.shape[0]) * align
    padded_ends[-1] = total
    return padded_ends, shift, total


def group_of_chunks(padded_ends, chunk_starts):
    """The group of each chunk of :data:`FP8_ROW_ALIGN` rows starting at ``chunk_starts``:
    the number of groups that end at or before it (groups are whole chunks)."""
    return (chunk_starts[:, None] >= padded_ends[None, :]).sum(1)


@functools.cache
def _fp8_grouped_mm():
    """The differentiable FP8 grouped product ``rows @ weight[e]`` per token group (built on
    first use: this module imports without torch)."""
    import torch

    def cast(t):
        return t.to(torch.float8_e4m3fn).contiguous()

    def group_amax(chunk_amax, group_of_chunk, num_groups):
        out = chunk_amax.new_zeros(num_groups, chunk_amax.shape[1])
        index = group_of_chunk[:, None].expand_as(chunk_amax)
        return out.scatter_reduce(0, index, chunk_amax, reduce="amax")

    def scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs):
        return torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)

    class FP8GroupedMM(torch.autograd.Function):
        """``rows: [M, K]`` bfloat16, ``weight: [E, K, N]`` bfloat16, ``offs`` the int32 group
        ends over ``M`` (``M`` a multiple of ``FP8_ROW_ALIGN``, every group whole chunks of
        it), ``group_of_chunk`` each chunk's group; ``[M, N]`` bfloat16."""

        @staticmethod
        def forward(ctx, rows, weight, offs, group_of_chunk):
            ctx.save_for_backward(rows, weight, offs, group_of_chunk)
            q_rows, s_rows = e4m3_rowwise(rows.float(), 1, torch, cast)
            # per output column: quantised along K on [E, N, K], then viewed as the
            # column-major [E, K, N] the kernel wants
            q_w, s_w = e4m3_rowwise(weight.float().transpose(1, 2), 2, torch, cast)
            return scaled_grouped_mm(q_rows, q_w.transpose(1, 2), s_rows, s_w, offs)

        @staticmethod
        def backward(ctx, grad_out):
            rows, weight, offs, group_of_chunk = ctx.saved_tensors
            grad32 = grad_out.float()
            # input gradient dy @ w[e].T: dy per row, w[e] per row (its output column there)
            q_dy, s_dy = e4m3_rowwise(grad32, 1, torch, cast)
            q_wt, s_wt = e4m3_rowwise(weight.float(), 2, torch, cast)
            grad_rows = scaled_grouped_mm(q_dy, q_wt.transpose(1, 2), s_dy, s_wt, offs)
            # weight gradient rows.T @ dy per group (2d x 2d): both along the tokens
            num_groups = weight.shape[0]

            def reduce(chunk_amax, groups):
                return group_amax(chunk_amax, groups, num_groups)

            q_x, s_x = e4m3_token_groups(rows.float(), group_of_chunk, reduce, torch, cast)
            q_g, s_g = e4m3_token_groups(grad32, group_of_chunk, reduce, torch, cast)
            grad_weight = scaled_grouped_mm(
                q_x.t().contiguous(), q_g.t().contiguous().t(), s_x, s_g, offs)
            return grad_rows, grad_weight.to(weight.dtype), None, None

    return FP8GroupedMM.apply


def fp8_expert_rows(rows, sorted_expert, group_ends, w_gate, w_up, w_down):
    """The routed experts' output rows of the FP8 path: ``rows`` sorted by expert
    (``sorted_expert`` each row's expert, ``group_ends`` the int32 cumulative ends), padded
    per expert to :data:`FP8_ROW_ALIGN` (:func:`padded_groups`), three FP8 grouped products
    with the SwiGLU between them in float32, the padding dropped again."""
    import torch
    import torch.nn.functional as F

    num_rows, d_model = rows.shape
    padded_ends, shift, total = padded_groups(group_ends, num_rows)
    position = torch.arange(num_rows, device=rows.device) + shift[sorted_expert]
    chunk_starts = torch.arange(total // FP8_ROW_ALIGN, device=rows.device) * FP8_ROW_ALIGN
    group_of_chunk = group_of_chunks(padded_ends, chunk_starts)
    offs = padded_ends.to(torch.int32)
    padded = rows.new_zeros(total, d_model).index_copy(0, position, rows)
    grouped_mm = _fp8_grouped_mm()
    gate = grouped_mm(padded, w_gate, offs, group_of_chunk)
    up = grouped_mm(padded, w_up, offs, group_of_chunk)
    hidden = (F.silu(gate.float()) * up.float()).to(rows.dtype)
    return grouped_mm(hidden, w_down, offs, group_of_chunk)[position]


def moe_layer(x, params: dict, top_k: int, router: tuple = (), quantize: str | None = None):
    """``y`` of the dropless top-k SwiGLU layer; ``params`` holds torch tensors named as
    ``tilax.moe_init``'s leaves (``shared`` a dict when present); ``router`` as
    :func:`route` takes it; ``quantize="fp8"`` runs the routed experts' products in FP8
    (:func:`fp8_expert_rows`)."""
    import torch
    import torch.nn.functional as F

    num_tokens, d_model = x.shape
    num_experts = params["router"].shape[1]
    logits = x.float() @ params["router"]
    weights, expert_ids = route(logits, params, top_k, router)

    flat_expert = expert_ids.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    token_of_row = order // top_k
    # cumulative group ends from a sorted search: static shapes, so torch.compile needs no
    # data-dependent size (bincount's output length is one)
    group_ends = torch.searchsorted(
        flat_expert[order], torch.arange(1, num_experts + 1, device=x.device), out_int32=True)

    rows = x[token_of_row]
    if quantize == "fp8":
        out = fp8_expert_rows(rows, flat_expert[order], group_ends, params["w_gate"],
                              params["w_up"], params["w_down"])
    else:
        gate = torch._grouped_mm(rows, params["w_gate"], offs=group_ends)
        up = torch._grouped_mm(rows, params["w_up"], offs=group_ends)
        hidden = (F.silu(gate.float()) * up.float()).to(x.dtype)
        out = torch._grouped_mm(hidden, params["w_down"], offs=group_ends)

    row_weight = weights.reshape(-1)[order]
    y = torch.zeros(num_tokens, d_model, dtype=torch.float32, device=x.device)
    y = y.index_add(0, token_of_row, out.float() * row_weight[:, None])
    if "shared" in params:
        shared = params["shared"]
        shared_hidden = F.silu(x @ shared["w_gate"]) * (x @ shared["w_up"])
        y = y + (shared_hidden @ shared["w_down"]).float()
    return y.to(x.dtype)


def _to_torch(torch, array, device, dtype=None):
    tensor = torch.from_numpy(np.asarray(array, dtype=np.float32)).to(device)
    return tensor.to(dtype) if dtype is not None else tensor


def check_fp8_peer(torch, case, device: str) -> None:
    """Raise :class:`Unavailable` where the FP8 peer cannot run ``case`` here: another
    ``quantize`` than ``"fp8"``, a torch without ``_scaled_grouped_mm``, no CUDA device, a GPU
    below compute capability 9.0, or widths the kernel's 16-byte rows do not take."""
    if case.quantize != "fp8":
        raise Unavailable(f"unsupported: the PyTorch peer quantises to 'fp8' only, not "
                          f"quantize={case.quantize!r}")
    if not hasattr(torch, "_scaled_grouped_mm") or not hasattr(torch, "float8_e4m3fn"):
        raise Unavailable(f"unavailable: torch {torch.__version__} has no "
                          f"torch._scaled_grouped_mm")
    if device != "cuda":
        raise Unavailable("unavailable: torch._scaled_grouped_mm needs a CUDA device")
    capability = torch.cuda.get_device_capability()
    if capability < (9, 0):
        raise Unavailable(f"unsupported: torch._scaled_grouped_mm needs compute capability "
                          f"9.0 or later; this GPU is {capability[0]}.{capability[1]}")
    if case.d_model % FP8_ROW_ALIGN or case.d_hidden % FP8_ROW_ALIGN:
        raise Unavailable(f"unsupported: the FP8 peer needs d_model and d_hidden multiples of "
                          f"{FP8_ROW_ALIGN} (got {case.d_model}, {case.d_hidden})")


def fp8_numerics_problem(info: dict) -> str:
    """The errors in ``info`` (``rel_err_out`` against :data:`FP8_REL_ERR_BOUND_OUT`, the
    other ``rel_err_*`` against :data:`FP8_REL_ERR_BOUND_GRAD`) above their bound, or NaN, as
    a sentence; ``""`` when none (or none measured)."""
    over = []
    for name, value in sorted(info.items()):
        if not name.startswith("rel_err_") or not isinstance(value, float):
            continue
        bound = FP8_REL_ERR_BOUND_OUT if name == "rel_err_out" else FP8_REL_ERR_BOUND_GRAD
        if not value <= bound:
            over.append(f"{name} {value:.3g} above {bound:g}")
    return ", ".join(over) + " (the FP8 peer's bounds)" if over else ""


class TorchMoEWorkload:
    """One ``torch_grouped_mm*`` row. ``start`` runs one call without waiting for the device,
    ``finish`` ends in ``torch.cuda.synchronize``, ``call`` does both.

    ``numerics(y, grad_x, grad_params)`` receives float32 numpy arrays (``grad_params`` shaped
    like the JAX parameters) and returns the row's numerics fields.
    """

    def __init__(self, case, inputs, numerics):
        torch = _import_torch()
        if case.dtype != "bfloat16":
            raise Unavailable("unsupported: torch._grouped_mm runs bfloat16 only")
        self.torch, self.case, self._numerics = torch, case, numerics
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if case.quantize:
            check_fp8_peer(torch, case, self.device)
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        bf16 = torch.bfloat16
        params = {name: _to_torch(torch, inputs.params[name], self.device,
                                  None if name == "router" else bf16) for name in PARAM_NAMES}
        if "shared" in inputs.params:
            params["shared"] = {name: _to_torch(torch, inputs.params["shared"][name],
                                                self.device, bf16) for name in SHARED_NAMES}
        if "router_bias" in inputs.params:  # float32, no gradient: a buffer, as torchtitan's
            params["router_bias"] = _to_torch(torch, inputs.params["router_bias"], self.device)
        self.router = ()
        if case.router_label():
            self.router = (case.score_func, case.expert_groups, case.group_top_k,
                           case.routed_scale)
        self.params = params
        self.x = _to_torch(torch, inputs.x, self.device, bf16)
        self.dy = _to_torch(torch, inputs.dy, self.device)
        layer = moe_layer
        if case.impl == "torch_grouped_mm_compile":
            torch._dynamo.reset()  # each row compiles its own shape, not a dynamic one
            layer = torch.compile(moe_layer, dynamic=False)
        self.layer = layer

    def _leaves(self):
        flat = [self.params[name] for name in PARAM_NAMES]
        if "shared" in self.params:
            flat += [self.params["shared"][name] for name in SHARED_NAMES]
        return flat

    def _train_step(self):
        torch = self.torch
        leaves = [t.detach().requires_grad_(True) for t in self._leaves() + [self.x]]
        params = dict(zip(PARAM_NAMES, leaves[:4], strict=True))
        if "shared" in self.params:
            params["shared"] = dict(zip(SHARED_NAMES, leaves[4:7], strict=True))
        if "router_bias" in self.params:
            params["router_bias"] = self.params["router_bias"]
        y = self.layer(leaves[-1], params, self.case.top_k, self.router, self.case.quantize)
        loss = (y.float() * self.dy).sum()
        grads = torch.autograd.grad(loss, leaves)
        return y.detach(), grads

    def start(self):
        if self.case.op == "forward":
            with self.torch.no_grad():
                return self.layer(self.x, self.params, self.case.top_k, self.router,
                                  self.case.quantize)
        return self._train_step()

    def finish(self, pending):
        if self.device == "cuda":
            self.torch.cuda.synchronize()
        return pending

    def call(self):
        return self.finish(self.start())

    def inspect(self, out) -> dict:
        def numpy(t):
            return t.detach().float().cpu().numpy()

        if self.case.op == "forward":
            return self._checked(self._numerics(numpy(out), None, None))
        y, grads = out
        grad_params = {name: numpy(g) for name, g in zip(PARAM_NAMES, grads[:4], strict=True)}
        if "shared" in self.params:
            grad_params["shared"] = {name: numpy(g)
                                     for name, g in zip(SHARED_NAMES, grads[4:7], strict=True)}
        if "router_bias" in self.params:  # no gradient reaches it, as in tilax's layer
            grad_params["router_bias"] = np.zeros(self.params["router_bias"].shape, np.float32)
        return self._checked(self._numerics(numpy(y), numpy(grads[-1]), grad_params))

    def _checked(self, info: dict) -> dict:
        """``info``, for an FP8 row with a ``numerics_error`` where an error passes its bound
        (:func:`fp8_numerics_problem`; the values stay recorded)."""
        if self.case.quantize:
            problem = fp8_numerics_problem(info)
            if problem:
                info["numerics_error"] = f"ValueError: {problem}"
        return info

    def memory(self) -> tuple[int | None, int | None]:
        return torch_device_memory(self.torch)

    def close(self) -> None:
        self.params, self.x, self.dy, self.layer = {}, None, None, None
        if self.device == "cuda":
            self.torch.cuda.empty_cache()
