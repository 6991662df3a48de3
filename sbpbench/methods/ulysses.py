"""ALST on several GPUs (Arctic Long Sequence Training, arXiv 2506.13996) as ArcticTraining's SFT
trainer runs it, on DeepSpeed's own parts (`deepspeed.runtime.sequence_parallel.ulysses_sp`):

- attention: `UlyssesSPAttentionHF.register_with_transformers` wraps the model's SDPA attention with
  Ulysses' all-to-alls: each of P ranks holds T/P positions and attends on H/P heads of all T. It
  drops attention masks and gathers position_ids, so the causal mask is never built
  (ArcticTraining registers a mask function that returns None for SDPA);
- data: labels shifted over the whole row, then every tensor cut into P equal shares with global
  position_ids, as `UlyssesSPDataLoaderAdapter` cuts a batch (its `shift_labels`);
- MLP: DeepSpeed's `TiledMLP` in ceil(T/P / hidden) tiles, the count agreed by an all-reduce max
  (ArcticTraining's `tiled_mlp_forward_common`);
- loss: DeepSpeed's `TiledFusedLogitsLoss`, shards of about 1 GiB of fp32 logits each, the
  cross-entropy summed and normalised by the counted tokens of the whole sequence (`SFTTrainer.loss`);
- transformers' gradient checkpointing of every decoder layer, the checkpoints in host memory with
  offload_checkpoints (ArcticTraining's `activation_checkpoint_cpu_offload`, on in the ALST recipe).

Where it differs, and why:
- what DeepSpeed and ArcticTraining patch process-wide (the attention and mask functions, the MLP
  class's forward) is installed for the step only, the MLP's on the instance, and the attention
  modules' num_key_value_groups (DeepSpeed resets it where P exceeds the key/value heads) restored:
  the model and transformers are left as found. TiledMLP and TiledFusedLogitsLoss get no
  compute_params: DeepSpeed uses them to hold back ZeRO's reduction, which FSDP2 does not have;
- the root FSDP2 unit (embedding, final norm, lm_head) is gathered by the root's forward, so the
  step calls the whole model with logits_to_keep=1 and takes the decoder's output from a hook
  (ArcticTraining calls model.model, whose parameters ZeRO-3 gathers per module); the one position's
  (B, 1, V) logits are dropped;
- the loss is normalised inside the tiled loss's shard function, by the whole sequence's counted
  tokens (one all-reduce of the counts first), and the tiled loss is the step's last operation.
  ArcticTraining divides its output afterwards and weights the ranks' losses by an all-gather; but
  TiledFusedLogitsLoss runs its parameters' backward inside its forward with an incoming gradient
  of 1 and rescales only its input's gradient later, so a scale applied after it never reaches the
  lm_head's gradient (checked on DeepSpeed 0.19.8: 12/5 times too large under a 5/12 scale). The loss
  value and every other gradient are the same either way, and no differentiable collective is left
  (torch's differentiable all-gather, deprecated, fails on gloo in every sequence group but the
  first: its backward scatters from global rank numbers). Each rank's part is scaled by P, as an
  engine that averages over the P ranks of a sequence needs (FSDP2 here; without one the step
  averages the gradients over the group itself), as core/parallel/sequence_step.py does;
- TiledFusedLogitsLoss's backward scales its saved input gradient only `if grads[0] != 1.0`, a
  branch on the incoming gradient's value, which fake tensors (the estimator) do not have; the step
  runs a subclass that multiplies unconditionally: the same product, exact where it is 1;
- a float64 model's cross-entropy is computed in float64 (transformers' loss function upcasts to
  float32; methods/hf_baseline.py does the same for bp), so a float64 check is exact.
The benchmark's right-padded rows run unmasked, as Ulysses runs every row: pads come after all real
tokens and predict nothing, so the gradient is the masked one's. SFT only, as ArcticTraining's SFT
trainer; no sliding-window attention (Ulysses drops the mask that would carry the window).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from contextlib import ExitStack, contextmanager
from functools import partial

import torch
import torch.nn.functional as F

from ..core import IGNORE_INDEX, SFT
from ..core.internal import loss_dtype, unwrap_model
from ..data import Batch
from .hf_baseline import hf_gradient_checkpointing
from .offload import offloaded_checkpointing
from .unsupported import MethodUnsupported

LOGITS_SHARD_BYTES = 2**30  # ArcticTraining: about 1 GiB of fp32 logits per loss shard
ATTENTION = "sdpa"  # the attention DeepSpeed's wrapper calls (the benchmark builds every model with it)
# DeepSpeed's groups exist once per process group: what registration made, by shape, and the default
# process group it was made in (a newer one, as the memory simulator makes per step, registers afresh)
_REGISTERED: dict[tuple, tuple] = {}
_REGISTERED_IN: list = []


def deepspeed_missing() -> str | None:
    """Why ulysses cannot run here (DeepSpeed not installed), or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return "ulysses needs DeepSpeed, an optional extra: pip install -e '.[deepspeed]'"
    return None


