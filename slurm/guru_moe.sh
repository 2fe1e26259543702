#!/bin/bash
# Qwen3-30B-A3B on Guru-Math with REC-GSPO at REC appendix B.7 (lr 2e-6, batch 72, K 16, weight decay 0.1,
# warmup 80, sync_interval 8, eps 6e-4/8e-4): configs/qwen3_30b_a3b_guru.yaml.
#
#   sbatch slurm/guru_moe.sh                                  # from the megarl checkout, on the login node
#   RUN_DIR=/lustre/$USER/guru MEGARL_OVERRIDES="model.hf_dir=/lustre/models/Qwen3-30B-A3B" sbatch slurm/guru_moe.sh
#   RUN_DIR=/lustre/$USER/guru MEGARL_OVERRIDES="checkpoint.resume=latest" sbatch slurm/guru_moe.sh   # resume
#
# 8 nodes x 8 GPUs: trainer on the first 4 (32 ranks: TP 1 x PP 1 x DP 32, EP 8; bf16), 8 vLLM replicas x TP 4 on the
# other 4. Every setting is an environment variable (documented in slurm/megarl_job.sh and docs/cluster.md);
# sbatch options given on the command line override the #SBATCH lines below.
#SBATCH --job-name=megarl-guru-moe
#SBATCH --nodes=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out

MEGARL_CONFIG=${MEGARL_CONFIG:-configs/qwen3_30b_a3b_guru.yaml}
TRAINER_NODES=${TRAINER_NODES:-4}
# shellcheck source=slurm/megarl_job.sh
source "${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/megarl_job.sh"
