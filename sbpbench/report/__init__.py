"""The results table beside the paper's numbers, as Markdown: `sbp report` (rows read by records.select)."""

from .markdown import markdown_report

__all__ = ["markdown_report"]
