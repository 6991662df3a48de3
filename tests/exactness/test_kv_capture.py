"""The K/V capture of the layer backward by the projection alone (core/architecture/key_values.py):
only the input norm, k/v projections, k_norm and the keys' RoPE run, verified on the first chunk
against the whole-layer path (which runs the layer until its attention function stores them), so
the buffers are bitwise that path's; every family, sliding windows, LoRA, fp64 and fp32; a layer
no projection reproduces takes the whole-layer path."""

from __future__ import annotations

import pytest
import torch

from sbpbench.core.architecture import key_values
from sbpbench.core.architecture.key_values import LayerKeyValues
from sbpbench.core.architecture.parts import resolve_parts
from sbpbench.core.attention import DEFAULT_ATTENTION, KVBuffer
from sbpbench.core.checkpoints import ChunkedPasses, forward_checkpoints
from sbpbench.core.config import StreamConfig
from sbpbench.core.layer_backward import _capture_keys_values, whole_layer_keys_values
from sbpbench.core.layout import chunk_bounds, chunk_kwargs
from sbpbench.core.stream import _streaming_mode
from sbpbench.data import make_batch
from sbpbench.models import apply_lora

from ..conftest import FAMILIES, streamed, tiny_model

# windows shorter than T, so that the sliding_window each capture records matters
WINDOWED = {
    "tiny/mistral": {"sliding_window": 6},
    "tiny/qwen2": {"sliding_window": 7, "use_sliding_window": True, "max_window_layers": 1},
    "tiny/qwen3": {"sliding_window": 5, "use_sliding_window": True, "max_window_layers": 1},
}
CHUNK, SEQ_LEN = 7, 30  # chunks that do not divide T


def _model(family: str, dtype: torch.dtype, *, windowed: bool = False, lora: bool = False):
    model = tiny_model(family, dtype, **(WINDOWED.get(family, {}) if windowed else {}))
    return apply_lora(model, rank=4, alpha=8, init_nonzero_seed=0) if lora else model


def _whole_layer_buffer(layer, layer_input, kwargs, chunks) -> KVBuffer:
    """The keys/values of every chunk by the whole-layer path alone."""
    buffer = KVBuffer(seq_len=layer_input.shape[1], attend=False)
    whole = whole_layer_keys_values(layer, DEFAULT_ATTENTION)
    for (start, end), hidden in zip(chunks, layer_input.chunks(chunks)):
        buffer.start = start
        buffer.store(*whole(hidden, chunk_kwargs(kwargs, start, end)))
    return buffer


def _captures(model):
    """Per layer: (the whole-layer path's buffer, the capture's buffer, the q_proj calls after the
    first chunk, whether a projection was verified)."""
    parts = resolve_parts(model)
    batch = make_batch("sft", batch_size=2, seq_len=SEQ_LEN, vocab_size=model.config.vocab_size)
    chunks = chunk_bounds(SEQ_LEN, CHUNK)
    results = []
    with _streaming_mode(parts), torch.no_grad():
        saved = forward_checkpoints(parts, batch.input_ids, ChunkedPasses(StreamConfig(chunk_size=CHUNK)))
        for index, layer in enumerate(parts.layers):
            layer_input, kwargs = saved.layer_inputs.get(index, batch.input_ids.device), saved.layer_kwargs[index]
            whole = _whole_layer_buffer(layer, layer_input, kwargs, chunks)
            keys_values = LayerKeyValues(layer, layer, kwargs, whole_layer_keys_values(layer, DEFAULT_ATTENTION))
            keys_values(*next(zip(layer_input.chunks(chunks[:1]), [chunk_kwargs(kwargs, *chunks[0])])))  # verifies
            q_calls = []
            handle = layer.self_attn.q_proj.register_forward_hook(lambda *args, q_calls=q_calls: q_calls.append(1))
            try:
                alone = _capture_keys_values(layer, layer, layer_input, kwargs, chunks, DEFAULT_ATTENTION)
            finally:
                handle.remove()
            results.append((whole, alone, len(q_calls), keys_values.projection is not None))
    return results


