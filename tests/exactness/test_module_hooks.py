"""Module hooks that change what a module computes (a steering vector added to a layer's input, a
scaling after a layer, a pre-hook on the final norm or a post-hook on the lm_head) are honoured
exactly in every placement that reruns the layer, or refused in one line: never silently wrong."""

from __future__ import annotations

import pytest
import torch

from sbpbench.methods import MethodSettings
from sbpbench.methods.exactness import compare_methods

from ..conftest import FAMILIES, padded_batch, tiny_model

EXACT_PLACEMENTS = ("gpu", "cpu", "recompute:2", "cpu+recompute:2")


def _steer(module, args):
    """A steering vector added to the module's input: what a hook that changes the input does."""
    return (args[0] + 0.25 * torch.ones_like(args[0][..., :1]).expand_as(args[0]),)


def _scale(module, args, output):
    """A post-hook that scales the module's output."""
    return (output[0] * 0.5, *output[1:]) if isinstance(output, tuple) else output * 0.5


def _hooked(family: str, where: str):
    model = tiny_model(family, num_hidden_layers=3)
    parts = {"layer": model.model.layers[1], "norm": model.model.norm, "lm_head": model.lm_head}
    if where == "lm_head":
        parts[where].register_forward_hook(_scale)
    else:
        parts[where].register_forward_pre_hook(_steer)
        model.model.layers[2].register_forward_hook(_scale)
    return model


@pytest.mark.parametrize("checkpoints", EXACT_PLACEMENTS)
@pytest.mark.parametrize("where", ["layer", "norm", "lm_head"])
@pytest.mark.parametrize("family", FAMILIES[:3])
def test_hooks_that_change_the_computation_are_honoured_exactly(family, where, checkpoints):
    """fp64: loss and every gradient equal standard BP's with the hooks in place."""
    model = _hooked(family, where)
    batch = padded_batch(model, batch_size=2, seq_len=19, lengths=[19, 14])
    settings = MethodSettings(chunk_size=4, logits_chunk_size=5, checkpoints=checkpoints)
    (result,) = compare_methods(model, batch, ["streambp"], settings)
    assert result.ok, "\n".join(d.describe() for d in result.failures())


def test_the_hooks_change_the_result():
    """The hooks above are not no-ops: bp's loss with them differs from bp's loss without."""
    batch = padded_batch(tiny_model("tiny/qwen3"), batch_size=1, seq_len=12)
    plain, hooked = tiny_model("tiny/qwen3", num_hidden_layers=3), _hooked("tiny/qwen3", "layer")
    with torch.no_grad():
        losses = [m(input_ids=batch.input_ids, labels=batch.labels).loss for m in (plain, hooked)]
    assert not torch.isclose(*losses)


def test_a_hook_that_changes_a_layer_input_is_refused_under_the_stream_placement():
    """The stream placement reads a layer's input chunks from host memory, past its pre-hooks: refused."""
    model = _hooked("tiny/qwen3", "layer")
    batch = padded_batch(model, batch_size=1, seq_len=12)
    settings = MethodSettings(chunk_size=4, logits_chunk_size=5, checkpoints="stream")
    with pytest.raises(RuntimeError, match="a forward hook or the decoder changed them"):
        compare_methods(model, batch, ["streambp"], settings)
