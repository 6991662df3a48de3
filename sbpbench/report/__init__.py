"""The results table beside the paper's numbers, as Markdown: `sbp report` (rows read by records.select)."""

from .markdown import glance_markdown, markdown_report, points_markdown

__all__ = ["glance_markdown", "markdown_report", "points_markdown"]
