"""The load-balancing loss of a mixture-of-experts model, streamed exactly.

transformers' `load_balancing_loss_func` (the Switch Transformer loss, as every MoE family of 5.x
computes it) pools the router logits z (N_l x E per MoE layer l) of every MoE layer and every
counted position of the batch (the attention mask's ones, or all positions without one):

    p_t = softmax(z_t)                     (E,) per position and layer
    counts_e = #{(t, k): top-k of p_t picks e at rank k}      (no gradient)
    psum_e = sum_t p_t,e                   over all N = layers x counted positions
    aux = E x sum_e (counts_e / N) (psum_e / N)

Given the counts, aux is linear in every p_t: d aux / d p_t,e = E counts_e / N^2 for a counted t.
So StreamBP needs the counts first: the checkpoint pass, which runs every router on every chunk,
sums counts, psum and N (no graph); the loss's value follows. In the layer backward each chunk's
router logits, recomputed in its forward, get one more root: coef x p_t (w - <p_t, w>) with
w = E counts / N^2 (the softmax's backward of that linear function), the mask's zeros at
uncounted positions. HF's function applied per chunk would pool per chunk instead: wrong
(tests/exactness/test_moe.py shows it).

The routers are found the way transformers records them: the model class's
`_can_record_outputs["router_logits"]` names their module class and the output index.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..layout import chunk_bounds

COUNT, CAPTURE = "count", "capture"


class RouterBalance:
    """The load-balancing term coef x aux of one step (module docstring). routers: the MoE layers'
    router modules, whose output[index] is their logits; mask: (B, T) the positions counted (HF's
    attention_mask), None for all."""

    def __init__(self, routers: list[nn.Module], index: int, num_experts: int, top_k: int, coef: float, mask):
        self.routers, self.index = routers, index
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.mask = mask  # (B, T) or None
        self.mode: str | None = None
        self._bounds: list[tuple[int, int]] = []
        self._calls: dict[int, int] = {}  # router -> its calls in the checkpoint pass: one per chunk, in order
        self.counts = self.psum = None  # (E,) sums, fp32 (fp64 in an fp64 model)
        self.rows = 0.0
        self.captured: list[torch.Tensor] = []  # the chunk's router logits, in the graph (CAPTURE)
        self._weights = None  # w (E,)

    @classmethod
    def of(cls, model: nn.Module, layers: nn.ModuleList, mask, coef: float | None = None):
        """The model's balance term, or None: coef None takes the model's own (its config's
        output_router_logits and router_aux_loss_coef, as its forward adds them); a number turns
        it on with that coefficient (0: off), as TRL's trainers do."""
        recorder = getattr(type(model), "_can_record_outputs", None) or {}
        recorder = recorder.get("router_logits")
        config = model.config
        if not _adds_balance_loss(model):  # DeepSeek-V3, GLM-4-MoE: balanced by a bias, no loss term
            return None
        if coef is None:
            own = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", 0.0))
            coef = own if getattr(config, "output_router_logits", False) else 0.0
        if recorder is None or not coef:
            return None
        target = recorder.target_class
        routers = [m for m in layers.modules() if isinstance(m, target)]
        num_experts = getattr(model, "num_experts", None) or config.num_experts
        top_k = getattr(model, "num_experts_per_tok", None) or config.num_experts_per_tok
        return cls(routers, recorder.index, num_experts, top_k, float(coef), mask)

    @contextmanager
    def hooked(self):
        """The routers report their logits for the duration (what they do depends on `mode`)."""
        handles = [router.register_forward_hook(self._hook) for router in self.routers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def counting(self, seq_len: int, chunk_size: int):
        """The checkpoint pass, chunks of chunk_size first to last, layer by layer: every router
        call adds its chunk's counts."""
        self._bounds, self._calls, self.mode = chunk_bounds(seq_len, chunk_size), {}, COUNT
        try:
            yield
        finally:
            self.mode = None
        self._finish_counts()

    def _hook(self, module, args, output):
        logits = output[self.index] if isinstance(output, (tuple, list)) else output
        if self.mode == COUNT:
            calls = self._calls[id(module)] = self._calls.get(id(module), 0) + 1
            start, end = self._bounds[calls - 1]
            with torch.no_grad():
                self._count(logits, start, end)
        elif self.mode == CAPTURE:
            self.captured.append(logits)

    def _chunk_mask(self, start: int, end: int, logits: torch.Tensor) -> torch.Tensor:
        """(B x c,) the counted positions of the chunk, in the router logits' row order."""
        rows = logits.reshape(-1, self.num_experts).shape[0]
        if self.mask is None:
            return logits.new_ones(rows, dtype=_wide(logits))
        flat = self.mask[:, start:end].reshape(-1).to(device=logits.device, dtype=_wide(logits))
        assert flat.numel() == rows, f"router logits of {rows} rows for a chunk of {flat.numel()} positions"
        return flat

    def _count(self, logits: torch.Tensor, start: int, end: int) -> None:
        logits = logits.reshape(-1, self.num_experts)  # (B x c, E)
        probs = torch.softmax(logits.to(_wide(logits)), dim=-1)
        mask = self._chunk_mask(start, end, logits)
        _, chosen = torch.topk(probs, self.top_k, dim=-1)  # (B x c, k)
        counts = torch.zeros(self.num_experts, dtype=probs.dtype, device=probs.device)
        counts.scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(self.top_k))
        psum = (probs * mask[:, None]).sum(dim=0)
        self.counts = counts if self.counts is None else self.counts + counts
        self.psum = psum if self.psum is None else self.psum + psum
        self.rows = self.rows + mask.sum()

    def _finish_counts(self) -> None:
        if self.counts is None:  # no MoE layer ran
            return
        self._weights = self.num_experts * self.counts / self.rows**2  # d aux / d p_t (E,)

    @property
    def loss(self) -> torch.Tensor | None:
        """coef x aux (0-dim, no graph), or None before the counts."""
        if self._weights is None:
            return None
        aux = self.num_experts * (self.counts / self.rows * (self.psum / self.rows)).sum()
        return self.coef * aux

    @contextmanager
    def capturing(self):
        """A chunk's forward in the layer backward: its routers' logits are kept (in the graph)."""
        self.captured, self.mode = [], CAPTURE
        try:
            yield
        finally:
            self.mode = None

    def roots(self, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The captured router logits of chunk [start, end) and their gradients of coef x aux."""
        if self._weights is None:
            return [], []
        roots, grads = [], []
        for logits in self.captured:
            flat = logits.reshape(-1, self.num_experts)
            with torch.no_grad():
                probs = torch.softmax(flat.to(_wide(flat)), dim=-1)  # (B x c, E)
                w = self._weights.to(probs.dtype)
                grad = probs * (w - (probs * w).sum(dim=-1, keepdim=True))  # softmax backward of <p, w>
                grad = self.coef * grad * self._chunk_mask(start, end, flat)[:, None]
            roots.append(logits)
            grads.append(grad.reshape(logits.shape).to(logits.dtype))
        self.captured = []
        return roots, grads


def _adds_balance_loss(model: nn.Module) -> bool:
    """The model's own forward adds transformers' load-balancing loss (its code calls it)."""
    forward = getattr(type(model).forward, "__wrapped__", type(model).forward)
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    return "load_balancing_loss_func" in getattr(forward, "__code__", compile("", "", "exec")).co_names


def _wide(tensor: torch.Tensor) -> torch.dtype:
    """float32, or float64 for a float64 model: the width HF's function sums in."""
    return torch.promote_types(tensor.dtype, torch.float32)