def _assert_same(results) -> None:
    for index, (whole, alone, q_calls, verified) in enumerate(results):
        assert verified, f"layer {index}: no projection was verified"
        assert q_calls == 0, f"layer {index}: the projection ran q_proj"
        assert torch.equal(alone.keys, whole.keys), f"layer {index}: keys differ"
        assert torch.equal(alone.values, whole.values), f"layer {index}: values differ"
        assert alone.sliding_window == whole.sliding_window, index


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_projection_gives_the_layer_keys_and_values_bitwise(family, dtype):
    """Every family (Gemma-3 with its sliding layers, the others with a window where they take one):
    the projection is verified, and its K/V buffers equal the whole-layer path's bitwise, with the
    same window, no q_proj."""
    results = _captures(_model(family, dtype, windowed=True))
    windows = {whole.sliding_window for whole, _, _, _ in results}
    if family != "tiny/llama":  # Llama has no sliding window
        assert any(w is not None for w in windows), "no layer had a window"
    _assert_same(results)


@pytest.mark.parametrize("family", ["tiny/qwen3", "tiny/gemma3", "tiny/llama"])
def test_the_projection_calls_lora_wrapped_projections_as_the_layer_does(family):
    """LoRA on q/k/v (peft): the projection calls the wrapped k_proj and v_proj modules, bitwise the
    whole-layer path's keys and values, in fp64."""
    model = _model(family, torch.float64, lora=True)
    assert "lora" in type(resolve_parts(model).layers[0].self_attn.k_proj).__module__
    _assert_same(_captures(model))


def test_a_pre_hook_or_a_patched_forward_takes_the_whole_layer_path():
    """A forward pre-hook on the attention (it might change its input), an instance-level forward on
    the layer, or no RoPE arguments leave the projection out."""
    model = tiny_model("tiny/qwen3", torch.float64)
    layer = resolve_parts(model).layers[0]
    kwargs = {"position_embeddings": (torch.zeros(1), torch.zeros(1))}

    def candidate(call, arguments=kwargs) -> bool:
        return LayerKeyValues(layer, call, arguments, None)._parts is not None

    assert candidate(layer)
    assert candidate(layer.forward)  # a sharded engine's call
    assert not candidate(layer, {})
    handle = layer.self_attn.register_forward_pre_hook(lambda module, args: None)
    assert not candidate(layer)
    handle.remove()
    layer.forward = layer.forward  # an instance attribute, as a wrapper would set
    assert not candidate(layer)
    del layer.forward


def test_a_projection_that_differs_is_not_used(monkeypatch):
    """A candidate whose keys differ from the layer's (here: doubled) fails its verification: the
    capture takes the whole-layer path, bitwise."""
    real = key_values._candidate

    def doubled(*args, **kwargs):
        project = real(*args, **kwargs)
        return lambda hidden, sliced, normed=False: (lambda k, v, w: (2 * k, v, w))(*project(hidden, sliced, normed))

    monkeypatch.setattr(key_values, "_candidate", doubled)
    monkeypatch.setattr(key_values, "_VERDICTS", type(key_values._VERDICTS)())
    results = _captures(_model("tiny/qwen3", torch.float64))
    for whole, alone, _, verified in results:
        assert not verified
        assert torch.equal(alone.keys, whole.keys) and torch.equal(alone.values, whole.values)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_with_projections_equals_one_without_bitwise(monkeypatch, family):
    """fp64, 2 layers, chunks that do not divide T: stream_backward's loss and every gradient are
    bitwise those of the whole-layer K/V capture."""
    model = _model(family, torch.float64, windowed=True)
    batch = make_batch("sft", batch_size=2, seq_len=SEQ_LEN, vocab_size=model.config.vocab_size)

    def step():
        model.zero_grad(set_to_none=True)
        loss = streamed(model, batch.input_ids, objective=batch.objective(), chunk_size=CHUNK, logits_chunk_size=9)
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step()
    monkeypatch.setattr(key_values, "_standard_parts", lambda layer, call: None)
    ref_loss, ref_grads = step()
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert torch.equal(grads[name], ref), name
