"""`sbp models`: the model shapes the registry knows, with their sizes."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..models import MODELS, count_parameters, load_config


def models() -> None:
    """List known model shapes (real Hub configs, small CPU shapes and tiny test shapes)."""
    table = Table(title="sbpbench model registry (random weights; configs ship with the package)")
    for column in ("name", "type", "params", "layers", "hidden", "heads / kv", "head_dim", "vocab", "tied"):
        table.add_column(column, justify="left" if column in ("name", "type") else "right", no_wrap=column == "name")
    for name in MODELS:
        config = load_config(name)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        table.add_row(
            name,
            config.model_type,
            f"{count_parameters(name) / 1e9:.3f}B"
            if not name.startswith(("tiny/", "small/"))
            else f"{count_parameters(name):,}",
            str(config.num_hidden_layers),
            str(config.hidden_size),
            f"{config.num_attention_heads} / {config.num_key_value_heads}",
            str(head_dim),
            f"{config.vocab_size:,}",
            "yes" if config.tie_word_embeddings else "no",
        )
    Console().print(table)
