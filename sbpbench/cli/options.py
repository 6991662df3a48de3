"""Option types shared by commands, declared once."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from ..methods import METHODS
from ..runner.spec import DTYPES

# Choices come from the registries, so a new method or dtype needs no CLI edit.
Method = Enum("Method", {name: name for name in METHODS}, type=str)
DType = Enum("DType", {name: name for name in DTYPES}, type=str)


ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="Registry name (see `sbp models`) or a local checkpoint directory.")
]
BatchOpt = Annotated[int, typer.Option("--batch", "-B", min=1, help="Rows per batch.")]
ChunkOpt = Annotated[int, typer.Option("--chunk-size", min=1, help="StreamBP positions per layer chunk.")]
LogitsChunkOpt = Annotated[int, typer.Option("--logits-chunk-size", min=1, help="StreamBP positions per logits chunk.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for weights and batch.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