def ulysses(model, batch: Batch, settings, sequence_parallel=None) -> torch.Tensor:
    """One SFT step of ALST's recipe on this rank's share of the batch (module docstring)."""
    ulysses_sp = _deepspeed_parts(model, batch, sequence_parallel)
    world = sequence_parallel.world
    ids, positions, targets = local_shard(batch, sequence_parallel.rank, world)
    checkpointing = offloaded_checkpointing if settings.offload_checkpoints else hf_gradient_checkpointing
    with ExitStack() as stack:
        group = stack.enter_context(ulysses_attention(model, ids.shape[0], world))
        stack.enter_context(tiled_mlps(model, ulysses_sp.TiledMLP))
        stack.enter_context(checkpointing(model))
        hidden = decoder_output(model, ids, positions)  # (B, T/P, d)
        part = scaled_loss(unwrap_model(model), hidden, targets, group, world, branch_free(ulysses_sp))
        if not _sharded(model):  # no engine to average over the group: do it here
            stack.enter_context(_averaged_gradients(model, group, world))
        part.backward()
    loss = part.detach().clone()
    torch.distributed.all_reduce(loss, group=group)
    return loss / world  # the whole sequence's mean token loss


def _deepspeed_parts(model, batch: Batch, sequence_parallel):
    """DeepSpeed's ulysses_sp module, after the checks that make this step run (MethodUnsupported)."""
    missing = deepspeed_missing()
    if missing:
        raise MethodUnsupported(missing)
    if sequence_parallel is None:
        raise MethodUnsupported("ulysses runs only on ranks sharing each sequence: give --sp 2 or more")
    if not isinstance(batch.objective(), SFT):
        raise MethodUnsupported(f"ulysses runs SFT only, as ArcticTraining's SFT trainer; not {batch.objective().name}")
    config = unwrap_model(model).config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()) or (
        getattr(config, "layer_types", None) is None and getattr(config, "sliding_window", None) is not None
    ):
        raise MethodUnsupported("ulysses drops attention masks (DeepSpeed's UlyssesSPAttentionHF): no sliding windows")
    if config._attn_implementation != ATTENTION:
        raise MethodUnsupported(f"ulysses wraps {ATTENTION} attention; this model runs {config._attn_implementation}")
    on_cpu = next(model.parameters()).device.type == "cpu"
    if on_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read once, when deepspeed is first imported
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    if on_cpu != (get_accelerator().device_name() == "cpu"):
        raise MethodUnsupported(
            f"DeepSpeed chose the {get_accelerator().device_name()} accelerator for a model on "
            f"{'cpu' if on_cpu else 'a GPU'}: set DS_ACCELERATOR before the run"
        )
    return ulysses_sp


