"""Planning a run before renting the GPUs: the cluster's hardware (`hardware.py`), a step's time for each layout of
data, tensor, pipeline and sequence parallelism (`step_time.py`), and the published runs it is checked against
(`published.py`). The memory each layout needs is the memory planner's (`training/memory/planner.py`)."""
