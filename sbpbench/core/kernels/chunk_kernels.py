"""The kernels that can run one offset-causal chunk of StreamBP's attention, besides torch's SDPA.

A chunk call is queries at absolute positions [query_start, query_start + c) over keys at
[key_start, query_start + c), keys ending where the queries end (causal diagonal at the lower
right), optionally cut by a sliding window (HF: query q sees key k iff q - k < window). Left
padding and packed documents never reach a kernel as a mask: the plan (layout.py) cuts them into
such calls. The reference is today's path, SDPA with a lower-right causal bias (attention.py,
`LOWER_RIGHT`); the candidates here must give its result to rounding:

    split  the prefix (no mask) and the diagonal block (square causal) on cuDNN's fused kernels,
           merged by log-sum-exp (split_attention.py); the CPU flash kernel off a GPU
    flex   torch's FlexAttention with a block mask (compiled on a GPU)
    fa3    FlashAttention-3 (`flash_attn_interface`, built from flash-attention's hopper/), sm90
    fa4    FlashAttention-4 (`flash_attn.cute`, the flash-attn-4 package), sm90 / sm100

Each says why it cannot run, on a device (`unavailable`: not installed, not this GPU) or for one
call (`unsupported`: dtype, head dim, a window it cannot express); the reference runs it then.
An optional package that fails to import, for any reason, is a kernel this device lacks.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .split_attention import CpuFlashOps, CudnnOps, split_attention

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ChunkCall:
    """query (B, H, c, hd) at [query_start, query_start + c); key/value (B, h_kv, n, hd) at
    [key_start, query_start + c), n > c for a candidate (a square call only reaches the reference).
    window: the sliding window where it hides some of these keys from some query, else None."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_start: int
    key_start: int
    scale: float | None
    window: int | None = None

    @property
    def num_queries(self) -> int:
        return self.query.shape[2]

    @property
    def num_keys(self) -> int:
        return self.key.shape[2]

    @property
    def gqa(self) -> bool:
        return self.query.shape[1] != self.key.shape[1]

    def with_tensors(self, query, key, value) -> ChunkCall:
        return ChunkCall(query, key, value, self.query_start, self.key_start, self.scale, self.window)


class ChunkKernel:
    """One candidate: a name, why it cannot run, and how it runs a call."""

    name = ""

    def unavailable(self, device: torch.device) -> str | None:
        """Why this kernel cannot run on the device at all; None when it can."""
        return None

    def unsupported(self, call: ChunkCall) -> str | None:
        """Why it cannot run this call; None when it can."""
        return None

    def run(self, call: ChunkCall) -> torch.Tensor:
        """-> (B, H, c, hd_v), differentiable in query, key and value."""
        raise NotImplementedError


def cudnn_refuses(call: ChunkCall, can_use=None) -> str | None:
    """Why cuDNN's fused attention cannot run one of the split's halves, by torch's own check
    (`can_use_cudnn_attention`: dtype, head dim, key length 1, GPU generation); None if it can."""
    can_use = torch.backends.cuda.can_use_cudnn_attention if can_use is None else can_use
    if call.query.dtype not in _LOW_PRECISION:
        return "cuDNN attention takes bf16/fp16"
    prefix = call.num_keys - call.num_queries
    for keys, causal in ((slice(0, prefix), False), (slice(prefix, call.num_keys), True)):
        params = torch.backends.cuda.SDPAParams(
            call.query, call.key[:, :, keys], call.value[:, :, keys], None, 0.0, causal, call.gqa
        )
        if not can_use(params, False):
            return f"cuDNN attention refuses the {'diagonal' if causal else 'prefix'} half of this shape"
    return None


