"""`sbp models`: the model shapes the registry knows, with their sizes, by model_type (fits 80 columns)."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp models",
    "sbp models | grep -i qwen3        # then: sbp run --model NAME",
)

LEGEND = (
    "Rows under each model_type. params: B = 10^9, M = 10^6, k = 10^3. L: decoder layers; d: hidden size; "
    "heads: query / key-value heads; hd: head dim; vocab: tokens (k = 10^3); tied: lm_head shares the input "
    "embedding. streambp: verified, CI checks it exact on this architecture; self-checked, its small float64 copy "
    "is checked before the first step (docs/exactness.md)."
)
HUB_NOTE = (
    "Any other Hub id works too (--model ORG/NAME): its config.json from the Hugging Face cache, fetched if missing "
    "(HF_HUB_OFFLINE=1: the cache only); random weights unless --weights. Or a local checkpoint directory."
)


def _count(number: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if number >= 0.9995 * scale:  # 999.9M shows as 1B
            return f"{number / scale:.3g}{unit}"
    return str(number)


def models() -> None:
    """List the model shapes the registry knows, with their sizes.

    Real Hub configs, small CPU shapes and tiny test shapes, each built with random weights
    unless --weights; any other Hub id or a local checkpoint directory works as well."""
    console = Console()
    console.print(models_table())
    console.print(HUB_NOTE, highlight=False)


def models_table() -> Table:
    """A row per registry name: parameters and shape, under a heading per model_type (fits 80 columns)."""
    from ..models import MODELS, count_parameters, is_verified, load_config

    table = Table(
        title="sbpbench model registry (random weights; configs ship with the package)",
        caption=LEGEND,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=0,  # the box's blank column separator keeps one space between columns
        show_edge=False,
    )
    for column in ("name", "params", "L", "d", "heads", "hd", "vocab", "tied"):
        table.add_column(column, justify="left" if column == "name" else "right", no_wrap=True)
    families: dict[str, list[tuple[str, ...]]] = {}  # model_type -> rows, in registry order
    verified: dict[str, list[bool]] = {}  # model_type -> per row, whether CI verifies its architecture
    for name in MODELS:
        config = load_config(name)
        # MLA (DeepSeek-V3): the query/key head dim, rope and no-rope parts together (head_dim is the rope part)
        head_dim = (
            getattr(config, "qk_head_dim", None)
            or getattr(config, "head_dim", None)
            or config.hidden_size // config.num_attention_heads
        )
        families.setdefault(config.model_type, []).append(
            (
                name,
                _count(count_parameters(name)),
                str(config.num_hidden_layers),
                str(config.hidden_size),
                f"{config.num_attention_heads}/{config.num_key_value_heads}",
                str(head_dim),
                _count(config.vocab_size),
                "yes" if config.tie_word_embeddings else "no",
            )
        )
        verified.setdefault(config.model_type, []).append(is_verified(config))
    for model_type, rows in families.items():
        done = verified[model_type]
        status = "all verified" if all(done) else f"{sum(done)} of {len(done)} verified, the rest self-checked"
        table.add_row(f"[bold]{model_type}[/bold] (streambp: {status})")
        for row in rows:
            table.add_row(*row)
    return table
