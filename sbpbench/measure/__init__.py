"""Measurement: memory (the CPU live-tensor tracker, torch.cuda, NVML, RSS), a step's memory over time
(timeline/), time, FLOPs and the environment a step ran in."""
