"""Drop-in StreamBP trainers: transformers' Trainer and TRL's SFT, DPO and GRPO trainers whose
training step's forward + backward is `stream_backward` on the batch the stock trainer would feed its
loss, with the stock loss scaling and logging (docs/trainers.md). A script switches by class name:

    from sbpbench.core import StreamConfig
    from sbpbench.integrations import StreamBPSFTTrainer
    trainer = StreamBPSFTTrainer(model=model, args=SFTConfig(...), train_dataset=dataset,
                                 streambp=StreamConfig(chunk_size=2048))

The trainer classes are imported on first use, so importing this package imports neither TRL (an
optional extra, `pip install -e ".[trl]"`) nor transformers' Trainer; StreamBPTrainer needs no TRL.
"""

from __future__ import annotations

import importlib

_TRAINERS = {  # class -> module defining it
    "StreamBPTrainer": ".trainer",
    "StreamBPSFTTrainer": ".sft",
    "StreamBPDPOTrainer": ".dpo",
    "StreamBPGRPOTrainer": ".grpo",
}

__all__ = ["StreamBPDPOTrainer", "StreamBPGRPOTrainer", "StreamBPSFTTrainer", "StreamBPTrainer"]


def __getattr__(name: str):
    if name not in _TRAINERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_TRAINERS[name], __name__)
    except ModuleNotFoundError as error:
        if error.name != "trl":
            raise
        raise ImportError(f"{name} subclasses a TRL trainer; install TRL: pip install -e '.[trl]'") from error
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
