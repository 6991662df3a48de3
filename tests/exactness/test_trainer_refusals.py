"""What the StreamBP trainers refuse, at construction or per batch, with a one-line message that says
what to do; what they warn about; StreamConfig's checks; and that TRL stays an optional import."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from sbpbench.core import StreamConfig
from sbpbench.integrations.trainer import checkpointing_option

from ..conftest import needs_trl, tiny_model
from .test_trainers import _common, _pad_collator, _texts, _token_rows, _tokenizer


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the trainers' relative output_dir lands


def _assert_refused(make, match: str):
    with pytest.raises(ValueError, match=match) as error:
        make()
    assert "\n" not in str(error.value), "a refusal is one line"


def _make_trainer(**options):
    Dataset = pytest.importorskip("datasets", reason="needs datasets: pip install -e '.[trl]'").Dataset
    from transformers import TrainingArguments

    from sbpbench.integrations import StreamBPTrainer

    args = TrainingArguments(**_common("out") | options, remove_unused_columns=False)
    dataset = Dataset.from_list(_token_rows(4))
    return lambda model=None: StreamBPTrainer(
        model=model or tiny_model("tiny/qwen3"), args=args, train_dataset=dataset, data_collator=_pad_collator
    )


def _make_trl(kind: str, **options):
    """A factory of the StreamBP TRL trainer `kind` ("sft", "dpo", "grpo") with config options."""
    import trl
    from datasets import Dataset

    from sbpbench import integrations

    config = {"sft": trl.SFTConfig, "dpo": trl.DPOConfig, "grpo": trl.GRPOConfig}[kind]
    extra = {"grpo": {"num_generations": 2}}.get(kind, {})
    defaults = {"bf16": False, "activation_checkpointing": False}
    args = config(**_common("out") | defaults | extra | options)
    columns = {
        "sft": {"text": _texts(4, 3, 6, seed=0)},
        "dpo": {key: _texts(4, 3, 6, seed=i) for i, key in enumerate(("prompt", "chosen", "rejected"))},
        "grpo": {"prompt": _texts(4, 3, 6, seed=0)},
    }[kind]
    kwargs = {
        "sft": {},
        "dpo": {"ref_model": tiny_model("tiny/llama", seed=1)},
        "grpo": {"reward_funcs": lambda completions, **_: [0.0] * len(completions)},
    }[kind]
    cls = {"sft": "StreamBPSFTTrainer", "dpo": "StreamBPDPOTrainer", "grpo": "StreamBPGRPOTrainer"}[kind]
    model = tiny_model("tiny/llama" if kind == "dpo" else "tiny/qwen3")
    return lambda: getattr(integrations, cls)(
        model=model, args=args, train_dataset=Dataset.from_dict(columns), processing_class=_tokenizer(), **kwargs
    )


TRL_REFUSALS = {  # name -> (trainer, config options, words of the message)
    "sft-dft": ("sft", {"loss_type": "dft"}, "loss_type='dft'"),
    "dpo-ld_alpha": ("dpo", {"ld_alpha": 0.5}, "ld_alpha"),
    "dpo-use_weighting": ("dpo", {"use_weighting": True}, "use_weighting"),
    "dpo-alpha_divergence": ("dpo", {"f_divergence_type": "alpha_divergence"}, "alpha_divergence"),
    "grpo-cispo": ("grpo", {"loss_type": "cispo"}, "loss_type 'cispo' is not supported"),
    "grpo-entropy-quantile": ("grpo", {"top_entropy_quantile": 0.5}, "top_entropy_quantile"),
    "grpo-off-policy-mask": ("grpo", {"off_policy_mask_threshold": 0.1}, "off_policy_mask_threshold"),
    "grpo-entropy-bonus": ("grpo", {"entropy_coef": 0.01}, "entropy bonus"),
}


@needs_trl
@pytest.mark.parametrize("case", TRL_REFUSALS)
def test_trl_options_streambp_cannot_run_are_refused(case):
    """Each TRL option whose loss StreamBP does not compute is refused at construction, by name."""
    kind, options, words = TRL_REFUSALS[case]
    _assert_refused(_make_trl(kind, **options), words)


@pytest.mark.parametrize(
    ("options", "words"),
    [({"label_smoothing_factor": 0.1}, "label smoothing"), ({"torch_compile": True}, "torch_compile")],
    ids=["label-smoothing", "torch-compile"],
)
def test_trainer_options_streambp_cannot_run_are_refused(options, words):
    """transformers' Trainer options StreamBP cannot honour are refused at construction."""
    _assert_refused(_make_trainer(**options), words)


