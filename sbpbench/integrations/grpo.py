"""StreamBPGRPOTrainer: TRL's GRPOTrainer with each training step's forward + backward by StreamBP.

Generation, rewards, advantages, the old and reference log-probs and the reuse of a generation batch
over `steps_per_generation` x `num_iterations` steps stay TRL's (`_prepare_inputs`, the `_step`
counter in GRPOTrainer.training_step, which calls this step). The loss is the core GRPO objective
on TRL's batch: input_ids = prompt_ids (left-padded) + completion_ids (right-padded), the
attention_mask as TRL builds it, labels on the completion tokens TRL counts (completion_mask x
tool_mask), TRL's (B, C) per-completion-token log-probs placed at the positions that predict those
tokens, and TRL's own scaling per loss type (GRPO sets loss_is_scaled_for_ga). GRPOTrainer._compute_loss
then logs its metrics (entropy, KL, clip ratios) from the per-token log-probs and entropies recorded
from the streamed head (token_outputs.py).

Refused: loss types other than grpo, bnpo, dr_grpo and dapo; `top_entropy_quantile` < 1 and
`off_policy_mask_threshold` (token and sequence masks from the current policy's statistics), vLLM's
importance-sampling correction, the entropy bonus, the MoE auxiliary loss, sequence parallelism
(TRL's GRPOConfig refuses it too: the batch is generated after the data adapter); per batch, advantages
given per token (B, T) and multimodal inputs.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from ..core import GRPO, IGNORE_INDEX
from ..core.internal import GRPO_LOSS_TYPES
from .sequence_parallel import deepspeed_sequence_parallel
from .trainer import StreamBPInit, StreamBPStep, StreamedBatch, check_batch_keys, refuse

GRPO_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "tool_mask",
    "advantages",
    "num_items_in_batch",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",  # vLLM's, read only by the refused off-policy mask
)


class StreamBPGRPOTrainer(StreamBPInit, GRPOTrainer, StreamBPStep):
    """GRPOTrainer, exact under StreamBP (module docstring). streambp: chunk sizes and placement."""

    recorded_outputs = ("log_probs", "entropy")  # what GRPOTrainer._compute_loss reads
    _streamed_outputs = None  # the recorded outputs while _compute_loss logs from them

    def refuse_unsupported(self) -> None:
        refuse(
            self,
            {
                f"loss_type {self.loss_type!r} is not supported: use one of {', '.join(GRPO_LOSS_TYPES)}": (
                    self.loss_type not in GRPO_LOSS_TYPES
                ),
                "top_entropy_quantile < 1 masks tokens by the entropy of the whole batch under the current "
                "policy: set top_entropy_quantile=1.0": self.top_entropy_quantile < 1.0,
                "off_policy_mask_threshold masks sequences by their KL under the current policy: set it to None": (
                    self.off_policy_mask_threshold is not None
                ),
                "vLLM's importance-sampling correction is not supported: set "
                "vllm_importance_sampling_correction=False": self.use_vllm and self.vllm_importance_sampling_correction,
                "the entropy bonus is not supported: set entropy_coef=0 and use_adaptive_entropy=False": (
                    self._entropy_bonus_enabled
                ),
                "the MoE load-balancing loss needs the router logits of a full forward: set router_aux_loss_coef=0": (
                    self.aux_loss_enabled
                ),
                "sequence parallelism is not supported: GRPO builds its batch by generation inside the trainer, "
                "after DeepSpeed's Ulysses data adapter would cut it; set sp_size=1": (
                    deepspeed_sequence_parallel(self.accelerator)
                ),
            },
        )
        super().refuse_unsupported()

    def streamed_batch(self, inputs, num_items_in_batch) -> StreamedBatch:
        check_batch_keys(inputs, GRPO_KEYS)
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError(
                f"{type(self).__name__}: advantages must be one per sequence, shape (B,); got "
                f"{tuple(advantages.shape)} (per-token advantages are not supported)"
            )
        prompt_width = inputs["prompt_ids"].shape[1]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)  # (B, T), T = P + C
        counted = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:, prompt_width:] = completion_ids.masked_fill(counted == 0, IGNORE_INDEX)

        def per_target(completion_logps: torch.Tensor | None) -> torch.Tensor | None:
            """(B, C) per completion token -> (B, T) per position predicting it (P - 1 .. T - 2)."""
            if completion_logps is None:
                return None
            full = completion_logps.new_zeros(input_ids.shape)
            full[:, prompt_width - 1 : -1] = completion_logps
            return full

        objective = GRPO(
            labels,
            advantages=advantages,
            ref_logps=per_target(inputs.get("ref_per_token_logps")) if self.beta != 0.0 else None,
            old_logps=per_target(inputs.get("old_per_token_logps")),
            beta=self.beta,
            epsilon=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=self.args.delta,
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            temperature=self.temperature,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs["num_items_in_batch"],
            num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps,
            steps_per_generation=self.args.steps_per_generation,
        )
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        return StreamedBatch(input_ids, objective, attention_mask)

    def log_streamed(self, inputs, num_items_in_batch, outputs) -> None:
        self._streamed_outputs = outputs
        try:
            with torch.no_grad():
                self._compute_loss(self.model, inputs)
        finally:
            self._streamed_outputs = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's, except while log_streamed runs _compute_loss: then the streamed step's recorded
        log-probs and entropies of the last logits_to_keep targets, no forward."""
        outputs = self._streamed_outputs
        if outputs is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        return outputs.log_probs[:, -logits_to_keep:], outputs.entropy[:, -logits_to_keep:], None
