"""sbpbench: exact StreamBP and a benchmark of backpropagation methods on long sequences."""

__version__ = "0.1.0"
