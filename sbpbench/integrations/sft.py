"""StreamBPSFTTrainer: TRL's SFTTrainer with each training step's forward + backward by StreamBP.

TRL 1.16's SFT loss is the summed negative log-likelihood of the labels over `num_items_in_batch`
(SFTTrainer.compute_loss through its fused LM head): the SFT objective, scaled as the Trainer's
causal-LM loss (trainer.py). Padded and padding-free batches (one packed row, `position_ids`
restarting at 0 for each document, the first label of each -100) both stream exactly. The
`entropy`, `mean_token_accuracy` and `num_tokens` metrics come from SFTTrainer.compute_loss itself,
run on the per-token outputs recorded from the streamed head (token_outputs.py). Under DeepSpeed
sequence parallelism (sequence_parallel.py) packed and padding-free rows are refused, and those
metrics are not logged.
"""

from __future__ import annotations

import torch
from trl import SFTTrainer

from .sequence_parallel import deepspeed_sequence_parallel
from .token_outputs import replay_model
from .trainer import StreamBPInit, StreamBPStep, refuse


class StreamBPSFTTrainer(StreamBPInit, SFTTrainer, StreamBPStep):
    """SFTTrainer, exact under StreamBP (module docstring). streambp: chunk sizes and placement."""

    recorded_outputs = ("log_probs", "entropy", "is_top1")  # what SFTTrainer.compute_loss reads

    def refuse_unsupported(self) -> None:
        refusals = {
            "loss_type='dft' weights each token by its probability: use loss_type='nll'": self.args.loss_type != "nll",
            "the MoE load-balancing loss needs the router logits of a full forward: set router_aux_loss_coef=0": (
                self.aux_loss_enabled
            ),
            "sequence parallelism takes one sequence per row from position 0, not packed or padding-free rows: set "
            "packing=False and padding_free=False": deepspeed_sequence_parallel(self.accelerator)
            and (self.args.packing or self.padding_free),
        }
        refuse(self, refusals)
        super().refuse_unsupported()

    def log_streamed(self, inputs, num_items_in_batch, outputs) -> None:
        with torch.no_grad():
            self.compute_loss(replay_model(outputs), dict(inputs), num_items_in_batch=num_items_in_batch)
