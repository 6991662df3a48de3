"""Left-padded and packed batches (core/layout.py): a left-padded row gets standard BP's loss and
gradients on the same batch (transformers' forward with the same attention_mask); packed rows
(position_ids restarting at 0) get BP's on each document run on its own. fp64, every family."""

from __future__ import annotations

from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from sbpbench.core import attention
from sbpbench.core.labels import shift_labels, sum_cross_entropy
from sbpbench.core.layout import ChunkPlan, Piece, RowGroup, build_layout
from sbpbench.data import SFTBatch
from sbpbench.methods import MethodSettings
from sbpbench.methods.exactness import compare_methods, compare_step
from sbpbench.methods.hf_baseline import hf_forward_backward
from sbpbench.methods.streambp import step_hooks
from sbpbench.models import apply_lora

from ..conftest import FAMILIES, left_padded_batch, packed_rows, streamed, tiny_model
from .test_placement import PLACEMENTS, _deep_model

SEQ_LEN = 29
SPANS = [(6, 29), (0, 29), (3, 25)]  # left padding, none, both sides (a TRL GRPO row)
DOCS = [[7, 12, 3, 9, 1, 1], [20, 13]]  # T = 33; the two 1-token documents stand for TRL's trailing pads
CHUNKS = {"c4-h5": (4, 5), "c7-h3": (7, 3), "c1-h1": (1, 1), "c64-h64": (64, 64)}  # (layer chunk, head chunk)
WINDOWS = [("tiny/mistral", 6), ("tiny/gemma3", 5), ("tiny/qwen2", 7)]


def _window_overrides(family: str, window: int) -> dict:
    overrides = {"sliding_window": window}
    if family == "tiny/qwen2":  # Qwen2 applies the window only when asked, to layers >= max_window_layers
        overrides |= {"use_sliding_window": True, "max_window_layers": 1}
    return overrides


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return grads


def per_document_step(model, input_ids, labels, position_ids):
    """BP on each document run on its own (transformers' forward on the document alone): the SFT
    loss of the packed batch, normalised by the batch's count, summed over documents."""
    model.zero_grad(set_to_none=True)
    count = int((shift_labels(labels) != -100).sum())
    loss = torch.zeros((), dtype=torch.float64)
    for row in range(input_ids.shape[0]):
        starts = (position_ids[row] == 0).nonzero().flatten().tolist() + [input_ids.shape[1]]
        for start, end in pairwise(starts):
            targets = shift_labels(labels[row : row + 1, start:end])
            if bool((targets != -100).any()):  # a document without counted labels adds nothing
                part = sum_cross_entropy(model(input_ids=input_ids[row : row + 1, start:end]).logits, targets) / count
                part.backward()
                loss += part.detach()
    return loss, _grads(model)


def bp_step(model, batch):
    """Standard BP on the batch as it is (transformers' forward with its attention_mask)."""
    model.zero_grad(set_to_none=True)
    return hf_forward_backward(model, batch), _grads(model)


