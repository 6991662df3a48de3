"""The StreamBP trainers (sbpbench.integrations) train as the stock ones: transformers' Trainer and
TRL's SFT, DPO and GRPO trainers, 3 optimizer steps with gradient accumulation 2 from the same seed
and the same config (only the class name changes), give the same parameter updates to 1e-10
relative and log the same values (loss, gradient norm, TRL's metrics) to 1e-9.

CPU, fp64, tiny models, a word-level tokenizer built here (no network). Plain SGD without gradient
clipping, so an update is the learning rate times the gradient: a wrong loss scale shows (Adam's
first steps would hide it). Both runs get the same fp64 loss math: transformers' causal-LM loss and
TRL's fused LM head compute in fp32 even in an fp64 model, so the tests give the model an fp64
`loss_function` (transformers' documented setter) and an fp64 fused head (a test-only stand-in for
TRL's `add_fused_lm_head`, installed on both runs' models: GRPO's old/reference and DPO's reference
log-probs come from it in both). GRPO generates with the stock trainer's own `model.generate` on
CPU from the same torch seed in both runs.
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import pytest
import torch

from sbpbench.core.labels import shift_labels, sum_cross_entropy
from sbpbench.models import apply_lora

from ..conftest import needs_trl, tiny_model

# Our trainers warn that gradient checkpointing (TRL's default) does nothing for them; the stock
# config is used unchanged here, so the warning is expected (test_gradient_checkpointing_warns).
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient checkpointing has no effect:UserWarning")

VOCAB = 512  # the tiny models' vocabulary: <pad> 0, <eos> 1, words w2 .. w511
STEPS, ACCUMULATION, BATCH = 3, 2, 2
TIMING_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def _texts(count: int, low: int, high: int, seed: int) -> list[str]:
    """count strings of low .. high - 1 random words."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [" ".join(f"w{int(i)}" for i in torch.randint(2, VOCAB, (n,), generator=generator)) for n in lengths]


def _common(tmp_path) -> dict:
    """TrainingArguments shared by every run: SGD, no clipping, a constant rate, sequential batches."""
    return {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "max_steps": STEPS,
        "optim": "sgd",
        "learning_rate": 0.5,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
    }


def _fp64_causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, **kwargs):
    """transformers' ForCausalLMLoss in the logits' dtype (fp64 here) instead of fp32."""
    targets = shift_labels(labels)
    count = (targets != -100).sum() if num_items_in_batch is None else num_items_in_batch
    return sum_cross_entropy(logits, targets) / count


def _fp64_fused_head(model, temperature: float = 1.0) -> None:
    """Stand-in for TRL's add_fused_lm_head: `model(..., labels=..., fused_lm_head=True)` returns
    the per-token fields TRL's trainers read, from the full fp64 logits; otherwise the model's own
    forward."""
    own_forward = type(model).forward

    def forward(self, *args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return own_forward(self, *args, labels=labels, **kwargs)
        kwargs.pop("num_items_in_batch", None)  # TRL's fused loss reads it; the per-token fields do not
        logits = own_forward(self, *args, **kwargs).logits[:, :-1] / temperature  # (B, T - 1, V)
        targets = labels[:, 1:]
        mask = targets != -100
        log_probs = logits.log_softmax(dim=-1)
        zero = torch.zeros((), dtype=logits.dtype)
        return SimpleNamespace(
            log_probs=torch.where(mask, log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0], zero),
            entropy=torch.where(mask, -(log_probs.exp() * log_probs).sum(-1), zero),
            mean_logits=torch.where(mask, logits.mean(-1), zero),
            is_top1=(logits.argmax(-1) == targets) & mask,
            label_mask=mask,
            aux_loss=None,
            loss=None,
        )

    model.forward = types.MethodType(forward, model)


