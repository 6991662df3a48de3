"""StreamBP across processes: how a step's parameter gradients are gathered and reduced under
FSDP2 or DeepSpeed ZeRO (grad_sync.py, grad_sync_deepspeed.py), one process being the trivial case
(grad_sync_base.py)."""
