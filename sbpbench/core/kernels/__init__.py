"""The kernels that can run a chunk's attention over its prefix besides SDPA's lower-right path
(chunk_kernels.py, split_attention.py), and the choice among them (kernel_choice.py)."""