def _train(make_trainer, model, *, temperature: float = 1.0, ref_model=None):
    """Train; return the parameter updates and the log history."""
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = make_trainer(model)
    for m in (trainer.model, ref_model):
        if m is not None:
            causal_lm = m.get_base_model() if hasattr(m, "get_base_model") else m  # under a LoRA wrapper
            causal_lm.loss_function = _fp64_causal_lm_loss
            _fp64_fused_head(causal_lm, temperature)
    torch.manual_seed(1234)  # GRPO samples its completions from torch's global generator
    trainer.train()
    updates = {name: p.detach() - before[name] for name, p in model.named_parameters() if p.requires_grad}
    return updates, trainer.state.log_history


def _assert_same_training(stock, ours):
    (stock_updates, stock_logs), (updates, logs) = stock, ours
    for name, reference in stock_updates.items():
        scale = float(reference.abs().max())
        assert scale > 0, f"{name} did not train"
        error = float((updates[name] - reference).abs().max()) / scale
        assert error <= 1e-10, f"{name}: parameter update differs by {error:.3e} (relative)"
    assert len(logs) == len(stock_logs) == STEPS + 1
    for step, (theirs, mine) in enumerate(zip(stock_logs, logs)):
        mine = {key: value for key, value in mine.items() if not key.startswith("streambp/")}  # what ran: ours only
        assert set(mine) == set(theirs), f"log {step}: keys {set(mine) ^ set(theirs)} differ"
        for key, value in theirs.items():
            if key not in TIMING_KEYS:
                assert mine[key] == pytest.approx(value, rel=1e-9, abs=1e-12), f"log {step}: {key}"


# --- transformers' Trainer -------------------------------------------------------------------


