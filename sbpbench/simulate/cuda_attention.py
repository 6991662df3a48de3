"""Attention as a CUDA GPU would run it, on fake CPU tensors.

On a CPU, `F.scaled_dot_product_attention` runs the CPU flash kernel; on a GPU, PyTorch's own
dispatcher (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, `select_sdp_backend`) picks
FlashAttention-2, then the memory-efficient (CUTLASS) kernel, then the math fallback, and the
composite (aten/src/ATen/native/transformers/attention.cpp, `scaled_dot_product_attention`)
prepares the inputs for the one it picked. `CudaAttention` stands in for
`F.scaled_dot_product_attention`: it replays that choice and that preparation and calls the CUDA
kernels' own aten ops, whose meta kernels run under fake CPU tensors and allocate what the CUDA
ops return:

- flash: bf16/fp16, no explicit mask, head_dim <= 256 and equal for q/k/v, no `is_causal` with
  more keys than queries, GQA only with enable_gqa; a head_dim not a multiple of 8 is padded.
- efficient: bf16/fp16/fp32, equal heads, head_dim a multiple of 8 (half) or 4 (fp32). A boolean
  mask becomes an additive mask in the query dtype (`torch.where`, a new tensor per call) and,
  when its strides are not multiples of 8, a padded copy (`preprocess_mask`); the kernel saves
  that bias for backward.
- math: anything else (materialises (T, T) scores).
- `torch.nn.attention.bias.causal_lower_right` (StreamBP's chunk-vs-prefix attention) replays
  `CausalBias._dispatch`: flash with is_causal (lower-right in FA2), else the efficient kernel
  with custom_mask_type LOWER_RIGHT, else math on the materialised mask.
Assumed: an sm80/sm90 GPU and PyTorch's default priority (flash > efficient > math). Not modelled:
cuDNN attention, which recent PyTorch prefers on sm90/sm100 with cuDNN > 9.15
(`check_prefer_cudnn_attention`); efficient-kernel GQA (PyTorch main accepts it; with grouped heads
we fall back to math, as PyTorch 2.5-2.9 did); the few-KiB RNG state tensors the kernels return.

Allocations made inside the CUDA kernels' C++ never reach the dispatcher, so a meta kernel cannot
show them. They are the per-op terms of `hidden_bytes`, live only while the op runs (sources are
files of pytorch/pytorch under aten/src/ATen/native/transformers/cuda/):
- flash backward, flash_attn/flash_api.cpp `mha_bwd`: softmax_d (B, H, Tq128) fp32, the dQ
  accumulator dq_accum (B, Tq128, H, d32) fp32 (Tq128: Tq rounded up to 128; d32: head_dim
  rounded up to 32, 64 above 128), and under GQA dk_expanded, dv_expanded (B, Tk, H, d) in the
  input dtype (dK/dV per query head, summed over each group afterwards);
- efficient backward, attention_backward.cu `_efficient_attention_backward` with
  mem_eff_attention/kernel_backward.h: for bf16/fp16, delta (B, H, M) fp32 and the workspace,
  dominated by the fp32 dQ accumulator `workspace_elements_gq` (M rounded up to the 64-query
  block, head_dim to the 64/128 column tile); for fp32, delta from grad_out * out, a (B, M, H, K)
  fp32 temporary, and no dQ accumulator;
- efficient forward, attention.cu `_efficient_attention_forward`: for bf16/fp16 with
  head_dim > 128 (kernels that iterate over the value dimension) an fp32 output accumulator
  (B, M, H, Kv);
- either backward: a `.contiguous()` copy of grad_out or out when their (B, T, H, d) view is strided.
Not modelled: FA2's split-KV forward accumulators (used only when B * H * ceil(Tq / 64) is below
1.6x the SM count, i.e. short query blocks, a few MiB).
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from typing import Self

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch.utils._python_dispatch import _disable_current_modes

from ..methods.streambp import step_hooks

aten = torch.ops.aten

FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
_HALF = (torch.float16, torch.bfloat16)
_MEM_EFF_MASK_ALIGNMENT = 8  # attention.cpp preprocess_mask: bias strides must be multiples of 8
_FLASH_HEAD_DIM_ALIGNMENT = 8  # attention.cpp pad_last_dim<8> before the flash kernel
_FLASH_MAX_HEAD_DIM = 256


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def choose_kernel(query, key, value, attn_mask, is_causal: bool, enable_gqa: bool) -> str:
    """The backend `select_sdp_backend` picks for dense (B, H, T, d) inputs on sm80/sm90."""
    heads, kv_heads = query.shape[-3], key.shape[-3]
    same_heads = heads == kv_heads == value.shape[-3]
    gqa = enable_gqa and kv_heads == value.shape[-3] and heads % kv_heads == 0
    d_q, d_k, d_v = query.shape[-1], key.shape[-1], value.shape[-1]
    causal_non_square = is_causal and query.shape[-2] != key.shape[-2]
    last_dim_contiguous = all(t.stride(-1) == 1 for t in (query, key, value))
    if (
        query.dtype in _HALF
        and last_dim_contiguous
        and attn_mask is None
        and d_q == d_k == d_v <= _FLASH_MAX_HEAD_DIM
        and (same_heads or gqa)
        and not causal_non_square
    ):
        return FLASH
    alignment = 8 if query.dtype in _HALF else 4  # sdp_utils.cpp minimum_gemm_alignment, sm80+
    aligned = last_dim_contiguous and all(t.storage_offset() % alignment == 0 for t in (query, key, value))
    if (
        query.dtype in (*_HALF, torch.float32)
        and same_heads
        and d_q == d_k
        and d_q % alignment == 0
        and d_v % alignment == 0
        and aligned
    ):
        return EFFICIENT
    return MATH


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """attention.cpp convert_boolean_attn_mask: True (attend) -> 0, False -> -inf, a new tensor."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype))


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """attention.cpp preprocess_mask: pad the last dim when a stride is unaligned, then expand."""
    aligned = mask.stride(-1) == 1 and all(s % _MEM_EFF_MASK_ALIGNMENT == 0 for s in mask.stride()[:-1])
    if not aligned:
        last = mask.shape[-1]
        mask = F.pad(mask, (0, _MEM_EFF_MASK_ALIGNMENT - last % _MEM_EFF_MASK_ALIGNMENT))[..., :last]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _pad_head_dim(t: torch.Tensor) -> torch.Tensor:
    extra = -t.shape[-1] % _FLASH_HEAD_DIM_ALIGNMENT
    return F.pad(t, (0, extra)) if extra else t


