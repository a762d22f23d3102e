"""The training library behind the scripts in `recipes/`; nothing here is a script.

Grouped by concern, in layers: a module imports its own subpackage and the layers below it, never one above
(tests/test_layout.py). Lowest first:

    the configuration, here and in parallel/:
    config.py        RunConfig: every flag, resolved once into the run's frozen config before anything heavy
    arguments.py     the scripts' parsers: a mistyped choice or flag is one `error:` line naming the close matches
    compat.py        the torch, transformers, accelerate and deepspeed floors, checked at start-up; the few private
                     APIs used, each with why
    pretrained.py    a checkpoint to start from: its config as a ShardGPTConfig, whether it brings a tokenizer
    decay.py         which parameters AdamW decays (the optimizer's groups, the planners' count)
    flops.py         training FLOPs per token and a device's peak FLOP/s
    faults.py        faults the tests inject (kills, signals, a stall, a full disk)
    paths.py         the repository root
    parallel/mesh.py       the degrees of every parallel axis in one mesh (pp, dp_replicate, dp_shard, cp, sp, tp):
                           a rank's coordinates, the data-parallel size and rank, the groups; the one divisibility
                           check; the accelerate YAML's parallelism block, read in one place
    parallel/schedules.py  the pipeline schedules' facts: stage placement, layers per stage, each schedule's rules

    parallel/        the axes and their runtimes: the launch's typed Strategy holding its mesh, and its checks
                     (strategy.py, deepspeed_config.py, sequence.py, ops.py); the Accelerator (accelerator.py); the
                     model built for the strategy (build.py); the pipeline runtime (pipeline.py); the gradient norm
                     over shards (gradnorm.py); the strategy in force read back (inspection.py); ranks' agreement
                     and exit statuses (ranks.py); the process groups of the mesh's axes (groups.py)
    plan/            the planners: memory (memory/), a step's time (step_time.py, hardware.py, published.py), the
                     closed forms of what a step sends (communication.py); they read the configuration and the
                     strategy, never the loop
    checkpoints/     save and resume (checkpoint.py), the strategy-neutral form and resuming under another strategy
                     or world size (portable.py), the full weights gathered for the export (export.py)
    loop/            what recipes/train.py drives: the engine (engine.py: the whole model prepared by accelerate, or
                     this rank's pipeline stages), one optimizer step and its shared tail (step.py), the evaluation,
                     AdamW and its schedule (optim.py), metrics.jsonl and the trackers, --profile, the step watchdog,
                     preemption, each rank's collectives counted (comms.py); the Trainer path (hf_trainer.py); the
                     tools that measure a step (synthetic.py, bubble.py)
    report/          what a run shows: the console's lines, the training curves, samples from the export, the
                     end-of-run summary, the exported folder's model card
    compare/         recipes/compare.py: launching runs, reading what they left, the report and plots
    doctor/          recipes/doctor.py: the report, checks of the machine, checks of one launch

Imports run one way: recipes/ -> training/ -> data/, model/.
"""
