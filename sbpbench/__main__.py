"""`python -m sbpbench` is the `sbp` command."""

from .cli import main

main()
