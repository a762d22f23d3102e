"""The training library behind the scripts in `recipes/`; nothing here is a script.

The modules a training run uses, in the order `recipes/train.py` reads them:

    config.py        RunConfig: every flag, resolved once into the run's frozen config before anything heavy
    deepspeed_config.py  a DeepSpeed JSON checked and its "auto" values filled from the flags
    parallel/mesh.py the degrees of every parallel axis in one mesh (pp, dp_replicate, dp_shard, cp, sp, tp): a
                     rank's coordinates, the data-parallel size and rank, the groups; the one divisibility check
    strategy.py      Strategy, the launch's typed facts and their names, built once from the launcher's environment
                     and the DeepSpeed JSON, holding its mesh; the checks before the group
    accelerator.py   the Accelerator, and the switches that run every GPU strategy on CPU ranks
    build.py         the model of a run: a preset or a checkpoint, built sharded (ZeRO-3, FSDP2), same weights per seed
    optim.py         AdamW's parameter groups and the learning-rate schedule
    engine.py        what the loop drives: the whole model prepared by accelerate, or this rank's pipeline stages
    pipeline.py      pipeline parallelism: stages, torch's schedules, the tied embedding, clipping, the busy clock
    inspection.py    the strategy in force, read from the prepared objects; each rank's share of the states
    step.py          one optimizer step: micro batches, the token-weighted loss, clipping
    comms.py         each rank's collectives in one step, by kind, in calls and bytes; the closed form of each
                     strategy's traffic for its settings, and the ZeRO paper's
    checkpoint.py    save and resume: the completion marker, checksums, disk-space checks
    portable.py      the strategy-neutral form of a checkpoint, and resuming under another strategy or world size
    preemption.py    SIGTERM / SIGUSR1: stop after a checkpoint every rank agrees on
    metrics.py       metrics.jsonl and the trackers; FLOPs per token and MFU
    profiling.py     --profile: torch.profiler traces of chosen steps, rank 0's summary table
    watchdog.py      --step_timeout: a hung step dumps every rank's stack and names the stuck ranks
    evaluate.py      the validation loss
    sample.py        samples from the export at the end (nanoGPT's temperature and top-k), its generation config
    curves.py        training_curves.png: loss, learning rate and tokens/s against the step, from metrics.jsonl
    summary.py       the end-of-run summary: steps, tokens, time, losses, throughput, every rank's peak memory
    console.py       what a run prints: the project's lines, third-party messages known to be harmless filtered
    export.py        the full weights, gathered from whatever shards the strategy made
    model_card.py    the exported folder's README.md, in the Hub's model-card format
    ranks.py         exit statuses, one-line errors, agreement across ranks
    arguments.py     the scripts' parsers: a mistyped choice or flag is one `error:` line naming the close matches
    hf_trainer.py    the same model, data and loss under `transformers.Trainer` (recipes/trainer.py)
    ops.py           DeepSpeed's compiled ops: which a launch needs, their build cache
    faults.py        faults the tests inject (kills, signals, a stall, a full disk)
    synthetic.py     train.py's setup on random tokens, for the tools that measure it
    bubble.py        the pipeline bubble and the activations a schedule holds, on stages of fixed cost and on the
                     model's own (recipes/measure/pipeline_bubble.py, pipeline_memory.py)
    paths.py         the repository root
    compat.py        the torch, transformers, accelerate and deepspeed floors, checked at start-up; the few private
                     APIs used, each with why

The parts of the other tools:

    parallel/        the mesh (above) and the process groups of its axes for the runtimes that build their own

    compare/         recipes/compare.py: launching runs, reading what they left, the report and plots
    doctor/          recipes/doctor.py: the report, checks of the machine, checks of one launch
    memory/          the planner's model (recipes/plan_memory.py), whether a launch fits this machine and the
                     largest size that does, the ledger of what a rank really holds (recipes/measure/measure_memory.py),
                     and measured against planned; the bytes a rank holds for its backward, counted live
    planning/        recipes/plan_memory.py --step_time: GPU kinds and clusters, a step's predicted time for every
                     layout that fits (compute, exposed communication, bubble, offload), the published runs it is
                     checked against

Imports run one way: recipes/ -> training/ -> data/, model/.
"""
