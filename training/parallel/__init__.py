"""The parallel axes: their degrees in one mesh and its groups (`mesh.py`, `groups.py`), the pipeline schedules' facts
(`schedules.py`), the launch's typed `Strategy` and its checks (`strategy.py`, `deepspeed_config.py`, `sequence.py`,
`ops.py`), the Accelerator and the model built for the strategy (`accelerator.py`, `build.py`), the pipeline
runtime (`pipeline.py`), the gradient norm over shards (`gradnorm.py`), the strategy in force read back
(`inspection.py`) and the ranks' agreement and exit statuses (`ranks.py`). `mesh.py` and `schedules.py` are plain
facts that the configuration reads; nothing here imports the training loop."""