def local_shard(batch: Batch, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (B, T/P) token ids, global position ids and shifted labels, cut as
    UlyssesSPDataLoaderAdapter cuts: labels shifted over the whole row (-100 after the last), then
    every tensor cut into P equal shares, rank r holding [r T/P, (r + 1) T/P)."""
    ids = batch.input_ids
    rows, seq_len = ids.shape  # (B, T)
    assert seq_len % world == 0, f"T={seq_len} not a multiple of {world}: config/run.py refuses it"
    positions = torch.arange(seq_len, device=ids.device).expand(rows, seq_len)
    shift_labels = F.pad(batch.labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # (B, T): what position t predicts
    share = seq_len // world
    cut = slice(rank * share, (rank + 1) * share)
    return ids[:, cut].contiguous(), positions[:, cut].contiguous(), shift_labels[:, cut].contiguous()


def _registered(model, batch_size: int, world: int):
    """(DeepSpeed's attention wrapper, its sequence-parallel state), from `register_with_transformers`
    once per process (its groups can be made once), with the attention function it replaced put back."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = unwrap_model(model).config
    key = (world, batch_size, config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers)
    if _REGISTERED_IN and _REGISTERED_IN[0] is not torch.distributed.group.WORLD:
        _forget_registration()  # its groups belong to a process group that is gone
    if key not in _REGISTERED:
        if _REGISTERED:
            raise RuntimeError(f"ulysses registered {next(iter(_REGISTERED))} in this process; one shape per process")
        _init_deepspeed_comm(next(model.parameters()).device.type)
        with _replaced(ALL_ATTENTION_FUNCTIONS, ATTENTION, ALL_ATTENTION_FUNCTIONS[ATTENTION]):
            mpu = UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=model,
                core_attn_implementation=ATTENTION,
                sequence_parallel_size=world,
                micro_batch_size=batch_size,
                seq_length_is_variable=True,
            )
            _REGISTERED[key] = (ALL_ATTENTION_FUNCTIONS[ATTENTION], mpu)
            _REGISTERED_IN[:] = [torch.distributed.group.WORLD]
    return _REGISTERED[key]


def _forget_registration() -> None:
    """Release DeepSpeed's sequence-parallel groups and this process's registration."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp._release_sequence_parallel_groups()
    _REGISTERED.clear()
    _REGISTERED_IN.clear()


def _init_deepspeed_comm(device_type: str) -> None:
    """deepspeed.comm over the process group already made (the ranks' gloo or nccl). On a CPU its
    accelerator would JIT-compile a shared-memory all-reduce kernel for inference first (a minute of
    g++ on 2 cores) that Ulysses never calls: that build is skipped for this call."""
    import deepspeed
    import deepspeed.comm as ds_comm

    if ds_comm.is_initialized():
        return
    backend = torch.distributed.get_backend()
    if device_type != "cpu":
        deepspeed.init_distributed(dist_backend=backend)
        return
    comm_torch = sys.modules["deepspeed.comm.torch"]
    build = comm_torch.build_shm_op
    comm_torch.build_shm_op = lambda: None
    try:
        deepspeed.init_distributed(dist_backend=backend)
    finally:
        comm_torch.build_shm_op = build


@contextmanager
def _replaced(interface, key: str, value):
    """transformers' attention (or mask) function `key` is `value` inside, as found after."""
    before = interface[key]
    interface[key] = value  # the shared instance's local mapping, over the global registry
    try:
        yield
    finally:
        del interface[key]
        if interface[key] is not before:  # it had a local one of its own
            interface[key] = before


def _no_mask(*args, **kwargs) -> None:
    return None


@contextmanager
def ulysses_attention(model, batch_size: int, world: int):
    """DeepSpeed's Ulysses attention in place of SDPA and no causal mask built, for the block; yields
    DeepSpeed's sequence-parallel group. num_key_value_groups restored after."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    wrapper, mpu = _registered(model, batch_size, world)
    groups = {m: m.num_key_value_groups for m in model.modules() if hasattr(m, "num_key_value_groups")}
    try:
        with (
            _replaced(ALL_ATTENTION_FUNCTIONS, ATTENTION, wrapper),
            _replaced(ALL_MASK_ATTENTION_FUNCTIONS, ATTENTION, _no_mask),
        ):
            yield mpu.get_sequence_parallel_group()
    finally:
        for module, count in groups.items():
            module.num_key_value_groups = count


def _tiled_mlp_forward(mlp, tiled_mlp, x: torch.Tensor) -> torch.Tensor:
    """ArcticTraining's tiled_mlp_forward_common: ceil(T / hidden) tiles, the most any rank needs (a
    rank running fewer would leave the others waiting in a collective), through DeepSpeed's TiledMLP
    with the class's own forward."""
    seq_len, hidden = x.shape[-2:]
    shards = torch.tensor(math.ceil(seq_len / hidden), device=x.device)
    torch.distributed.all_reduce(shards, op=torch.distributed.ReduceOp.MAX)
    return tiled_mlp.apply(type(mlp).forward, mlp, x, int(shards.item()), [])


@contextmanager
def tiled_mlps(model, tiled_mlp):
    """Every decoder layer's MLP through TiledMLP for the block: an instance `forward` over the
    class's (ArcticTraining sets the class's), removed on exit."""
    mlps = [layer.mlp for layer in unwrap_model(model).get_decoder().layers]
    for mlp in mlps:
        assert "forward" not in vars(mlp), f"{type(mlp).__name__} already has an instance forward"
        mlp.forward = partial(_tiled_mlp_forward, mlp, tiled_mlp)
    try:
        yield
    finally:
        for mlp in mlps:
            del mlp.forward


def decoder_output(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden state (B, T/P, d) from the whole model's forward (which gathers
    FSDP2's root unit), its lm_head run on one position only."""
    captured = []
    decoder = unwrap_model(model).get_decoder()
    handle = decoder.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        model(input_ids=ids, position_ids=positions, logits_to_keep=1, use_cache=False)
    finally:
        handle.remove()
    return captured[0]


def _shard_loss(causal_lm, hidden: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """ArcticTraining's fused_logits_loss_fn: one shard's summed cross-entropy, (N, d) -> scalar,
    times `scale` (module docstring)."""
    logits = causal_lm.lm_head(hidden)  # (N, V): one shard's logits live here only
    counted = targets != IGNORE_INDEX
    if not bool(counted.any()):  # a zero with the graph, as cross-entropy of no token is NaN
        return (logits.sum() * 0.0).to(loss_dtype(logits.dtype))
    if logits.dtype == torch.float64:  # transformers' loss function would round to float32
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") * scale
    vocab = causal_lm.config.vocab_size
    mean = causal_lm.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=targets)
    return mean * (counted.sum() * scale)


def scaled_loss(causal_lm, hidden: torch.Tensor, targets: torch.Tensor, group, world: int, tiled_loss) -> torch.Tensor:
    """P times this rank's share of the whole sequence's mean token loss: its shards' summed
    cross-entropy (TiledFusedLogitsLoss, each shard's backward inside its forward) over the counted
    tokens of every rank (module docstring)."""
    rows, length = targets.shape
    logits_bytes = rows * length * causal_lm.config.vocab_size * 4  # fp32, as ArcticTraining sizes it
    shards = math.ceil(logits_bytes / LOGITS_SHARD_BYTES)
    counted = (targets != IGNORE_INDEX).sum()
    torch.distributed.all_reduce(counted, group=group)
    shard_loss = partial(_shard_loss, scale=world / max(int(counted), 1))
    return tiled_loss.apply(shard_loss, causal_lm, hidden, targets, None, shards, [], "sum")


_BRANCH_FREE: dict[type, type] = {}  # DeepSpeed's TiledFusedLogitsLoss -> its branch-free subclass


def branch_free(ulysses_sp) -> type:
    """DeepSpeed's TiledFusedLogitsLoss with a backward that scales the gradient its forward saved by
    the incoming one always, where DeepSpeed's does `if grads[0] != 1.0` (module docstring): the same
    gradients, and no branch on a value. Its other outputs (None, one per other input) are DeepSpeed's."""
    tiled_loss = ulysses_sp.TiledFusedLogitsLoss
    if tiled_loss not in _BRANCH_FREE:

        def backward(ctx, *grads):
            (x_grad,) = ctx.saved_tensors
            x_grad.mul_(grads[0])  # in place, as DeepSpeed's `x_grad *= grads[0]`; x * 1 is x exactly
            return (None, None, x_grad, None, None, None, None, None, None)

        _BRANCH_FREE[tiled_loss] = type("BranchFreeTiledLoss", (tiled_loss,), {"backward": staticmethod(backward)})
    return _BRANCH_FREE[tiled_loss]


def _sharded(model) -> bool:
    """Whether an FSDP2 engine holds the model (it averages the gradients over every rank)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


@contextmanager
def _averaged_gradients(model, group, world: int):
    """One process per rank without an engine: after the block, each trainable gradient averaged
    over the group, as an engine would (a rank without one sends zeros)."""
    yield
    for param in (p for p in model.parameters() if p.requires_grad):
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        torch.distributed.all_reduce(param.grad, group=group)
        param.grad /= world