class SplitKernel(ChunkKernel):
    """Prefix + diagonal block merged by log-sum-exp: cuDNN on a GPU, the CPU flash kernel off one."""

    name = "split"

    def __init__(self, cuda_ops=None, cpu_ops=None):
        self.cuda_ops = cuda_ops if cuda_ops is not None else CudnnOps()
        self.cpu_ops = cpu_ops if cpu_ops is not None else CpuFlashOps()

    def unavailable(self, device):
        if device.type == "cuda" and not torch.backends.cuda.cudnn_sdp_enabled():
            return "cuDNN attention is disabled (torch.backends.cuda.enable_cudnn_sdp or an sdpa_kernel block)"
        if device.type not in ("cuda", "cpu"):
            return f"no fused attention kernel with log-sum-exp on {device.type}"
        return None

    def unsupported(self, call):
        if call.window is not None:
            return "a sliding window cuts this chunk's prefix, which would need a mask"
        return cudnn_refuses(call) if call.query.device.type == "cuda" else None

    def run(self, call):
        ops = self.cuda_ops if call.query.device.type == "cuda" else self.cpu_ops
        return split_attention(call.query, call.key, call.value, scale=call.scale, ops=ops)


def offset_causal_mask_mod(offset: int | torch.Tensor, window: int | None):
    """FlexAttention's mask_mod for a chunk: query row i (absolute query_start + i) sees key column j
    (absolute key_start + j) iff j <= i + offset, offset = query_start - key_start = n - c, and,
    with a window, i + offset - j < window."""

    def causal(batch, head, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    def windowed(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & (q_idx + offset - kv_idx < window)

    return causal if window is None else windowed


def offset_causal_block_mask(
    num_queries: int, num_keys: int, window: int | None, device: torch.device, block_size: int = 128
):
    """FlexAttention's BlockMask for a chunk, built from the block pattern itself, without the
    (c, n) boolean mask `create_block_mask` evaluates (4 GiB at c = 8k, n = 512k). Per tile of
    block_size rows and keys: full when every row sees every key (the kernel skips mask_mod there),
    partial when some row sees some key, skipped otherwise; tiles cut by the sequence ends are
    partial, as create_block_mask makes them (tests compare the two)."""
    from torch.nn.attention.flex_attention import BlockMask

    offset = num_keys - num_queries
    q_first = torch.arange(0, num_queries, block_size, device=device)  # first row of each query tile
    q_last = torch.clamp(q_first + block_size, max=num_queries) - 1
    k_first = torch.arange(0, num_keys, block_size, device=device)
    k_last = torch.clamp(k_first + block_size, max=num_keys) - 1
    # row r sees keys [r + offset - window + 1, r + offset] (from 0 without a window)
    some = k_first[None, :] <= (q_last + offset)[:, None]
    every = k_last[None, :] <= (q_first + offset)[:, None]
    if window is not None:
        some &= k_last[None, :] >= (q_first + offset - window + 1)[:, None]
        every &= k_first[None, :] >= (q_last + offset - window + 1)[:, None]
    whole = (q_first + block_size <= num_queries)[:, None] & (k_first + block_size <= num_keys)[None, :]
    full = every & whole
    partial = some & ~full

    def listed(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q tiles, KV tiles) bool -> counts (1, 1, Q), indices (1, 1, Q, KV) listing those first."""
        counts = tiles.sum(dim=-1, dtype=torch.int32)
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    mask_mod = offset_causal_mask_mod(torch.tensor(offset, device=device), window)
    return BlockMask.from_kv_blocks(
        *listed(partial), *listed(full), BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(num_queries, num_keys)
    )


class FlexKernel(ChunkKernel):
    """torch.nn.attention.flex_attention with a block mask per (c, n, window). On a GPU the call is
    compiled once with dynamic shapes (a chunk's key count changes every chunk); the offset is a
    tensor, so a new offset is not a new graph. The block masks of the last shapes seen are kept:
    a chunk's queries share them when split by the layout, and building one is a few small ops."""

    name = "flex"
    # a mask's tile lists are int32 (c / 128) x (n / 128), x4 with the transposed ones: 4 MiB at 8k x 512k
    _MASKS_KEPT = 16

    def __init__(self, block_size: int = 128):
        self.block_size = block_size  # FlexAttention's default tile
        self._masks: OrderedDict[tuple, object] = OrderedDict()
        self._compiled = None

    def unavailable(self, device):
        if device.type == "cpu":
            return "FlexAttention has no CPU backward in this torch"
        if device.type == "cuda":
            from torch.utils._triton import has_triton

            if not has_triton():
                return "FlexAttention needs Triton on a GPU"
        return None

    def unsupported(self, call):
        if call.query.dtype == torch.float64 and call.query.device.type == "cuda":
            # the compiled (Triton) kernel accumulates in fp32: it cannot meet fp64's tolerance and
            # would be compiled only to be rejected; the CPU's eager implementation computes in fp64
            return "FlexAttention's GPU kernel accumulates in fp32, short of fp64 rounding"
        return None

    def _block_mask(self, call: ChunkCall):
        device = call.query.device
        key = (call.num_queries, call.num_keys, call.window, str(device))
        if key not in self._masks:
            self._masks[key] = offset_causal_block_mask(
                call.num_queries, call.num_keys, call.window, device, self.block_size
            )
            if len(self._masks) > self._MASKS_KEPT:
                self._masks.popitem(last=False)
        self._masks.move_to_end(key)
        return self._masks[key]

    def _attention(self, device: torch.device):
        from torch.nn.attention.flex_attention import flex_attention

        if device.type != "cuda":
            return flex_attention  # eager: the dense reference implementation
        if self._compiled is None:
            self._compiled = torch.compile(flex_attention, dynamic=True)
        return self._compiled

    def run(self, call):
        attend = self._attention(call.query.device)
        return attend(
            call.query, call.key, call.value, block_mask=self._block_mask(call), scale=call.scale, enable_gqa=call.gqa
        )


class _FlashAttnPackage(ChunkKernel):
    """A FlashAttention package's flash_attn_func: (B, S, H, hd) tensors, causal aligned to the lower
    right when seqlen_q < seqlen_k, GQA from fewer key heads, a window as (left, right) keys around
    the diagonal. Imported on first use; `module` may be given (tests pass a stand-in)."""

    module_name = ""
    install = ""
    compute_capabilities: tuple[int, ...] = ()
    no_window: tuple = ()  # the package's spelling of an unbounded window

    def __init__(self, module=None):
        self._module = module
        self._missing: str | None = None  # why its import failed ("" when it loaded): tried once

    def module(self):
        if self._module is None:
            self._module = importlib.import_module(self.module_name)
        return self._module

    def unavailable(self, device):
        if device.type != "cuda":
            return f"{self.name} runs on CUDA GPUs only"
        major, _ = torch.cuda.get_device_capability(device)
        if major not in self.compute_capabilities:
            return f"{self.name} needs an {' or '.join(f'sm{c}x' for c in self.compute_capabilities)} GPU"
        if self._missing is None:
            try:
                self.module()
                self._missing = ""
            except Exception as error:  # a built extension fails in many ways: a missing symbol, CUDA, a version check
                self._missing = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
        if self._missing:
            return f"{self.name} is not installed or does not load ({self.install}; {self._missing})"
        return None

    def unsupported(self, call):
        head_dim = call.query.shape[-1]
        if call.query.dtype not in _LOW_PRECISION:
            return f"{self.name} takes bf16/fp16"
        if head_dim % 8 or head_dim > 256 or call.value.shape[-1] != head_dim:
            return f"{self.name} takes head dims that are multiples of 8, up to 256, equal for q/k/v"
        return None

    def run(self, call):
        window = self.no_window if call.window is None else (call.window - 1, 0)  # q - k < window
        out = self.module().flash_attn_func(
            call.query.transpose(1, 2),  # (B, c, H, hd), a view
            call.key.transpose(1, 2),
            call.value.transpose(1, 2),
            softmax_scale=call.scale,
            causal=True,
            window_size=window,
        )
        if isinstance(out, tuple):  # (out, lse) in some releases
            out = out[0]
        return out.transpose(1, 2)


class FlashAttention3(_FlashAttnPackage):
    name = "fa3"
    module_name = "flash_attn_interface"
    install = "build flash-attention's hopper/ directory: cd hopper && pip install ."
    compute_capabilities = (9,)
    no_window = (-1, -1)


class FlashAttention4(_FlashAttnPackage):
    name = "fa4"
    module_name = "flash_attn.cute"
    install = 'pip install "sbpbench[flash-attn-4]"'
    compute_capabilities = (9, 10)
    no_window = (None, None)


def default_kernels() -> dict[str, ChunkKernel]:
    """The candidates, by name, in the order they are tried."""
    kernels = (SplitKernel(), FlexKernel(), FlashAttention3(), FlashAttention4())
    return {kernel.name: kernel for kernel in kernels}
