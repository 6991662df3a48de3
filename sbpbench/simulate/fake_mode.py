"""One training step's model, batch, gradients and optimizer with no memory behind the model.

The model is built from its config on the meta device (LoRA adapters included), then every
parameter, buffer and tensor attribute is replaced by a *CPU* fake tensor of the same shape,
strides and dtype, under a FakeTensorMode (fake CUDA tensors abort a CPU-only torch build once
autograd runs). Built on meta first because peft moves its adapters with `module.to(...)`, which
fails on fake parameters (the fake mode holds weak references, so they cannot be swapped). The
batch is real: it is small, and the step's Python reads its values (token counts, which chunks
hold targets), which fake tensors cannot give. Mirrors runner.point._Step: the model and batch of
runner.spec.build_model_and_batch (same config, overrides, LoRA and batch arguments), the same
gradient/optimizer protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM

from ..methods import make_optimizer
from ..methods.training import init_optimizer_state
from ..models import apply_lora, load_config
from ..runner.point import resident_tensors
from ..runner.spec import DTYPES, RunSpec, make_spec_batch


@dataclass
class FakeStep:
    spec: RunSpec
    mode: FakeTensorMode
    model: torch.nn.Module  # fake parameters
    batch: object  # real tensors
    optimizer: torch.optim.Optimizer | None

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def resident_tensors(self) -> list[torch.Tensor]:
        """What is allocated before the step, as the measured step counts it."""
        return resident_tensors(self.model, self.batch, self.optimizer)


def _fake_model(spec: RunSpec, mode: FakeTensorMode) -> torch.nn.Module:
    """build_model_and_batch's model (config, depth override, LoRA) with fake CPU tensors."""
    overrides = {"num_hidden_layers": spec.num_layers} if spec.num_layers else {}
    config = load_config(spec.model, **overrides)  # never a checkpoint's weights
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[spec.dtype], attn_implementation="sdpa")
    if spec.lora_rank:
        model = apply_lora(model, rank=spec.lora_rank, alpha=spec.lora_alpha)
    fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by identity (tied weights stay one tensor)

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            made = nn.Parameter(made, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else made
            fakes[id(t)] = (t, made)  # keeps t alive, so its id cannot be reused meanwhile
        return fakes[id(t)][1]

    with mode:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None:
                        table[name] = fake(t)
            for name, value in list(vars(module).items()):  # plain tensor attributes, e.g. a RoPE's inv_freq copy
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    setattr(module, name, fake(value))
    return model


def build_fake_step(spec: RunSpec, *, foreach_optimizer: bool = False) -> FakeStep:
    """The point's model (fake), batch (real) and optimizer, gradients per spec.protocol.

    foreach_optimizer: AdamW's multi-tensor implementation, PyTorch's default for CUDA
    parameters (CPU parameters get the per-tensor loop); it allocates whole-group temporaries."""
    if spec.device != "cpu":
        raise ValueError(f"a simulated point is built on fake CPU tensors; give device 'cpu', got {spec.device!r}")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fake_model(spec, mode)
    config = model.config
    batch = make_spec_batch(spec, config)
    step = FakeStep(spec=spec, mode=mode, model=model.train(), batch=batch, optimizer=None)
    if spec.step == "train":
        step.optimizer = make_optimizer(step.model)
        for group in step.optimizer.param_groups:
            group["foreach"] = foreach_optimizer
    if spec.protocol == "steady":
        with mode:
            for p in step.trainable:
                p.grad = torch.zeros_like(p)
            if step.optimizer is not None:
                init_optimizer_state(step.optimizer)
    return step
