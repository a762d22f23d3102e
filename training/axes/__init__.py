"""The model-parallel axes beside the core: which axis composes with which data-parallel family (`table.py`, plain
data that the launch checks, the planners, the doctor and recipes/compare.py read), and each axis's runtime,
imported only by a launch whose degree for it is above 1: pipelines (`pipeline.py`, its schedules' facts in
`schedules.py`), tensor parallelism (`tensor.py`), Ulysses and ring context parallelism (`sequence.py`)."""