def streamed_step(model, input_ids, labels=None, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = streamed(model, input_ids, labels, **kwargs)
    return loss, _grads(model)


def assert_same(model, ours, reference, what: str = "streambp"):
    result = compare_step(what, "reference", model, ours, reference)
    assert result.ok, f"{what} differs:\n" + "\n".join(d.describe() for d in result.failures())


def _assert_matches_bp(model, batch, chunks):
    chunk, logits_chunk = CHUNKS[chunks]
    settings = MethodSettings(chunk_size=chunk, logits_chunk_size=logits_chunk)
    for result in compare_methods(model, batch, ["streambp"], settings):
        assert result.ok, "streambp differs from bp:\n" + "\n".join(d.describe() for d in result.failures())


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_matches_bp(family, chunks):
    """Rows left-padded, unpadded and padded on both sides, chunks across the pads: bp's loss and gradients."""
    model = tiny_model(family)
    _assert_matches_bp(model, left_padded_batch(model, seq_len=SEQ_LEN, spans=SPANS), chunks)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_matches_bp_fp32(family):
    """The same in fp32 (1e-5)."""
    model = tiny_model(family, torch.float32)
    _assert_matches_bp(model, left_padded_batch(model, seq_len=SEQ_LEN, spans=SPANS), "c4-h5")


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_match_per_document_bp(family, chunks):
    """Two packed rows (documents of 1 to 20 tokens, chunk boundaries inside and across them): BP per document."""
    model = tiny_model(family)
    input_ids, labels, position_ids = packed_rows(model, doc_lengths=DOCS)
    chunk, logits_chunk = CHUNKS[chunks]
    ours = streamed_step(
        model, input_ids, labels, position_ids=position_ids, chunk_size=chunk, logits_chunk_size=logits_chunk
    )
    assert_same(model, ours, per_document_step(model, input_ids, labels, position_ids))


@pytest.mark.parametrize(("family", "window"), WINDOWS)
def test_sliding_window_within_padding_and_documents(family, window):
    """A window spanning several chunks: counted with the pads under left padding (as transformers'
    mask), within each document when packed."""
    model = tiny_model(family, **_window_overrides(family, window))
    _assert_matches_bp(model, left_padded_batch(model, seq_len=SEQ_LEN, spans=SPANS), "c4-h5")
    input_ids, labels, position_ids = packed_rows(model, doc_lengths=DOCS)
    ours = streamed_step(model, input_ids, labels, position_ids=position_ids, chunk_size=4, logits_chunk_size=6)
    assert_same(model, ours, per_document_step(model, input_ids, labels, position_ids))


def test_rows_and_documents_without_counted_labels_add_zero():
    """A left-padded row and a packed document whose labels are all -100 contribute nothing, not an error."""
    model = tiny_model("tiny/llama")
    batch = left_padded_batch(model, seq_len=SEQ_LEN, spans=SPANS)
    labels = batch.labels.clone()
    labels[1] = -100
    _assert_matches_bp(model, SFTBatch(batch.input_ids, batch.attention_mask, labels), "c4-h5")
    input_ids, labels, position_ids = packed_rows(model, doc_lengths=DOCS)
    labels[0, 7:19] = -100  # the 12-token document
    ours = streamed_step(model, input_ids, labels, position_ids=position_ids, chunk_size=5, logits_chunk_size=4)
    assert_same(model, ours, per_document_step(model, input_ids, labels, position_ids))


FAST_PLACEMENTS = ("gpu", "cpu", "recompute:3", "cpu+recompute:4+spill")


def _placement_cases():
    """The fast tier: Qwen3 without LoRA, one placement of each kind; the slow tier: every family,
    with and without LoRA, every placement."""
    yield pytest.param("tiny/qwen3", False, FAST_PLACEMENTS, id="tiny/qwen3-full-fast")
    for family in FAMILIES:
        for lora in (False, True):
            name = f"{family}-{'lora' if lora else 'full'}-all"
            yield pytest.param(family, lora, ("gpu", *PLACEMENTS), id=name, marks=pytest.mark.slow)


@pytest.mark.parametrize(("family", "lora", "placements"), list(_placement_cases()))
def test_every_placement_and_lora(family, lora, placements):
    """5 layers, checkpoint placements, with and without LoRA: left-padded rows equal bp, packed rows BP per document."""
    model = _deep_model(family, lora)
    batch = left_padded_batch(model, seq_len=SEQ_LEN, spans=SPANS)
    input_ids, labels, position_ids = packed_rows(model, doc_lengths=DOCS)
    left_reference, packed_reference = bp_step(model, batch), per_document_step(model, input_ids, labels, position_ids)
    for placement in placements:
        kwargs = {"chunk_size": 7, "logits_chunk_size": 3, "checkpoints": placement}
        left = streamed_step(model, batch.input_ids, batch.labels, attention_mask=batch.attention_mask, **kwargs)
        assert_same(model, left, left_reference, f"{placement}, left padding")
        packed = streamed_step(model, input_ids, labels, position_ids=position_ids, **kwargs)
        assert_same(model, packed, packed_reference, f"{placement}, packed")


def test_lora_left_padding_matches_bp():
    """LoRA adapters on a left-padded batch: exact (compare_methods through the methods registry)."""
    model = apply_lora(tiny_model("tiny/mistral"), rank=4, alpha=8, init_nonzero_seed=0)
    _assert_matches_bp(model, left_padded_batch(model, seq_len=SEQ_LEN, spans=SPANS), "c4-h5")


def test_cuda_branch_takes_no_mask_and_stays_exact(monkeypatch):
    """On the CUDA branch, left-padded and packed rows reach SDPA with is_causal or the lower-right
    causal bias only (flash / efficient kernels, no (c, n) mask), and the gradients stay exact."""
    masks = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    model = tiny_model("tiny/qwen3")
    batch = left_padded_batch(model, seq_len=SEQ_LEN, spans=SPANS)
    input_ids, labels, position_ids = packed_rows(model, doc_lengths=DOCS)
    left_reference, packed_reference = bp_step(model, batch), per_document_step(model, input_ids, labels, position_ids)
    # attention.py's own F only: torch's stays as it is (CausalBias dispatches on its identity)
    monkeypatch.setattr(attention, "F", SimpleNamespace(scaled_dot_product_attention=recording))
    with step_hooks(cuda_branch=causal_lower_right):
        kwargs = {"chunk_size": 4, "logits_chunk_size": 5}
        left = streamed_step(model, batch.input_ids, batch.labels, attention_mask=batch.attention_mask, **kwargs)
        packed = streamed_step(model, input_ids, labels, position_ids=position_ids, **kwargs)
    assert_same(model, left, left_reference, "left padding")
    assert_same(model, packed, packed_reference, "packed")
    assert masks and all(mask is None or isinstance(mask, CausalBias) for mask in masks)
    assert any(isinstance(mask, CausalBias) for mask in masks)


def test_plan_cuts_chunks_at_segments_and_groups_rows():
    """Pieces end at segment boundaries, a dead segment gets no keys, consecutive rows with the same
    pieces share a group, key_start is the first key any piece reads, one shared piece is one call."""
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[:2, :3] = 0  # rows 0 and 1 left-padded by 3
    counted = mask.bool()
    layout = build_layout(mask, None, counted)
    assert layout.plan(0, 5, None) == ChunkPlan(
        0, (RowGroup(slice(0, 2), (Piece(0, 3, None), Piece(3, 5, 3))), RowGroup(slice(2, 3), (Piece(0, 5, 0),)))
    )
    assert layout.plan(5, 10, None).groups[0].pieces == (Piece(5, 10, 3),)
    assert layout.plan(5, 10, 3) == ChunkPlan(3)  # the window hides the pads: one piece for all rows
    assert build_layout(mask.flip(1), None, counted.flip(1)) is None  # right padding: no plan needed


def test_packed_plan_follows_documents_and_merges_dead_ones():
    """Packed documents become segments; trailing pad documents merge into one dead segment."""
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 0]])
    counted = torch.tensor([[True, True, False, True, False, False, False]])
    layout = build_layout(None, position_ids, counted)
    assert [(s.start, s.end, s.live) for s in layout.rows[0]] == [(0, 3, True), (3, 5, True), (5, 7, False)]
    assert layout.plan(2, 7, None).groups[0].pieces == (Piece(2, 3, 0), Piece(3, 5, 3), Piece(5, 7, None))
