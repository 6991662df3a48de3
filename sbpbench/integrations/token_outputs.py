"""The per-token outputs TRL's loss code reads from its fused LM head, recorded from StreamBP's
chunked head, so that TRL's own code logs its metrics (entropy, token accuracy, KL, clip ratios,
rewards) from the streamed step.

TRL 1.16's trainers call `model(..., labels=..., fused_lm_head=True)`, which returns per target
position the log-probability of the label and, as asked, the entropy of the next-token
distribution, the mean logit and whether the label is the most likely token (`FusedCausalLMOutput`,
each (B, T - 1), zero where the label is -100). `TokenRecorder` wraps the step's objective: each
time the head hands a chunk's logits (B, c, V) to `chunk_loss`, it computes those fields for the
chunk without a graph (one log-softmax of the chunk, which the head holds anyway) into (B, T)
buffers; `outputs()` gives them in TRL's layout. Costs B x T values per field, no (B, T, V) tensor.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..core.internal import loss_dtype

FIELDS = ("log_probs", "entropy", "mean_logits", "is_top1")


class TokenRecorder:
    """The objective, with every chunk's per-token fields recorded (module docstring). Everything
    but chunk_loss is the objective's own, so stream_backward streams it unchanged."""

    def __init__(self, objective, fields: tuple[str, ...]):
        unknown = set(fields) - set(FIELDS)
        assert not unknown, f"unknown fused-head fields {unknown}"
        self._objective, self._fields = objective, fields
        self._values: dict[str, torch.Tensor] = {}

    def __getattr__(self, name):
        return getattr(self._objective, name)

    def chunk_loss(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        with torch.no_grad():
            self._record(logits.detach(), start, end)
        return self._objective.chunk_loss(logits, start, end)

    def _record(self, logits: torch.Tensor, start: int, end: int) -> None:
        objective = self._objective
        targets, mask = objective.targets[:, start:end], objective.mask[:, start:end]  # (B, c)
        scaled = logits.to(loss_dtype(logits.dtype)) / objective.temperature  # (B, c, V), as the loss sees them
        log_probs = scaled.log_softmax(dim=-1)
        values = {"log_probs": log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]}
        if "entropy" in self._fields:
            values["entropy"] = -(log_probs.exp() * log_probs).sum(dim=-1)
        if "mean_logits" in self._fields:
            values["mean_logits"] = scaled.mean(dim=-1)
        if "is_top1" in self._fields:
            values["is_top1"] = scaled.argmax(dim=-1) == targets  # the first maximum, as TRL's kernel
        for name, value in values.items():
            if name not in self._values:
                self._values[name] = torch.zeros(
                    mask.shape[0], objective.mask.shape[1], dtype=value.dtype, device=value.device
                )
            self._values[name][:, start:end] = torch.where(mask, value, torch.zeros_like(value))

    def outputs(self) -> SimpleNamespace:
        """The recorded fields as TRL's fused head returns them: (B, T - 1), for labels[:, 1:];
        fields not asked for are None, as are `loss` and `aux_loss` (MoE is refused)."""
        mask = self._objective.mask  # (B, T): position t predicts labels[:, t + 1]
        fields = {}
        for name in FIELDS:
            if name in self._fields or name == "log_probs":
                dtype = torch.bool if name == "is_top1" else loss_dtype(torch.get_default_dtype())
                recorded = self._values.get(name, torch.zeros(mask.shape, dtype=dtype, device=mask.device))
                fields[name] = recorded[:, :-1]
            else:
                fields[name] = None
        return SimpleNamespace(**fields, label_mask=mask[:, :-1], loss=None, aux_loss=None, log_sum_sq_probs=None)


def replay_model(outputs: SimpleNamespace):
    """A stand-in for the model in TRL's loss code: called with `fused_lm_head=True`, it returns the
    recorded outputs instead of running a forward."""

    def model(*args, fused_lm_head: bool = False, **kwargs) -> SimpleNamespace:
        assert fused_lm_head, "TRL's loss code asks the fused head for per-token outputs"
        return outputs

    return model
