"""Inputs StreamBP cannot handle exactly are refused with a clear message, never approximated."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from sbpbench.core import StreamConfig, UnsupportedModelError, stream_backward
from sbpbench.data import make_batch

from ..conftest import padded_batch, tiny_model


def test_padding_between_real_tokens_is_refused():
    """An attention_mask row that is not 0...0 1...1 0...0 (a hole among real tokens) is refused."""
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=2, seq_len=8)
    mask = batch.attention_mask.clone()
    mask[1, 3] = 0
    labels = batch.labels.masked_fill(mask == 0, -100)
    labels[1, 4] = -100
    with pytest.raises(ValueError, match="padding between real tokens"):
        stream_backward(model, batch.input_ids, labels, attention_mask=mask)


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_counted_label_after_padding_is_refused(left):
    """A padded position that would predict a counted label (the token after a right or left pad) is refused."""
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=2, seq_len=8, lengths=[8, 4])
    mask = batch.attention_mask.flip(1) if left else batch.attention_mask
    with pytest.raises(ValueError, match="-100 where a padded position"):
        stream_backward(model, batch.input_ids, batch.input_ids, attention_mask=mask)


@pytest.mark.parametrize(
    ("position_ids", "message"),
    [
        ([[0, 1, 2, 4, 5, 6]], "count 0, 1, 2"),
        ([[1, 2, 3, 4, 5, 6]], "count 0, 1, 2"),
        ([[0, 1, 2, 3, 4]], "position_ids must be"),
        ([[0, 1, 2, 0, 1, 2]], "starts a packed document"),
    ],
)
def test_bad_position_ids_are_refused(position_ids, message):
    """position_ids that do not count up from 0 per document, of the wrong shape, or a counted
    label at a document's first token (the previous document would predict it) are refused."""
    model = tiny_model("tiny/qwen3")
    ids = torch.randint(0, 512, (1, 6))
    with pytest.raises(ValueError, match=message):
        stream_backward(model, ids, ids, position_ids=torch.tensor(position_ids))


@pytest.mark.parametrize("objective", ["grpo", "dpo"])
def test_packed_rows_are_refused_for_per_row_objectives(objective):
    """GRPO's advantages and DPO's sums are per row: packed rows are refused for them, before any work."""
    model = tiny_model("tiny/qwen3")
    batch = make_batch(objective, batch_size=2, seq_len=8, vocab_size=512, prompt_len=2)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
    with pytest.raises(ValueError, match="packed rows .* are refused"):
        stream_backward(model, batch.input_ids, objective=batch.objective(), position_ids=position_ids)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"chunk_size": 0}, "StreamConfig.chunk_size must be a positive integer"),
        ({"logits_chunk_size": -3}, "StreamConfig.logits_chunk_size must be a positive integer"),
        ({"chunk_size": 2.5}, "positive integer"),
        ({"chunk_size": True}, "positive integer"),
        ({"fp32_grad_accumulation": "yes"}, "True or False"),
        ({"checkpoints": "disk"}, "checkpoints must be one of"),
        ({"chunk_attention": "fastest"}, "unknown chunk_attention"),
    ],
)
def test_a_bad_knob_is_refused_when_the_config_is_made(kwargs, words):
    """StreamConfig checks every knob once, when made, naming the field: no step is needed."""
    with pytest.raises(ValueError, match=words):
        StreamConfig(**kwargs)


def test_a_forced_kernel_the_device_lacks_is_refused_before_the_step():
    """A kernel with no implementation here (fa3 on a CPU) is refused by the step, before any work."""
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="fa3 cannot run on cpu"):
        stream_backward(model, batch.input_ids, batch.labels, config=StreamConfig(chunk_attention="fa3"))


def test_a_model_without_the_decoder_structure_is_refused_naming_the_part():
    """A GPT-2 model (blocks under `h`, no decoder.layers) is refused, naming what is missing."""
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    ids = torch.randint(0, 64, (1, 8))
    with pytest.raises(UnsupportedModelError, match=r"no decoder\.layers"):
        stream_backward(model, ids, ids)


def test_attention_dropout_in_training_is_refused():
    """Dropout would make each chunk's re-forward differ from the checkpoint pass."""
    model = tiny_model("tiny/llama", attention_dropout=0.1)
    model.train()
    batch = padded_batch(model, batch_size=1, seq_len=8)
    with pytest.raises(UnsupportedModelError, match="attention_dropout"):
        stream_backward(model, batch.input_ids, batch.labels)
    model.eval()
    stream_backward(model, batch.input_ids, batch.labels)  # eval mode: no dropout, accepted


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"config": {"chunk_size": 4}}, TypeError, "config must be a StreamConfig, got dict"),
        ({"sequence_parallel": "yes"}, TypeError, "sequence_parallel must be a SequenceParallel, got str"),
        ({"hooks": "timer"}, TypeError, "hooks must be a StepHooks, got str"),
        ({"one_dimensional": True}, ValueError, r"input_ids must be a \(batch, seq_len\) tensor, got shape \(8,\)"),
    ],
    ids=["config-dict", "sequence-parallel-str", "hooks-str", "ids-1d"],
)
def test_an_argument_of_the_wrong_kind_is_refused_before_any_work(kwargs, error, words):
    """A dict for config, a string for sequence_parallel or hooks, 1-D input_ids: a TypeError or
    ValueError naming the argument, and the model's gradients untouched."""
    model = tiny_model("tiny/qwen3")
    ids = torch.randint(0, 512, (1, 8))
    if kwargs.pop("one_dimensional", False):
        ids = ids[0]
    with pytest.raises(error, match=words):
        stream_backward(model, ids, ids, **kwargs)
    assert all(p.grad is None for p in model.parameters())


def test_a_process_group_that_is_not_one_is_refused():
    """SequenceParallel(group="world") is a TypeError naming the group, before torch.distributed is asked."""
    from sbpbench.core.parallel.sequence_group import SequenceParallel

    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup or None"):
        SequenceParallel(group="world")


def test_a_model_with_every_parameter_frozen_is_refused():
    """No trainable parameter: a RuntimeError, as loss.backward() would raise, never a loss without gradients."""
    model = tiny_model("tiny/qwen3")
    model.requires_grad_(False)
    ids = torch.randint(0, 512, (1, 8))
    with pytest.raises(RuntimeError, match="no parameter of the model requires grad"):
        stream_backward(model, ids, ids)
