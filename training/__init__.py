"""The training library behind the scripts in `recipes/`; nothing here is a script.

Grouped by what it holds, in layers: a module imports its own subpackage and the layers below it, never one above
(tests/test_layout.py). How to read one strategy's path through it: docs/reading.md. Lowest first:

    the configuration: plain facts, no runtime
    config.py          RunConfig: every flag, resolved once into the run's frozen config before anything heavy
    arguments.py       the scripts' parsers: a mistyped choice or flag is one `error:` line naming the close matches
    environment.py     what the launcher exported (accelerate's variables), read once; a YAML through accelerate's own
                       launcher code for the tools
    mesh.py            the degrees of every parallel axis in one mesh; the one check that they divide the world
    strategy.py        the typed Strategy of a launch: family, ZeRO stage, offloads, FSDP sharding, its mesh
    deepspeed_config.py  a DeepSpeed JSON's "auto" values resolved from the flags, its keys checked
    compat.py          the version floors checked at start-up; the few private APIs used, each with why
    adamw.py, flops.py, faults.py, limits.py, paths.py, pretrained.py
    axes/table.py      which axis composes with which family; axes/pipeline/schedules.py the schedules' facts
    checkpoints/safety.py  the globals a checkpoint's pickles may name, read without unpickling

    core/              one process, DDP, FSDP2 and ZeRO: one module per family (ddp.py, fsdp.py with fsdp1.py,
                       zero.py) behind family.py; the Accelerator, the model's build, the gradient norm, what is in
                       force, the ranks' agreement and exit statuses, DeepSpeed's ops
    axes/              beside the core, each imported only by a launch whose degree for it is above 1: pipeline/,
                       tensor/, ulysses.py, context.py
    checkpoints/       save and resume with a completion marker; a resume exact or refused (exact.py); the neutral
                       form across strategies and world sizes
    launch.py          the launch resolved once: environment, DeepSpeed JSON and flags into a frozen Launch
    loop/              what recipes/train.py drives: the engine, one step, evaluation, AdamW and its schedule, metrics,
                       --profile, the step watchdog, preemption, the collectives counted; the HF Trainer path
    report/            what a run shows: the console, the training curves, samples, the summary, the model card
    plan/              the planners (memory, a step's time, what a step sends): they read the configuration only
    doctor/, compare/, measure/  recipes/doctor.py, recipes/compare.py and recipes/measure/'s tools

Imports run one way: recipes/ -> training/ -> data/, model/.
"""
