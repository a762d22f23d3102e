"""Pipeline parallelism: the decoder's layers split into stages over ranks, run by torch.distributed.pipelining's
schedules. `schedules.py` holds the schedules' facts and the launch's checks (plain data, read by the configuration
and the planners too); `stage.py` a stage of the model; `runtime.py` the stages, their groups and their step, with
DDP's all-reduce or FSDP2 across the pipelines, and what is in force; `busy_clock.py` times each rank's share of a
schedule; `groups.py` the process groups a pipeline creates. Imported only by a launch with pipeline stages."""