def _flash(query, key, value, dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    head_dim = query.shape[-1]
    scale = scale if scale is not None else head_dim**-0.5
    out = aten._scaled_dot_product_flash_attention(
        _pad_head_dim(query), _pad_head_dim(key), _pad_head_dim(value), dropout_p, is_causal, False, scale=scale
    )[0]
    return out[..., :head_dim]


def _needs_logsumexp(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class CudaAttention:
    """with CudaAttention() as attention: ...; attention.kernels counts the kernels used.

    Replaces `torch.nn.functional.scaled_dot_product_attention` for the duration of the block
    (transformers and core.attention look it up at each call). Not a TorchFunctionMode: a mode is
    switched off inside the functions it intercepts, and `Tensor.backward` is one of them, so a
    checkpointed layer's recomputation would run without it."""

    def __init__(self):
        self.kernels: Counter[str] = Counter()
        self._original = None

    def __enter__(self) -> Self:
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self.attention
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._original

    def attention(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ) -> torch.Tensor:
        if isinstance(attn_mask, CausalBias):
            return self._causal_bias(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
        kernel = choose_kernel(query, key, value, attn_mask, is_causal, enable_gqa)
        self.kernels[kernel] += 1
        attn_mask = _additive_mask(attn_mask, query.dtype)
        if kernel == FLASH:
            return _flash(query, key, value, dropout_p, is_causal, scale)
        if kernel == EFFICIENT:
            bias = None if attn_mask is None else _efficient_bias(attn_mask, query, key)
            logsumexp = _needs_logsumexp(query, key, value)
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, logsumexp, dropout_p, is_causal, scale=scale
            )[0]
        return aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]

    def _causal_bias(self, query, key, value, bias: CausalBias, dropout_p, scale, enable_gqa) -> torch.Tensor:
        """torch/nn/attention/bias.py CausalBias._dispatch, with CUDA's kernel choice."""
        if bias.seq_len_q == bias.seq_len_kv or bias.variant == CausalVariant.UPPER_LEFT:
            return self.attention(query, key, value, None, dropout_p, True, scale, enable_gqa)
        kernel = choose_kernel(query, key, value, None, False, enable_gqa)
        if kernel == FLASH:  # FA2's is_causal is aligned to the bottom right
            self.kernels[FLASH] += 1
            return _flash(query, key, value, dropout_p, True, scale)
        if kernel == EFFICIENT:
            self.kernels[EFFICIENT] += 1
            out = aten._efficient_attention_forward(
                query.transpose(1, 2),
                key.transpose(1, 2),
                value.transpose(1, 2),
                None,
                None,
                None,
                None,
                None,
                dropout_p,
                int(CausalVariant.LOWER_RIGHT),
                any(t.requires_grad for t in (query, key, value)),
                scale=scale,
            )[0]
            return out.transpose(1, 2)
        mask = bias._materialize(query.device)
        return self.attention(query, key, value, mask, dropout_p, False, scale, enable_gqa)

    def kernel_names(self) -> str:
        """The kernels used, e.g. "flash" or "efficient+flash"."""
        return "+".join(sorted(self.kernels))


def _causal_lower_right_outside_fake_mode(num_queries: int, num_keys: int) -> CausalBias:
    """A CausalBias is a tensor subclass: made inside a FakeTensorMode it would be a FakeTensor. Its
    constructor (torch 2.13) also allocates an uninitialised tensor of about num_queries x num_keys
    elements that nothing reads (34 GB for the 32k queries of a sequence-parallel chunk over 1M keys),
    so it is made empty with the three fields causal_lower_right sets."""
    with _disable_current_modes():
        bias = torch.empty(0).as_subclass(CausalBias)
    bias.variant, bias.seq_len_q, bias.seq_len_kv = CausalVariant.LOWER_RIGHT, num_queries, num_keys
    return bias


def streambp_cuda_branch():
    """StreamBP's attention (core.attention) as on a GPU, through the steps' hooks
    (SteeredHooks.cuda_branch), with the lower-right causal bias made outside the fake mode."""
    return step_hooks(cuda_branch=_causal_lower_right_outside_fake_mode)


def _bytes(*shape: int, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _copy_bytes(t: torch.Tensor) -> list[int]:
    """A `.contiguous()` copy of t, when t is strided."""
    return [] if t.is_contiguous() else [_bytes(t.numel(), dtype=t.dtype)]


def _flash_backward(args) -> list[int]:
    """flash_api.cpp mha_bwd (non-deterministic). q, k, v are (B, H, T, d) here."""
    grad_out, query, key, _, out = args[:5]
    batch, heads, seq_q, head_dim = query.shape
    kv_heads, seq_k = key.shape[1], key.shape[2]
    seq_q_rounded = _round_up(seq_q, 128)
    head_dim_rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    buffers = _copy_bytes(grad_out.transpose(1, 2)) + _copy_bytes(out.transpose(1, 2))
    buffers.append(_bytes(batch, heads, seq_q_rounded, dtype=torch.float32))  # softmax_d
    buffers.append(_bytes(batch, seq_q_rounded, heads, head_dim_rounded, dtype=torch.float32))  # dq_accum
    if kv_heads != heads:  # dk_expanded, dv_expanded
        buffers += 2 * [_bytes(batch, seq_k, heads, head_dim, dtype=query.dtype)]
    return buffers


def _efficient_backward(grad_out, query, value) -> list[int]:
    """attention_backward.cu _efficient_attention_backward; tensors (B, M, H, K) here."""
    batch, seq_q, heads, head_dim = query.shape
    buffers = _copy_bytes(grad_out)
    if query.dtype in _HALF:  # the kernel computes delta; dQ accumulates in an fp32 workspace
        buffers.append(_bytes(batch, heads, seq_q, dtype=torch.float32))
        column_tile = 64 if head_dim <= 64 else 128
        workspace = (batch, heads, _round_up(seq_q, 64), _round_up(head_dim, column_tile))
        return [*buffers, _bytes(*workspace, dtype=torch.float32)]
    # fp32: delta = (grad_out * out).sum(-1), a (B, M, H, Kv) temporary, then (B, M, H)
    product = _bytes(batch, seq_q, heads, value.shape[-1], dtype=torch.float32)
    return [*buffers, product, *2 * [_bytes(batch, seq_q, heads, dtype=torch.float32)]]


def _efficient_forward(query, value) -> list[int]:
    """attention.cu _efficient_attention_forward: fp32 output accumulator when half-precision
    kernels iterate over a value dim > 128. Tensors (B, M, H, K) here."""
    if query.dtype not in _HALF or value.shape[-1] <= 128:
        return []
    batch, seq_q, heads, _ = query.shape
    return [_bytes(batch, seq_q, heads, value.shape[-1], dtype=torch.float32)]


def hidden_buffers(func, args) -> list[int]:
    """Sizes in bytes (not rounded) of the buffers the CUDA implementation of `func` allocates and
    frees inside the op; [] for other ops. Each is a block of the caching allocator of its own."""
    if func is aten._scaled_dot_product_flash_attention_backward.default:
        return _flash_backward(args)
    if func is aten._scaled_dot_product_efficient_attention_backward.default:  # (B, H, T, d) arguments
        grad_out, query, _, value = args[:4]
        return _efficient_backward(grad_out.transpose(1, 2), query.transpose(1, 2), value)
    if func is aten._efficient_attention_backward.default:  # (B, T, H, d) arguments
        grad_out, query, _, value = args[:4]
        return _efficient_backward(grad_out, query, value)
    if func is aten._scaled_dot_product_efficient_attention.default:
        return _efficient_forward(args[0].transpose(1, 2), args[2])
    if func is aten._efficient_attention_forward.default:
        return _efficient_forward(args[0], args[2])
    return []


EFFICIENT_BACKWARD = aten._efficient_attention_backward.default
_EFFICIENT_BACKWARD_OUT = 5  # the schema's `out` argument, after grad_out, query, key, value, bias


def _meta_knows_out() -> bool:
    """Whether torch's meta function for _efficient_attention_backward takes the schema's `out`."""
    from torch._meta_registrations import meta__efficient_attention_backward

    return "out" in inspect.signature(meta__efficient_attention_backward).parameters


def efficient_backward_on_fake(args, kwargs):
    """aten::_efficient_attention_backward on fake tensors, or None where torch's own meta function
    serves. Some torch versions register a meta function without the schema's `out` and
    `window_size` arguments, so the fake mode fails on it ("got multiple values for argument
    'scale'"): the autograd of a fp32 lower-right causal chunk calls it on a GPU. Here its
    arguments are passed as that function reads them; it allocates dQ, dK, dV and dBias."""
    from torch._meta_registrations import meta__efficient_attention_backward

    if _META_KNOWS_OUT:
        return None
    positional = (*args[:_EFFICIENT_BACKWARD_OUT], *args[_EFFICIENT_BACKWARD_OUT + 1 :])
    known = {"scale", "num_splits_key", "shared_storage_dqdkdv"}
    return meta__efficient_attention_backward(*positional, **{k: v for k, v in kwargs.items() if k in known})


_META_KNOWS_OUT = _meta_knows_out()


def hidden_bytes(func, args, granularity: int = 512) -> int:
    """The bytes of hidden_buffers(func, args), each rounded up to `granularity` as the caching
    allocator rounds."""
    return sum(_round_up(n, granularity) for n in hidden_buffers(func, args))
