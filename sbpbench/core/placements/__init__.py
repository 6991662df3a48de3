"""Where the layer inputs X_l wait for their layer's backward: the device, page-locked host memory,
recomputed from a kept input, or streamed through host buffers with rebuilds (placement.py names
them; stream_store.py streams; sequences.py and host_copies.py move a (B, T, d) tensor a chunk at a
time; rebuild_schedule.py plans which inputs a streamed step keeps)."""
