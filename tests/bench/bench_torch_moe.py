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
"""

from __future__ import annotations

import numpy as np
from bench_harness import Unavailable, torch_device_memory

TORCH_IMPLS = ("torch_grouped_mm", "torch_grouped_mm_compile")
PARAM_NAMES = ("router", "w_gate", "w_up", "w_down")
SHARED_NAMES = ("w_gate", "w_up", "w_down")


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


def moe_layer(x, params: dict, top_k: int, router: tuple = ()):
    """``y`` of the dropless top-k SwiGLU layer; ``params`` holds torch tensors named as
    ``tilax.moe_init``'s leaves (``shared`` a dict when present); ``router`` as
    :func:`route` takes it."""
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
        y = self.layer(leaves[-1], params, self.case.top_k, self.router)
        loss = (y.float() * self.dy).sum()
        grads = torch.autograd.grad(loss, leaves)
        return y.detach(), grads

    def start(self):
        if self.case.op == "forward":
            with self.torch.no_grad():
                return self.layer(self.x, self.params, self.case.top_k, self.router)
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
            return self._numerics(numpy(out), None, None)
        y, grads = out
        grad_params = {name: numpy(g) for name, g in zip(PARAM_NAMES, grads[:4], strict=True)}
        if "shared" in self.params:
            grad_params["shared"] = {name: numpy(g)
                                     for name, g in zip(SHARED_NAMES, grads[4:7], strict=True)}
        if "router_bias" in self.params:  # no gradient reaches it, as in tilax's layer
            grad_params["router_bias"] = np.zeros(self.params["router_bias"].shape, np.float32)
        return self._numerics(numpy(y), numpy(grads[-1]), grad_params)

    def memory(self) -> tuple[int | None, int | None]:
        return torch_device_memory(self.torch)

    def close(self) -> None:
        self.params, self.x, self.dy, self.layer = {}, None, None, None
        if self.device == "cuda":
            self.torch.cuda.empty_cache()