def test_compute_loss_func_is_refused():
    """A custom compute_loss_func (it reads full logits) is refused at construction."""
    Dataset = pytest.importorskip("datasets", reason="needs datasets: pip install -e '.[trl]'").Dataset
    from transformers import TrainingArguments

    from sbpbench.integrations import StreamBPTrainer

    _assert_refused(
        lambda: StreamBPTrainer(
            model=tiny_model("tiny/qwen3"),
            args=TrainingArguments(**_common("out"), remove_unused_columns=False),
            train_dataset=Dataset.from_list(_token_rows(4)),
            data_collator=_pad_collator,
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum(),
        ),
        "compute_loss_func",
    )


def test_unsupported_model_family_is_refused():
    """A model the core does not stream (GPT-2: no decoder layers list) is refused at construction, saying why."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512))
    _assert_refused(lambda: _make_trainer()(model), "no decoder.layers")


def _stand_in(**changes):
    """What StreamBPStep.refuse_unsupported reads of a trainer, one process, nothing refused."""
    args = SimpleNamespace(n_gpu=1, fp16=False, torch_compile=False, optim="sgd", activation_checkpointing=False)
    accelerator = SimpleNamespace(
        num_processes=1, distributed_type=DistributedType.NO, is_fsdp2=False, mixed_precision="no",
        parallelism_config=None,
    )  # fmt: skip
    trainer = SimpleNamespace(
        args=args, accelerator=accelerator, compute_loss_func=None, label_smoother=None, model=tiny_model("tiny/qwen3")
    )
    for key, value in changes.items():
        target, name = key.split(".")
        setattr({"args": args, "accelerator": accelerator}[target], name, value)
    return trainer


ENGINE_REFUSALS = {  # name -> (settings, words of the message)
    "data-parallel": ({"args.n_gpu": 2}, "nn.DataParallel"),
    "ddp": ({"accelerator.num_processes": 2, "accelerator.distributed_type": DistributedType.MULTI_GPU}, "DDP"),
    "fsdp1": ({"accelerator.num_processes": 2, "accelerator.distributed_type": DistributedType.FSDP}, "FSDP1"),
    "fp16": ({"args.fp16": True}, "fp16 loss scaling"),
    "context-parallel": ({"accelerator.parallelism_config": SimpleNamespace(cp_enabled=True)}, "context"),
    "lomo": ({"args.optim": "lomo"}, "LOMO"),
    "activation-offloading": ({"args.activation_offloading": True}, "activation_offloading"),
}


@pytest.mark.parametrize("case", ENGINE_REFUSALS)
def test_engines_streambp_cannot_drive_are_refused(case):
    """DataParallel, DDP, FSDP1, fp16 loss scaling, context parallelism, LOMO and activation
    offloading are refused (rules checked on a stand-in trainer: this machine has one CPU process)."""
    from sbpbench.integrations.trainer import StreamBPStep

    settings, words = ENGINE_REFUSALS[case]
    _assert_refused(lambda: StreamBPStep.refuse_unsupported(_stand_in(**settings)), words)


@pytest.mark.parametrize("engine", [DistributedType.FSDP, DistributedType.DEEPSPEED])
def test_fsdp2_and_deepspeed_are_accepted(engine):
    """Two processes under FSDP2 or DeepSpeed pass the rules (the core's adapters run them)."""
    from sbpbench.integrations.trainer import StreamBPStep

    changes = {"accelerator.num_processes": 2, "accelerator.distributed_type": engine, "accelerator.is_fsdp2": True}
    StreamBPStep.refuse_unsupported(_stand_in(**changes))


@needs_trl
def test_gradient_checkpointing_warns():
    """TRL's default gradient_checkpointing=True draws a warning (it does nothing for StreamBP) that
    names the option as the installed transformers spells it; off, none."""
    import warnings

    with pytest.warns(UserWarning, match="gradient checkpointing has no effect") as caught:
        _make_trl("sft", activation_checkpointing=True)()
    # the installed transformers' option (5.24: activation_checkpointing; gradient_checkpointing its deprecated alias)
    assert any(str(w.message).endswith("set activation_checkpointing=False") for w in caught)
    old = SimpleNamespace(gradient_checkpointing=True)  # a transformers without the newer name
    assert checkpointing_option(old) == "gradient_checkpointing"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _make_trl("sft")()


@needs_trl
def test_grpo_refuses_per_token_advantages_and_images():
    """A GRPO batch with (B, T) advantages or image inputs is refused before any work."""
    trainer = _make_trl("grpo")()
    prompt, completion = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    batch = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": torch.ones_like(completion),
        "num_items_in_batch": torch.tensor(8.0),
    }
    with pytest.raises(ValueError, match=r"one per sequence, shape \(B,\)"):
        trainer.streamed_batch(batch | {"advantages": torch.zeros(2, 4)}, None)
    with pytest.raises(ValueError, match="pixel_values"):
        trainer.streamed_batch(batch | {"advantages": torch.zeros(2), "pixel_values": torch.zeros(1)}, None)


