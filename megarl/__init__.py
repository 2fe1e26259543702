"""megarl: RL post-training for megatron-core policies with a lagged, partitioned vLLM weight sync.

Layers, bottom to top. A module imports from its own layer or from layers below it, never from a layer above,
and no import, at module level or inside a function, closes a circle (`tests/test_import_layers.py` reads every
import from the source and fails on either). The most specific prefix names a module's layer.

| layer       | modules                                                      | what lives there                       |
|-------------|--------------------------------------------------------------|----------------------------------------|
| definitions | megarl.config, megarl.algorithms, megarl.rewards,            | typed config, losses, reward functions,|
|             | megarl.data, megarl.batch, megarl.metrics, megarl.stacks,    | data, batches, metrics, pinned stacks, |
|             | megarl.token_versions, megarl.schedule                       | each token's policy version, the lagged|
|             |                                                              | schedule and the run's version clock   |
| components  | megarl.parallel, megarl.models, megarl.sync, megarl.rollout, | model facts and builders, the weight   |
|             | megarl.rewards.scoring, megarl.trainer, megarl.checkpoint    | sync, the fleet, scoring, the trainer  |
| checks      | megarl.checks                                                | does a config fit its model, machines  |
| run         | megarl.loop, megarl.rank, megarl.launch, megarl.roles,       | one training run, a cluster job's      |
|             | megarl.preflight                                             | roles and the checks before it         |
| tools       | megarl.plan_report, megarl.bench, megarl.repro, megarl.cli,  | commands, benchmarks, reproductions,   |
|             | megarl.smoke                                                 | the checks before a GPU job            |

Where a new piece goes: a fact of the model's shape goes to `megarl.models` (`hf_config`, `shapes`); a check that a
layout or its memory fits goes to `megarl.checks`, which `megarl check`, `megarl plan` and `megarl train` call; a
benchmark's shared part goes to a lower module of `megarl.bench` that the benchmarks import. Inside `megarl.rollout`
the order is `fleet` (processes) <- `rendezvous` (registry) <- `restarts` (watcher) <- `run_fleet` (a run's fleet).
"""

__version__ = "0.1.0"
