"""The training loop's parts: the engine the loop drives (`engine.py`), one optimizer step (`step.py`), the
evaluation, AdamW and its schedule, the metrics and trackers, the profiler, the step watchdog, preemption, the
communication counter, and the Trainer path (`hf_trainer.py`)."""