def _token_rows(count: int = 12) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in torch.randint(5, 20, (count,), generator=generator).tolist():
        ids = torch.randint(2, VOCAB, (n,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def _pad_collator(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding: attention_mask 0 and labels -100 on the pads."""
    width = max(len(row["input_ids"]) for row in rows)
    ids = torch.tensor([row["input_ids"] + [0] * (width - len(row["input_ids"])) for row in rows])
    mask = torch.tensor([[1] * len(row["input_ids"]) + [0] * (width - len(row["input_ids"])) for row in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _run_trainer(cls, tmp_path, collator, **kwargs):
    Dataset = pytest.importorskip("datasets", reason="needs datasets: pip install -e '.[trl]'").Dataset
    from transformers import TrainingArguments

    args = TrainingArguments(**_common(tmp_path), train_sampling_strategy="sequential", remove_unused_columns=False)
    dataset = Dataset.from_list(_token_rows())
    make = lambda model: cls(model=model, args=args, train_dataset=dataset, data_collator=collator, **kwargs)
    return _train(make, tiny_model("tiny/qwen3"))


@pytest.mark.parametrize("layout", ["padded", pytest.param("packed", marks=pytest.mark.slow)])
def test_trainer_matches_stock(tmp_path, layout):
    """transformers' Trainer: right-padded batches (a padding collator) and packed ones
    (DataCollatorWithFlattening: one row, position_ids restarting per document)."""
    from transformers import DataCollatorWithFlattening, Trainer

    from sbpbench.core import StreamConfig
    from sbpbench.integrations import StreamBPTrainer

    collator = _pad_collator if layout == "padded" else DataCollatorWithFlattening()
    stock = _run_trainer(Trainer, tmp_path, collator)
    config = StreamConfig(chunk_size=5, logits_chunk_size=7)
    _assert_same_training(stock, _run_trainer(StreamBPTrainer, tmp_path, collator, streambp=config))


def test_trainer_logs_what_streambp_ran(tmp_path):
    """Each logged training loss comes with the chunk sizes, placement, chunk attention kernel and
    peak memory of the StreamBP steps (tiny model, CPU); the run's closing summary has none."""
    from sbpbench.core import StreamConfig
    from sbpbench.integrations import StreamBPTrainer

    config = StreamConfig(chunk_size=5, logits_chunk_size=7, checkpoints="recompute:2")
    _, logs = _run_trainer(StreamBPTrainer, tmp_path, _pad_collator, streambp=config)
    training = [log for log in logs if "loss" in log]
    assert len(training) == STEPS
    for log in training:
        assert log["streambp/chunk_size"] == 5 and log["streambp/logits_chunk_size"] == 7
        assert log["streambp/checkpoints"] == "recompute:2" and log["streambp/chunk_attention"] == "lower-right"
        assert log["streambp/peak_rss_gib"] > 0
    assert not any(key.startswith("streambp/") for log in logs if "loss" not in log for key in log)


# --- TRL's SFTTrainer --------------------------------------------------------------------------


SFT_LAYOUTS = {  # name -> SFTConfig options
    "padded": {},
    "padding-free": {"padding_free": True, "max_length": None},  # each batch's rows concatenated into one
    "packing": {"packing": True, "max_length": 24},  # TRL's best-fit packing, padding-free rows
}


def _run_sft(cls, tmp_path, layout: str, options: dict | None = None, **kwargs):
    from datasets import Dataset
    from trl import SFTConfig

    common = _common(tmp_path) | (options or {})
    args = SFTConfig(**common, bf16=False, train_sampling_strategy="sequential", **SFT_LAYOUTS[layout])
    dataset = Dataset.from_dict({"text": _texts(12, 5, 20, seed=0)})
    make = lambda model: cls(model=model, args=args, train_dataset=dataset, processing_class=_tokenizer(), **kwargs)
    return _train(make, tiny_model("tiny/qwen3"))


@needs_trl
@pytest.mark.parametrize(
    "layout", [c if c == "padded" else pytest.param(c, marks=pytest.mark.slow) for c in SFT_LAYOUTS]
)
def test_sft_trainer_matches_stock(tmp_path, layout):
    """TRL's SFTTrainer, padded, padding-free and packed (one row of documents, position_ids
    restarting per document); its entropy, token accuracy and token count logged from the streamed step."""
    from trl import SFTTrainer

    from sbpbench.core import StreamConfig
    from sbpbench.integrations import StreamBPSFTTrainer

    stock = _run_sft(SFTTrainer, tmp_path, layout)
    config = StreamConfig(chunk_size=5, logits_chunk_size=7)
    _assert_same_training(stock, _run_sft(StreamBPSFTTrainer, tmp_path, layout, streambp=config))


@needs_trl
def test_sft_trainer_matches_stock_under_adamw(tmp_path):
    """With AdamW in place of SGD the updates still agree to 1e-10 when both runs compute the loss
    in fp64 (docs/trainers.md): Adam's per-element scaling amplifies only rounding that is not there."""
    from trl import SFTTrainer

    from sbpbench.core import StreamConfig
    from sbpbench.integrations import StreamBPSFTTrainer

    adamw = {"optim": "adamw_torch", "learning_rate": 1e-3}
    stock = _run_sft(SFTTrainer, tmp_path, "padded", adamw)
    config = StreamConfig(chunk_size=5, logits_chunk_size=7)
    _assert_same_training(stock, _run_sft(StreamBPSFTTrainer, tmp_path, "padded", adamw, streambp=config))


# --- TRL's DPOTrainer --------------------------------------------------------------------------

DPO_CASES = {  # name -> DPOConfig options
    "sigmoid": {},
    "ipo-forward_kl": {"loss_type": ["ipo"], "f_divergence_type": "forward_kl", "learning_rate": 0.01},  # IPO's
    # squared loss has gradients ~40x sigmoid's here: a smaller step keeps the run finite
    "sigmoid+sft-precomputed": {
        "loss_type": ["sigmoid", "sft"],
        "loss_weights": [1.0, 0.3],
        "precompute_ref_log_probs": True,
    },
}


def _run_dpo(cls, tmp_path, options, **kwargs):
    from datasets import Dataset
    from trl import DPOConfig

    args = DPOConfig(**(_common(tmp_path) | options), bf16=False, train_sampling_strategy="sequential")
    dataset = Dataset.from_dict(
        {"prompt": _texts(12, 3, 9, seed=1), "chosen": _texts(12, 2, 10, seed=2), "rejected": _texts(12, 2, 10, seed=3)}
    )
    model, ref_model = tiny_model("tiny/llama"), tiny_model("tiny/llama", seed=1)
    make = lambda model: cls(
        model=model, ref_model=ref_model, args=args, train_dataset=dataset, processing_class=_tokenizer(), **kwargs
    )
    return _train(make, model, ref_model=ref_model)


@needs_trl
@pytest.mark.parametrize("case", [c if c == "sigmoid" else pytest.param(c, marks=pytest.mark.slow) for c in DPO_CASES])
def test_dpo_trainer_matches_stock(tmp_path, case):
    """TRL's DPOTrainer with an explicit reference model: sigmoid, IPO with the forward-KL
    f-divergence, a weighted sigmoid + SFT mix on precomputed reference log-probs; rewards,
    margins, log-probs, entropy, logits and accuracy logged from the streamed step."""
    from trl import DPOTrainer

    from sbpbench.core import StreamConfig
    from sbpbench.integrations import StreamBPDPOTrainer

    stock = _run_dpo(DPOTrainer, tmp_path, DPO_CASES[case])
    config = StreamConfig(chunk_size=4, logits_chunk_size=6)
    _assert_same_training(stock, _run_dpo(StreamBPDPOTrainer, tmp_path, DPO_CASES[case], streambp=config))


# --- TRL's GRPOTrainer -------------------------------------------------------------------------

GRPO_CASES = {  # name -> GRPOConfig options (TRL's defaults: loss_type dapo, beta 0, on-policy)
    "trl-defaults": {},
    "bnpo-off-policy-gspo": {
        "loss_type": "bnpo",
        "num_iterations": 2,  # each generation batch trained on twice: old log-probs, clipping
        "steps_per_generation": 4,  # and reused over two optimizer steps
        "epsilon_high": 0.28,
        "temperature": 0.7,
        "importance_sampling_level": "sequence",
    },
    "grpo-kl-lora": {"loss_type": "grpo", "beta": 0.04, "delta": 1.5},  # reference: the adapter-free model
}


def _reward(completions, **kwargs) -> list[float]:
    """A fixed function of the completion's words."""
    return [sum(int(word[1:]) % 7 for word in text.split()) / (1 + len(text.split())) for text in completions]


def _run_grpo(cls, tmp_path, options, **kwargs):
    from datasets import Dataset
    from trl import GRPOConfig

    lora = options.get("beta", 0.0) != 0.0
    args = GRPOConfig(
        **_common(tmp_path),
        bf16=False,
        shuffle_dataset=False,
        num_generations=2,
        max_completion_length=8,
        **options,
    )
    dataset = Dataset.from_dict({"prompt": _texts(12, 3, 9, seed=4)})
    model = tiny_model("tiny/qwen3")
    if lora:
        model = apply_lora(model, rank=4, alpha=8, init_nonzero_seed=0)
    make = lambda model: cls(
        model=model, reward_funcs=_reward, args=args, train_dataset=dataset, processing_class=_tokenizer(), **kwargs
    )
    return _train(make, model, temperature=args.temperature)


@needs_trl
@pytest.mark.parametrize(
    "case", [c if c == "trl-defaults" else pytest.param(c, marks=pytest.mark.slow) for c in GRPO_CASES]
)
def test_grpo_trainer_matches_stock(tmp_path, case):
    """TRL's GRPOTrainer generating on CPU with a fixed reward: TRL's defaults (dapo, on-policy);
    bnpo off-policy with GSPO's sequence-level ratio, clip-higher, temperature and a generation batch
    reused over steps; grpo with a KL to the LoRA model's adapter-free reference and two-sided
    clipping; entropy, KL and clip ratios logged from the streamed step."""
    from trl import GRPOTrainer

    from sbpbench.core import StreamConfig
    from sbpbench.integrations import StreamBPGRPOTrainer

    stock = _run_grpo(GRPOTrainer, tmp_path, GRPO_CASES[case])
    config = StreamConfig(chunk_size=5, logits_chunk_size=7)
    _assert_same_training(stock, _run_grpo(StreamBPGRPOTrainer, tmp_path, GRPO_CASES[case], streambp=config))
