"""The results table beside the paper's numbers: `sbp report`, and the row selection plots share."""

from .markdown import markdown_report

__all__ = ["markdown_report"]
