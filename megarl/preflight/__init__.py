"""`megarl preflight`: check a cluster job's placement before it runs for days.

`MEGARL_PREFLIGHT=1 sbatch slurm/guru_moe.sh` runs the job script unchanged, but every step checks instead of
working (docs/cluster.md, "Preflight"):

    megarl prepare --preflight [--gpu] --config RECIPE   validate; fresh <run.dir>/preflight/ with config.yaml
    megarl preflight serve --config CFG --replica I      in each replica's step: listen where the replica would
    megarl preflight rank --config CFG                   in each trainer rank: rank 0 listens where its stores would
    megarl preflight report --config CFG                 in the batch script afterwards: one table, the problems
    megarl preflight versions --stack S                  any environment against stack S's lock (locks/)

Each check step says hello (who and where it is, which GPUs it holds, what it listens on), waits for every other
step's hello, connects to the endpoints the real run will connect to, checks the model's files, its GPUs and its
installed torch / megatron-core / vLLM / Transformer Engine against its role's lock (`versions.py`), writes
its report, and waits for the others' reports so its listeners stay up while they probe. The check path imports
only the standard library and the config (32+ of them run at once; the GPU probe imports torch only where an
NVIDIA driver is present), and reads safetensors headers, never weights.
"""
