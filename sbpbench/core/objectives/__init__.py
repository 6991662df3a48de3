"""Training objectives as typed objects, shared by every method: SFT (base.py), GRPO (grpo.py) and
DPO (dpo.py), with the options of TRL's trainers that change gradients, named as TRL names them.
base.py gives the streaming protocol head.py follows."""

from .base import SFT, Objective, SequenceSumsObjective, token_logps
from .dpo import DPO, DPO_LOSS_TYPES, F_DIVERGENCE_TYPES
from .grpo import GRPO, GRPO_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS

__all__ = [
    "DPO",
    "DPO_LOSS_TYPES",
    "F_DIVERGENCE_TYPES",
    "GRPO",
    "GRPO_LOSS_TYPES",
    "IMPORTANCE_SAMPLING_LEVELS",
    "SFT",
    "Objective",
    "SequenceSumsObjective",
    "token_logps",
]
