"""Planning a run before renting the GPUs: the memory each layout needs (`memory/`), the cluster's hardware
(`hardware.py`), a step's time for each layout of data, tensor, pipeline and sequence parallelism (`step_time.py`),
the closed forms of what a step sends (`communication.py`), and the published runs the step time is checked against
(`published.py`). The planners read the configuration and the strategy, never the training loop."""
