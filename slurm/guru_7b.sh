#!/bin/bash
# Qwen2.5-7B on Guru-Math with the shared hyper-parameters of REC Table 2 (lr 1e-6, 64 prompts x K 16, weight
# decay 0.1, warmup 80): configs/qwen2.5_7b_guru.yaml; choose the algorithm with
# MEGARL_OVERRIDES="algorithm.name=..." (`megarl algorithms` lists them).
#
#   sbatch slurm/guru_7b.sh                                   # from the megarl checkout, on the login node
#
# 2 nodes x 8 GPUs: trainer on the first (8 ranks: TP 2 x PP 2 x DP 2; bf16), 4 vLLM replicas x TP 2 on the second.
# Every setting is an environment variable (slurm/megarl_job.sh, docs/cluster.md).
#SBATCH --job-name=megarl-guru-7b
#SBATCH --nodes=2
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out

MEGARL_CONFIG=${MEGARL_CONFIG:-configs/qwen2.5_7b_guru.yaml}
TRAINER_NODES=${TRAINER_NODES:-1}
# shellcheck source=slurm/megarl_job.sh
source "${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/megarl_job.sh"
