"""The official StreamBP code (`streambp` 1.0) as a method name. It pins transformers 4.51.3, so it
never runs in this process: the runner sends its points to an external worker in a virtualenv of
its own (runner/official.py, `sbp peers setup official`). Called here (an in-process step, the
estimator's fake tensors), it is unsupported."""

from __future__ import annotations

from ..data import Batch
from .unsupported import MethodUnsupported


def official(model, batch: Batch, settings):
    raise MethodUnsupported(
        "the official StreamBP code runs only as an external worker in its own virtualenv "
        "(`sbp peers setup official`, then `sbp run --method official` or `sbp check`), not in this process"
    )
