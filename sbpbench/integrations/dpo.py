"""StreamBPDPOTrainer: TRL's DPOTrainer with each training step's forward + backward by StreamBP.

A DPO batch is TRL's: chosen rows then rejected rows, right-padded, `completion_mask` on the response
tokens. The loss is the core DPO objective with the trainer's options (every loss type, weights,
label smoothing, f-divergence), divided by the accumulation steps as the Trainer divides DPO's
per-batch mean. The reference log-probs are the batch's precomputed ones, or TRL's own
`compute_ref_log_probs` on the reference model (or the adapter-free model under PEFT), run before
the streamed step. DPOTrainer._compute_loss then logs every metric (rewards, margins, log-probs,
entropy, logits, token accuracy) from the per-token outputs recorded from the streamed head, with
those reference log-probs (token_outputs.py).

Refused: `ld_alpha` (length-desensitised sums), `use_weighting` (WPO weights from the whole
next-token distribution), f_divergence_type "alpha_divergence", the MoE auxiliary loss and sequence
parallelism (DeepSpeed's data adapter cuts causal-LM batches, not preference pairs). TRL 1.16
itself turns `padding_free=True` back into padding (with a warning), so that needs nothing here.
"""

from __future__ import annotations

import torch
from trl import DPOTrainer

from ..core import DPO
from .sequence_parallel import deepspeed_sequence_parallel
from .token_outputs import replay_model
from .trainer import StreamBPInit, StreamBPStep, StreamedBatch, check_batch_keys, refuse

DPO_KEYS = ("input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps")


class StreamBPDPOTrainer(StreamBPInit, DPOTrainer, StreamBPStep):
    """DPOTrainer, exact under StreamBP (module docstring). streambp: chunk sizes and placement."""

    recorded_outputs = ("log_probs", "entropy", "mean_logits", "is_top1")  # what DPOTrainer._compute_loss reads

    def refuse_unsupported(self) -> None:
        refuse(
            self,
            {
                "ld_alpha weights each response's tokens by their position past the shorter response: set "
                "ld_alpha=None": self.ld_alpha is not None,
                "use_weighting needs each token's whole next-token distribution (WPO weights): set "
                "use_weighting=False": self.use_weighting,
                "f_divergence_type 'alpha_divergence' is not supported: use reverse_kl, forward_kl or "
                "js_divergence": self.f_divergence_type == "alpha_divergence",
                "the MoE load-balancing loss needs the router logits of a full forward: set router_aux_loss_coef=0": (
                    self.aux_loss_enabled
                ),
                "sequence parallelism is not supported: DeepSpeed's Ulysses data adapter cuts causal-LM batches "
                "(labels, position_ids), not DPO's chosen and rejected rows; set sp_size=1": (
                    deepspeed_sequence_parallel(self.accelerator)
                ),
            },
        )
        super().refuse_unsupported()

    def streamed_batch(self, inputs, num_items_in_batch) -> StreamedBatch:
        check_batch_keys(inputs, DPO_KEYS)
        if not self.precompute_ref_logps:  # into the batch: the metrics below read them there
            inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = self.compute_ref_log_probs(
                self.ref_model or self.model, inputs
            )
        input_ids = inputs["input_ids"]
        objective = DPO(
            input_ids.masked_fill(inputs["completion_mask"] == 0, -100),
            ref_logps=torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]),
            beta=self.beta,
            loss_type=tuple(self.loss_types),
            loss_weights=tuple(self.loss_weights),
            label_smoothing=self.label_smoothing,
            f_divergence_type=self.f_divergence_type,
            discopop_tau=self.args.discopop_tau,
            gradient_accumulation_steps=self.accumulation_divisor(num_items_in_batch),
        )
        return StreamedBatch(input_ids, objective, inputs["attention_mask"])

    def log_streamed(self, inputs, num_items_in_batch, outputs) -> None:
        precompute, self.precompute_ref_logps = self.precompute_ref_logps, True  # they are in the batch now
        try:
            with torch.no_grad():
                self._compute_loss(replay_model(outputs), inputs, False)
        finally:
            self.precompute_ref_logps = precompute
