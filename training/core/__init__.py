"""The core: what `recipes/train.py` runs as one process, under DDP, FSDP2 or DeepSpeed ZeRO, without any
model-parallel axis. Nothing here imports an axis (training/axes/), the loop or a planner."""
