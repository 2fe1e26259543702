# shellcheck shell=bash
# The body of every megarl SLURM job, sourced by the job scripts (slurm/guru_moe.sh, slurm/guru_7b.sh) after they
# set their defaults. It runs three kinds of steps in one allocation:
#
#   prepare   one task on the first node: `megarl prepare` (run directory, resolved config, fresh fleet secret)
#   serve     one step per rollout replica on the rollout nodes: `megarl serve --replica i` (vLLM, TP rollout.tp)
#   rank      one step on the trainer nodes: trainer.world_size tasks of `megarl rank`
#
# and exits with 0 only if the trainer ranks finished and no replica died before them. Every step's output goes to
# $RUN_DIR/logs/; the job's own output file gets one line per event. Settings (environment variables, all
# optional; the job script sets the defaults): docs/cluster.md.

set -euo pipefail

: "${MEGARL_CONFIG:?the job script sets it: the recipe}" "${TRAINER_NODES:?the job script sets it: nodes for the trainer}"
MEGARL_HOME=${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}  # the megarl checkout: recipes are read relative to it
MEGARL=${MEGARL:-megarl}                   # how to run megarl on the nodes, e.g. "/opt/venv/bin/megarl"
MEGARL_OVERRIDES=${MEGARL_OVERRIDES:-}     # extra section.field=value overrides, space separated
RUN_DIR=${RUN_DIR:-}                       # run.dir override (a shared filesystem); empty: the recipe's run.dir
GPUS_PER_NODE=${GPUS_PER_NODE:-8}          # GPUs each step may use per node; 0: CPU nodes, request none
TRAINER_TASKS_PER_NODE=${TRAINER_TASKS_PER_NODE:-$GPUS_PER_NODE}  # trainer ranks per trainer node
CONTAINER_IMAGE=${CONTAINER_IMAGE:-}       # pyxis/enroot image for every step; empty: run on the host
CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-}     # pyxis mounts, e.g. /lustre:/lustre (the run dir must be visible)
STOP_GRACE_S=${STOP_GRACE_S:-60}           # how long a stopping step may take before it is killed
POLL_S=${POLL_S:-5}                        # how often the job checks its steps

say() { printf 'megarl job %s: %s\n' "${SLURM_JOB_ID:-?}" "$*" >&2; }

read -r -a megarl_cmd <<< "$MEGARL"
read -r -a overrides <<< "$MEGARL_OVERRIDES"
if [[ -n $RUN_DIR ]]; then overrides+=("run.dir=$RUN_DIR"); fi
container=()
if [[ -n $CONTAINER_IMAGE ]]; then
    container=(--container-image="$CONTAINER_IMAGE" --container-workdir="$MEGARL_HOME")
    if [[ -n $CONTAINER_MOUNTS ]]; then container+=(--container-mounts="$CONTAINER_MOUNTS"); fi
fi
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( TRAINER_NODES < 1 || TRAINER_NODES >= ${#nodes[@]} )); then
    say "TRAINER_NODES=$TRAINER_NODES but the job has ${#nodes[@]} node(s): the trainer needs at least one and" \
        "the rollout replicas at least one of their own (sbatch --nodes=N, TRAINER_NODES=k < N)"
    exit 2
fi
trainer_hosts_list=("${nodes[@]:0:TRAINER_NODES}")
rollout_hosts=("${nodes[@]:TRAINER_NODES}")
cd "$MEGARL_HOME"

# --- prepare: validate the recipe, make the run directory; its stdout is the topology (KEY=VALUE lines) ---------
say "preparing ${MEGARL_CONFIG} ${overrides[*]}"
topology=$(srun --nodes=1 --ntasks=1 --nodelist="${nodes[0]}" --job-name=megarl-prepare "${container[@]}" \
    "${megarl_cmd[@]}" prepare --config "$MEGARL_CONFIG" "${overrides[@]}") || {
    say "megarl prepare failed (its message is above): nothing was started"
    exit 2
}
while IFS='=' read -r key value; do
    case $key in
        RUN_DIR) RUN_DIR=$value ;;
        TRAINER_WORLD_SIZE) world_size=$value ;;
        ROLLOUT_REPLICAS) replicas=$value ;;
        ROLLOUT_TP) rollout_tp=$value ;;
    esac
done <<< "$topology"
logs="$RUN_DIR/logs"
config="$RUN_DIR/config.yaml"
if (( GPUS_PER_NODE > 0 )); then
    per_node=${ROLLOUT_REPLICAS_PER_NODE:-$(( GPUS_PER_NODE / rollout_tp ))}
else
    per_node=${ROLLOUT_REPLICAS_PER_NODE:-1}
