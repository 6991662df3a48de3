"""Names for the part of a step that is running, so a peak (estimated or measured) can say where it was.

Hooks on the model's parts (core.architecture.parts.resolve_parts: embedding, decoder layers, lm_head) and
on the optimizer set `counter.phase`; they allocate nothing, so the count is unchanged. Labels:
"forward", "embedding", "forward layer i", "head" (lm_head and loss, and their backward),
"head chunk k" (StreamBP's k-th lm_head call with grad), "head sums chunk k" (the k-th of the
no-grad pass an objective of sequence sums takes first: DPO), "backward layer i" (a layer's gradient has
arrived, or it is re-run after the head: checkpoint recompute, StreamBP), "backward embedding"
("backward embedding chunk k": StreamBP's k-th chunk of it), "optimizer".
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

from ..core import UnsupportedModelError
from ..core.internal import resolve_parts


class PhaseLabels:
    def __init__(self, counter, *, chunked_head: bool, at_norm: bool = False):
        """at_norm: label a decoder layer from hooks on its input_layernorm, the first module its
        forward calls, not on the layer: under FSDP2 StreamBP runs a layer's hook-free forward, and
        a sequence-parallel step keeps its K/V recipe only where nothing wraps or pre-hooks the layer
        (core/architecture/key_values.py)."""
        self.counter = counter  # anything with a writable `phase`
        self.chunked_head = chunked_head
        self.at_norm = at_norm
        self.head_calls = 0
        self._sums_calls = 0  # StreamBP's no-grad head pass (DPO's sequence sums)
        self._embedding_chunks = 0  # StreamBP's embedding backward, chunk by chunk

    def _set(self, label: str) -> None:
        self.counter.phase = label

    def _on_gradient(self, output, label: str) -> None:
        """Relabel when the gradient of this module output arrives (its backward starts)."""
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        tensor = next((t for t in outputs if isinstance(t, torch.Tensor)), None)
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(lambda grad: self._set(label))

    def _part(self, module, name: str, stack: ExitStack) -> None:
        forward = "embedding" if name == "embedding" else f"forward {name}"

        def label() -> str:
            if self.chunked_head and name == "embedding":  # one call per chunk: numbered
                return f"backward embedding chunk {self._embedding_chunks}"
            return f"backward {name}"

        def before(module, args):  # after the head, a part runs again only as part of its backward
            self._set(label() if self.head_calls else forward)

        def after(module, args, output):
            self._on_gradient(output, label())
            if name == "embedding" and self.head_calls and self.chunked_head:
                self._embedding_chunks += 1
            if name == "embedding" and not self.head_calls:
                self._set("forward")

        hooked = module.input_layernorm if self.at_norm and name.startswith("layer") else module
        stack.callback(hooked.register_forward_pre_hook(before).remove)
        stack.callback(hooked.register_forward_hook(after).remove)

    def _head(self, module, stack: ExitStack) -> None:
        def before(module, args):
            if not self.chunked_head:
                self._set("head")
            elif torch.is_grad_enabled():
                self._set(f"head chunk {self.head_calls - self._sums_calls}")
            else:
                self._set(f"head sums chunk {self._sums_calls}")
                self._sums_calls += 1
            self.head_calls += 1

        stack.callback(module.register_forward_pre_hook(before).remove)

    @contextmanager
    def attached(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        with ExitStack() as stack:
            try:
                parts = resolve_parts(model)
            except UnsupportedModelError:
                parts = None  # no labels beyond "forward" / "optimizer"
            if parts is not None:
                self._part(parts.embed, "embedding", stack)
                for index, layer in enumerate(parts.layers):
                    self._part(layer, f"layer {index}", stack)
                self._head(parts.lm_head, stack)
            if optimizer is not None:
                stack.callback(optimizer.register_step_pre_hook(lambda *_: self._set("optimizer")).remove)
            yield self
