"""On a CUDA GPU: each candidate kernel for a chunk's attention (core/kernels/chunk_kernels.py: split, flex,
fa3, fa4) gives the lower-right reference's output and gradients, in bf16. A kernel that cannot run
here is skipped with its own reason (not installed, not this GPU). All but flex are quick: its
compile takes tens of seconds, and the selftest's attention benchmark judges it on a step's calls.

bf16 cannot be judged by a fixed tolerance, so the truth is an fp32 run of the reference on the same
bf16 values. A candidate's error against it (out, dQ, dK, dV, relative Frobenius norms) may be at most
ERROR_FACTOR times the bf16 reference's own. The data make that bound sharp: each query scores its
own key (the diagonal) well above the others, and an output averages many random values, so a mask
shifted by one key moves every output far past rounding. The test checks that such a mask fails.

The shape is Qwen3-8B's heads (32 query, 8 key/value, dim 128) at lengths off FlexAttention's
128-position tiles, so partial tiles run too. One kernel object per candidate for the module:
FlexAttention compiles once (tens of seconds on a GPU, bf16 only).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sbpbench.core.attention import lower_right_attention
from sbpbench.core.kernels.chunk_kernels import ChunkCall, default_kernels
from sbpbench.runner.kernel_bench import relative_error

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # test_gpu_tier.py runs these tests on the CPU (the split only)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B
QUERIES, KEYS = 300, 1300  # a chunk of 300 queries over a prefix of 1000 keys and its own 300
ERROR_FACTOR = 4.0  # "a few times" the reference's own bf16 error
ERROR_FLOOR = 2.0**-9  # bf16's unit roundoff: a reference error below it (a lucky draw) is not a bound
OWN_KEY_WEIGHT = 1.5  # the share of its group's mean query added to each query's own key
KERNELS = default_kernels()  # one object each for the module: FlexAttention compiles once
NAMES = ("out", "dQ", "dK", "dV")


def _call(dtype: torch.dtype) -> tuple[ChunkCall, torch.Tensor]:
    """q (1, H, c, hd) at [n - c, n); k, v (1, h_kv, n, hd) at [0, n); the output gradient. The key
    at each query's own position gets OWN_KEY_WEIGHT x the mean of the queries of its group, which
    lifts that query's score for it about 4 standard deviations above the others'."""
    generator = torch.Generator(DEVICE).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=DEVICE, dtype=torch.float32)

    query = rand(1, HEADS, QUERIES, HEAD_DIM)
    key, value = rand(1, KV_HEADS, KEYS, HEAD_DIM), rand(1, KV_HEADS, KEYS, HEAD_DIM)
    group_mean = query.view(1, KV_HEADS, HEADS // KV_HEADS, QUERIES, HEAD_DIM).mean(dim=2)  # (1, h_kv, c, hd)
    key[:, :, KEYS - QUERIES :] += OWN_KEY_WEIGHT * group_mean
    grad_out = rand(1, HEADS, QUERIES, HEAD_DIM)
    tensors = [t.to(torch.bfloat16).to(dtype) for t in (query, key, value, grad_out)]  # bf16 values
    return ChunkCall(*tensors[:3], query_start=KEYS - QUERIES, key_start=0, scale=None), tensors[3]


def _outputs(run, call: ChunkCall, grad_out: torch.Tensor) -> list[torch.Tensor]:
    """out, dQ, dK, dV of one run on leaves made from the call's tensors."""
    leaves = [t.detach().clone().requires_grad_() for t in (call.query, call.key, call.value)]
    with torch.enable_grad():
        out = run(call.with_tensors(*leaves))
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def _shifted_by_one(call: ChunkCall) -> torch.Tensor:
    """The reference's mistake to catch: each query sees the keys before its own, not its own."""
    offset = call.num_keys - call.num_queries
    rows = torch.arange(call.num_queries, device=call.query.device)[:, None]
    columns = torch.arange(call.num_keys, device=call.query.device)[None, :]
    mask = columns < rows + offset  # (c, n)
    return F.scaled_dot_product_attention(call.query, call.key, call.value, attn_mask=mask, enable_gqa=call.gqa)


@pytest.fixture(scope="module")
def judged():
    """(bf16 call, its output gradient, the fp32 truth, each output's bound, the bf16 reference's
    own errors), computed once."""
    call, grad_out = _call(torch.bfloat16)
    truth_call, truth_grad = _call(torch.float32)
    truth = _outputs(lower_right_attention, truth_call, truth_grad)
    own = [relative_error(o, t) for o, t in zip(_outputs(lower_right_attention, call, grad_out), truth)]
    bounds = [ERROR_FACTOR * max(error, ERROR_FLOOR) for error in own]
    return call, grad_out, truth, bounds, own


def _describe(errors, bounds) -> str:
    return ", ".join(f"{n} {e:.2e} (bound {b:.2e})" for n, e, b in zip(NAMES, errors, bounds))


@pytest.mark.quick
def test_a_mask_shifted_by_one_key_fails_the_bound(judged):
    """The bound has teeth: the reference with each query's own key hidden misses it on the output
    and on dQ, dK and dV."""
    call, grad_out, truth, bounds, own = judged
    errors = [relative_error(o, t) for o, t in zip(_outputs(_shifted_by_one, call, grad_out), truth)]
    print(f"reference's own bf16 error: {_describe(own, bounds)}; shifted mask: {_describe(errors, bounds)}")
    assert all(e > b for e, b in zip(errors, bounds)), _describe(errors, bounds)


# flex compiles for tens of seconds: not quick (`sbp selftest` runs the attention benchmark, which
# judges every kernel on a step's own calls)
QUICK = [pytest.param(name, marks=[] if name == "flex" else pytest.mark.quick) for name in KERNELS]


@pytest.mark.parametrize("name", QUICK)
def test_each_attention_kernel_matches_the_reference(judged, name):
    """The candidate's out, dQ, dK and dV in bf16 are within ERROR_FACTOR x the bf16 reference's own
    error of the fp32 truth; a candidate this machine cannot run is skipped with its reason."""
    call, grad_out, truth, bounds, _ = judged
    kernel = KERNELS[name]
    reason = kernel.unavailable(call.query.device) or kernel.unsupported(call)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    errors = [relative_error(o, t) for o, t in zip(_outputs(kernel.run, call, grad_out), truth)]
    print(f"{name}: {_describe(errors, bounds)}")
    assert all(e <= b for e, b in zip(errors, bounds)), f"{name}: {_describe(errors, bounds)}"