fi
if (( per_node < 1 || replicas > per_node * ${#rollout_hosts[@]} )); then
    say "rollout.replicas=$replicas x rollout.tp=$rollout_tp does not fit ${#rollout_hosts[@]} rollout node(s)" \
        "with $per_node replica(s) each: add nodes, or lower rollout.replicas"
    exit 2
fi
# CPUs of each replica's step (vLLM's API server, engine core and TP workers): the node's share by default
cpus_per_replica=${ROLLOUT_CPUS_PER_REPLICA:-$(( ${SLURM_CPUS_ON_NODE:-$per_node} / per_node ))}
if (( cpus_per_replica < 1 )); then cpus_per_replica=1; fi
if (( world_size > TRAINER_TASKS_PER_NODE * TRAINER_NODES )); then
    say "trainer.world_size=$world_size ranks do not fit $TRAINER_NODES trainer node(s) x" \
        "$TRAINER_TASKS_PER_NODE (TRAINER_TASKS_PER_NODE): add trainer nodes"
    exit 2
fi

# --- start the fleet and the trainer: every step runs in the background, named, so it can be watched and stopped --
step_names=()
step_pids=()
start_step() {  # start_step NAME SRUN_OPTION... -- COMMAND...
    local name=$1
    shift
    srun --job-name="$name" "$@" &
    step_names+=("$name")
    step_pids+=("$!")
}
step_ids() {  # the SLURM step ids (job.step) of this job's steps called $1
    squeue --noheader --steps --jobs="$SLURM_JOB_ID" --format="%i %j" | awk -v name="$1" '$2 == name { print $1 }'
}
stop_steps() {  # SIGTERM to the tasks of every step still running; SIGKILL to those alive after STOP_GRACE_S
    local i id deadline=$(( SECONDS + STOP_GRACE_S ))
    for i in "${!step_pids[@]}"; do
        if kill -0 "${step_pids[i]}" 2>/dev/null; then
            for id in $(step_ids "${step_names[i]}"); do scancel --signal=TERM "$id" || true; done
        fi
    done
    for i in "${!step_pids[@]}"; do
        while kill -0 "${step_pids[i]}" 2>/dev/null && (( SECONDS < deadline )); do sleep 1; done
        if kill -0 "${step_pids[i]}" 2>/dev/null; then
            say "${step_names[i]} did not stop within ${STOP_GRACE_S}s (STOP_GRACE_S): killing it"
            for id in $(step_ids "${step_names[i]}"); do scancel --signal=KILL "$id" || true; done
        fi
        wait "${step_pids[i]}" 2>/dev/null || true
    done
}
# shellcheck disable=SC2317  # called by the trap
on_signal() {
    say "job signalled: stopping every step"
    stop_steps
    rm -rf "$RUN_DIR/private"
    exit 143
}
trap on_signal TERM INT

for (( i = 0; i < replicas; i++ )); do
    gpus=()
    if (( GPUS_PER_NODE > 0 )); then gpus=(--gpus="$rollout_tp"); fi
    start_step "megarl-serve-$i" --nodes=1 --ntasks=1 --cpus-per-task="$cpus_per_replica" --exact \
        --nodelist="${rollout_hosts[i / per_node]}" \
        --output="$logs/serve_replica$i.log" "${gpus[@]}" "${container[@]}" \
        "${megarl_cmd[@]}" serve --config "$config" --replica "$i"
done
trainer_gpus=()
if (( GPUS_PER_NODE > 0 )); then trainer_gpus=(--gpus-per-node="$GPUS_PER_NODE"); fi
trainer_hosts=$(IFS=,; echo "${trainer_hosts_list[*]}")
start_step megarl-rank --nodes="$TRAINER_NODES" --ntasks="$world_size" --nodelist="$trainer_hosts" \
    --kill-on-bad-exit=1 --output="$logs/trainer_rank%t.log" "${trainer_gpus[@]}" "${container[@]}" \
    "${megarl_cmd[@]}" rank --config "$config"
trainer=$(( ${#step_pids[@]} - 1 ))  # the trainer is the last step; replica i is step i
say "fleet: $replicas replica(s) on ${rollout_hosts[*]}; trainer: $world_size rank(s) on ${trainer_hosts_list[*]};" \
    "logs in $logs"

# --- watch: the trainer must finish while every replica is still up ----------------------------------------------
replicas_up() {
    local i
    for (( i = 0; i < replicas; i++ )); do kill -0 "${step_pids[i]}" 2>/dev/null || return 1; done
}
while kill -0 "${step_pids[trainer]}" 2>/dev/null && replicas_up; do sleep "$POLL_S"; done
status=0
for (( i = 0; i < replicas; i++ )); do  # a replica that died is the cause, whether or not the trainer noticed
    if ! kill -0 "${step_pids[i]}" 2>/dev/null; then
        code=0
        wait "${step_pids[i]}" || code=$?
        say "FAILED: rollout replica $i exited with code $code before the trainer finished" \
            "(see $logs/serve_replica$i.log and $logs/vllm_replica$i.log)"
        status=1
    fi
done
if ! kill -0 "${step_pids[trainer]}" 2>/dev/null; then
    code=0
    wait "${step_pids[trainer]}" || code=$?
    if (( code != 0 )); then
        say "FAILED: the trainer ranks exited with code $code (see $logs/trainer_rank*.log)"
        status=1
    elif (( status == 0 )); then
        say "trainer finished; outputs in $RUN_DIR (summary.json, metrics.jsonl)"
    fi
fi
if (( status != 0 )); then say "stopping the job's other steps"; fi
stop_steps
rm -rf "$RUN_DIR/private"  # the job's fleet secret: nothing may use it once the job ends
exit "$status"