def test_batch_without_labels_is_refused():
    """StreamBPTrainer trains on the batch's labels; a batch without them is a clear error."""
    trainer = _make_trainer()()
    with pytest.raises(ValueError, match="use a data collator that sets labels"):
        trainer.streamed_batch({"input_ids": torch.ones(1, 4, dtype=torch.long)}, None)


@pytest.mark.parametrize(
    ("options", "words"),
    [({"chunk_size": 0}, "chunk_size must be a positive integer"), ({"checkpoints": "disk"}, "checkpoints must be")],
)
def test_config_checks_its_fields(options, words):
    """StreamConfig refuses a chunk size below 1 and an unknown placement when it is made."""
    with pytest.raises(ValueError, match=words):
        StreamConfig(**options)


def test_streambp_keyword_takes_a_config():
    """streambp= given anything but a StreamConfig is a TypeError before the trainer is built."""
    from sbpbench.integrations import StreamBPTrainer

    with pytest.raises(TypeError, match="StreamConfig"):
        StreamBPTrainer(model=tiny_model("tiny/qwen3"), streambp={"chunk_size": 8})


def test_trl_trainer_without_trl_says_how_to_install(monkeypatch):
    """Without TRL, asking for a TRL trainer raises ImportError naming the extra to install."""
    from sbpbench import integrations

    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` fails as if not installed
    monkeypatch.delitem(sys.modules, "sbpbench.integrations.sft", raising=False)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[trl\]'"):
        integrations.StreamBPSFTTrainer  # noqa: B018


@pytest.mark.slow
def test_importing_integrations_does_not_import_trl():
    """`import sbpbench.integrations` and StreamBPTrainer import no TRL; a TRL trainer does."""
    code = (
        "import sys, sbpbench, sbpbench.integrations\n"
        "from sbpbench.core import StreamConfig\nfrom sbpbench.integrations import StreamBPTrainer\n"
        "assert 'trl' not in sys.modules, 'trl imported'\n"
        "from sbpbench.integrations import StreamBPSFTTrainer\n"
        "assert 'trl' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
