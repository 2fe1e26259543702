# shellcheck shell=bash
# The body of every megarl SLURM job, sourced by the job scripts (slurm/guru_moe.sh, slurm/guru_7b.sh) after they
# set their defaults. It runs three kinds of steps in one allocation:
#
#   prepare   one task on the first node: `megarl prepare` (run directory, resolved config, fresh fleet secret)
#   serve     one step per rollout replica on the rollout nodes: `megarl serve --replica i` (vLLM, TP rollout.tp)
#   rank      one step on the trainer nodes: trainer.world_size tasks of `megarl rank`
#
# and exits with the trainer's status: 0 if the trainer ranks finished with 0, else 1. A replica whose step ends
# while the trainer runs is started again, the same step on the same node, at most ROLLOUT_RESTARTS times
# (rollout.restarts); then it stays down and the trainer goes on with the replicas left (it fails by itself below
# rollout.min_replicas). Every step's output goes to $RUN_DIR/logs/; the job's own output file gets one line per
# event. Settings (environment variables, all optional; the job script sets the defaults): docs/cluster.md.
#
# Every step states its own resources (nodes, tasks, CPUs, GPUs, memory): a replica holds exactly rollout.tp GPUs
# of its node, the trainer step one GPU per rank, and no job-level option (#SBATCH --gpus-per-node, --mem, ...)
# reaches a step by inheritance. A step SLURM cannot start within STEP_START_S fails the job, named (a restarted
# replica's is named too, and the replica stays down).
#
# MEGARL_PREFLIGHT=1 runs the same steps, at the same places, as checks instead (`megarl preflight`): each reports
# its node, ranks and GPUs, whether the run directory is shared, the stores and servers reachable from the other
# role's nodes and the model readable; the job prints one table and exits 1 naming every problem. No weights load.

set -euo pipefail

: "${MEGARL_CONFIG:?the job script sets it: the recipe}" "${TRAINER_NODES:?the job script sets it: nodes for the trainer}"
MEGARL_HOME=${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}  # the megarl checkout: recipes are read relative to it
MEGARL=${MEGARL:-megarl}                   # how to run megarl on the nodes, e.g. "/opt/venv/bin/megarl"
MEGARL_TRAINER_ENV=${MEGARL_TRAINER_ENV:-} # a venv on the nodes for the trainer's steps (prepare, ranks): its megarl
MEGARL_FLEET_ENV=${MEGARL_FLEET_ENV:-}     # a venv on the nodes for the replicas' steps; either empty: $MEGARL
MEGARL_OVERRIDES=${MEGARL_OVERRIDES:-}     # extra section.field=value overrides, space separated
RUN_DIR=${RUN_DIR:-}                       # run.dir override (a shared filesystem); empty: the recipe's run.dir
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}  # GPUs per node (default: the job's); 0: CPU nodes
TRAINER_TASKS_PER_NODE=${TRAINER_TASKS_PER_NODE:-$(( GPUS_PER_NODE > 0 ? GPUS_PER_NODE : 1 ))}  # ranks per trainer node
CONTAINER_IMAGE=${CONTAINER_IMAGE:-}       # pyxis/enroot image for every step; empty: run on the host
TRAINER_CONTAINER_IMAGE=${TRAINER_CONTAINER_IMAGE:-$CONTAINER_IMAGE}  # the trainer's steps' image (and prepare's)
FLEET_CONTAINER_IMAGE=${FLEET_CONTAINER_IMAGE:-$CONTAINER_IMAGE}      # the replicas' image
CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-}     # pyxis mounts, e.g. /lustre:/lustre (the run dir must be visible)
STOP_GRACE_S=${STOP_GRACE_S:-60}           # how long a stopping step may take before it is killed
STEP_START_S=${STEP_START_S:-45}           # a step SLURM has not started after this long fails the job
ROLLOUT_RESTARTS=${ROLLOUT_RESTARTS:-}     # restarts of each replica that dies; empty: the config's rollout.restarts
POLL_S=${POLL_S:-5}                        # how often the job checks its steps
MEGARL_PREFLIGHT=${MEGARL_PREFLIGHT:-0}    # 1: check the job's placement, network and files instead of training

say() { printf 'megarl job %s: %s\n' "${SLURM_JOB_ID:-?}" "$*" >&2; }
if [[ -n $ROLLOUT_RESTARTS && ! $ROLLOUT_RESTARTS =~ ^[0-9]+$ ]]; then
    say "ROLLOUT_RESTARTS=$ROLLOUT_RESTARTS is not a number of restarts: set it to 0, 1, 2, ... or leave it unset" \
        "(the config's rollout.restarts)"
    exit 2
fi

# sbatch exports the job's own options to this script, and srun reads them as defaults for every step: with
# `#SBATCH --gpus-per-node=8` each replica step would take all 8 GPUs of its node (`--gpus=4` does not reset it)
# and the next step on that node would wait forever; with a job-level --mem each step would take the node's memory.
# Every srun below states its resources instead.
unset SLURM_GPUS_PER_NODE SLURM_GPUS_PER_TASK SLURM_GPUS_PER_SOCKET SLURM_GPUS SLURM_CPUS_PER_GPU SLURM_GRES \
    SLURM_MEM_PER_NODE SLURM_MEM_PER_CPU SLURM_MEM_PER_GPU SLURM_CPUS_PER_TASK SRUN_CPUS_PER_TASK \
    SLURM_NTASKS_PER_NODE SLURM_NTASKS_PER_GPU SLURM_NTASKS_PER_SOCKET SLURM_NTASKS_PER_CORE SLURM_TRES_PER_TASK \
    SLURM_NTASKS SLURM_NPROCS SLURM_DISTRIBUTION SLURM_EXCLUSIVE SLURM_OVERLAP

read -r -a megarl_cmd <<< "$MEGARL"
read -r -a overrides <<< "$MEGARL_OVERRIDES"
if [[ -n $RUN_DIR ]]; then overrides+=("run.dir=$RUN_DIR"); fi
# Each role runs from its own environment: the trainer's steps (prepare, the ranks, the preflight report) and the
# replicas' steps each from a venv (MEGARL_TRAINER_ENV / MEGARL_FLEET_ENV: its bin/megarl) and/or a container image
# (TRAINER_CONTAINER_IMAGE / FLEET_CONTAINER_IMAGE); unset, both run $MEGARL in CONTAINER_IMAGE (or on the host).
role_megarl() {  # role_megarl VAR IMAGE: the command of a role whose environment variable VAR names a venv, or $MEGARL
    local venv=${!1}
    if [[ -z $venv ]]; then printf '%s\n' "${megarl_cmd[@]}"; return 0; fi
    if [[ -z $2 && ! -x $venv/bin/megarl ]]; then  # in a container the venv is the image's: not checked here
        say "$1=$venv has no bin/megarl on this node: point it at a venv with megarl installed, on a filesystem" \
            "every node mounts (docs/cluster.md, \"Each role's environment\")"
        return 1
    fi
    echo "$venv/bin/megarl"
}
mapfile -t trainer_megarl < <(role_megarl MEGARL_TRAINER_ENV "$TRAINER_CONTAINER_IMAGE") && (( ${#trainer_megarl[@]} )) \
    || exit 2
mapfile -t fleet_megarl < <(role_megarl MEGARL_FLEET_ENV "$FLEET_CONTAINER_IMAGE") && (( ${#fleet_megarl[@]} )) || exit 2
container_options() {  # container_options IMAGE: srun's pyxis options for a step in IMAGE; none for the host
    if [[ -n $1 ]]; then
        printf '%s\n' --container-image="$1" --container-workdir="$MEGARL_HOME"
        if [[ -n $CONTAINER_MOUNTS ]]; then echo "--container-mounts=$CONTAINER_MOUNTS"; fi
    fi
}
mapfile -t trainer_container < <(container_options "$TRAINER_CONTAINER_IMAGE")
mapfile -t fleet_container < <(container_options "$FLEET_CONTAINER_IMAGE")
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( TRAINER_NODES < 1 || TRAINER_NODES >= ${#nodes[@]} )); then
    say "TRAINER_NODES=$TRAINER_NODES but the job has ${#nodes[@]} node(s): the trainer needs at least one and" \
        "the rollout replicas at least one of their own (sbatch --nodes=N, TRAINER_NODES=k < N)"
    exit 2
fi
trainer_hosts_list=("${nodes[@]:0:TRAINER_NODES}")
rollout_hosts=("${nodes[@]:TRAINER_NODES}")
cd "$MEGARL_HOME"

# --- the job's memory on each node (MB), as SLURM allocated it; none when memory is not a scheduled resource -----
declare -A node_mem_mb=()
while read -r hosts mem; do
    [[ -n $hosts && $mem =~ ^[0-9]+$ ]] || continue
    for host in $(scontrol show hostnames "$hosts"); do node_mem_mb[$host]=$mem; done
done < <(scontrol show job --details "$SLURM_JOB_ID" | awk '$1 ~ /^Nodes=/ {
    hosts = substr($1, 7); mem = ""
    for (i = 2; i <= NF; i++) if ($i ~ /^Mem=/) mem = substr($i, 5)
    print hosts, mem }')
mem_option() {  # mem_option MB: the step's --mem, or nothing when memory is not scheduled (0 or unknown)
    if (( ${1:-0} > 0 )); then echo "--mem=$1"; fi
}
gpu_option() {  # gpu_option N: exactly N GPUs on each of the step's nodes; none on CPU nodes
    if (( GPUS_PER_NODE > 0 && $1 > 0 )); then echo "--gpus-per-node=$1"; else echo "--gres=none"; fi
}
cpus_on_node=${SLURM_CPUS_ON_NODE:-1}

# --- prepare: validate the recipe, make the run directory; its stdout is the topology (KEY=VALUE lines) ---------
prepare_args=()
if (( MEGARL_PREFLIGHT )); then
    prepare_args=(--preflight)
    if (( GPUS_PER_NODE > 0 )); then prepare_args+=(--gpu); fi  # the layout as the GPU job would run it
fi
say "preparing ${MEGARL_CONFIG} ${overrides[*]}${prepare_args[*]:+ (${prepare_args[*]})}"
# shellcheck disable=SC2046  # mem_option/gpu_option print one option or none
topology=$(srun --nodes=1 --ntasks=1 --cpus-per-task=1 --nodelist="${nodes[0]}" --job-name=megarl-prepare \
    $(gpu_option 0) $(mem_option "${node_mem_mb[${nodes[0]}]:-0}") "${trainer_container[@]}" \
    "${trainer_megarl[@]}" prepare "${prepare_args[@]}" --config "$MEGARL_CONFIG" "${overrides[@]}") || {
    say "megarl prepare failed (its message is above): nothing was started"
    exit 2
}
config=""
rollout_host_mb=0  # host memory (MB) a GPU fleet's replica step needs; 0: a megarl whose prepare does not say
config_restarts=0  # a megarl whose prepare does not print ROLLOUT_RESTARTS has no trainer that takes a replica back
while IFS='=' read -r key value; do
    case $key in
        RUN_DIR) RUN_DIR=$value ;;
        CONFIG) config=$value ;;
        TRAINER_WORLD_SIZE) world_size=$value ;;
        ROLLOUT_REPLICAS) replicas=$value ;;
        ROLLOUT_TP) rollout_tp=$value ;;
        ROLLOUT_RESTARTS) config_restarts=$value ;;
        ROLLOUT_HOST_MB) rollout_host_mb=$value ;;
    esac
done <<< "$topology"
config=${config:-$RUN_DIR/config.yaml}
restarts=${ROLLOUT_RESTARTS:-$config_restarts}
logs="$RUN_DIR/logs"
if (( MEGARL_PREFLIGHT )); then logs="$RUN_DIR/preflight"; fi
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
if (( GPUS_PER_NODE > 0 && per_node * rollout_tp > GPUS_PER_NODE )); then
    say "ROLLOUT_REPLICAS_PER_NODE=$per_node replicas x rollout.tp=$rollout_tp GPUs exceed the node's" \
        "$GPUS_PER_NODE GPUs (GPUS_PER_NODE): lower ROLLOUT_REPLICAS_PER_NODE"
    exit 2
fi
# CPUs and memory of each replica's step (vLLM's API server, engine core and TP workers): the node's share
cpus_per_replica=${ROLLOUT_CPUS_PER_REPLICA:-$(( cpus_on_node / per_node ))}
if (( cpus_per_replica < 1 )); then cpus_per_replica=1; fi
replica_mem_mb() {  # replica_mem_mb HOST: the --mem (MB) of a replica's step on HOST; 0 when memory is not scheduled
    echo "${ROLLOUT_MEM_PER_REPLICA_MB:-$(( ${node_mem_mb[$1]:-0} / per_node ))}"
}
# On GPUs a replica's step holds its vLLM ranks' host memory and, with sync.receive=staged, each rank's whole shard
# pinned (ROLLOUT_HOST_MB from prepare: megarl.checks.replica_host_mb, as `megarl plan` prints it): a step whose
# --mem is smaller would be killed at its first push, so the job refuses it before anything starts
if (( GPUS_PER_NODE > 0 && rollout_host_mb > 0 )); then
    for (( i = 0; i < replicas; i++ )); do
        host=${rollout_hosts[i / per_node]}
        mem=$(replica_mem_mb "$host")
        if (( mem > 0 && mem < rollout_host_mb )); then
            say "rollout replica $i on $host would get --mem=${mem}M but needs ${rollout_host_mb}M of host memory" \
                "(its vLLM ranks and, staged, their pinned shards: \`megarl plan\`): give the job more memory per" \
                "node, lower ROLLOUT_REPLICAS_PER_NODE, or set sync.receive=streamed (or rollout.replica_host_memory_gb" \
                "to the step's share, and sync.receive=auto picks streamed)"
            exit 2
        fi
    done
fi
if (( world_size > TRAINER_TASKS_PER_NODE * TRAINER_NODES )); then
    say "trainer.world_size=$world_size ranks do not fit $TRAINER_NODES trainer node(s) x" \
        "$TRAINER_TASKS_PER_NODE (TRAINER_TASKS_PER_NODE): add trainer nodes"
    exit 2
fi
if (( GPUS_PER_NODE > 0 && TRAINER_TASKS_PER_NODE > GPUS_PER_NODE )); then
    say "TRAINER_TASKS_PER_NODE=$TRAINER_TASKS_PER_NODE ranks exceed the node's $GPUS_PER_NODE GPUs" \
        "(GPUS_PER_NODE): one GPU per rank"
    exit 2
fi
cpus_per_rank=$(( cpus_on_node / TRAINER_TASKS_PER_NODE ))
if (( cpus_per_rank < 1 )); then cpus_per_rank=1; fi
trainer_mem=0  # one --mem for the whole step: the smallest of its nodes' shares
for host in "${trainer_hosts_list[@]}"; do
    mem=${node_mem_mb[$host]:-0}
    if (( trainer_mem == 0 || (mem > 0 && mem < trainer_mem) )); then trainer_mem=$mem; fi
done

# --- start the fleet and the trainer: every step runs in the background, named, so it can be watched and stopped --
# Step i < replicas is replica i, step `trainer` the trainer. step_pids holds each step's live srun: a restarted
# replica's new one, and "" once a step has ended and been waited for (an old pid could be reused by then).
step_names=()
step_pids=()
step_where=()
run_step() {  # run_step INDEX NAME WHERE SRUN_OPTION... COMMAND...: (re)start step INDEX as srun in the background;
    local index=$1 name=$2 where=$3  # srun's own messages also go to logs/NAME.srun (appended)
    shift 3
    srun --job-name="$name" "$@" 2> >(tee -a "$logs/$name.srun" >&2) &
    step_names[index]=$name
    step_pids[index]=$!
    step_where[index]=$where
}
step_alive() {  # step_alive INDEX: the srun of step INDEX is still running
    [[ -n ${step_pids[$1]} ]] && kill -0 "${step_pids[$1]}" 2>/dev/null
}
reap_step() {  # reap_step INDEX: wait for the srun of step INDEX; its exit code in $step_code, its pid forgotten
    step_code=0
    if [[ -n ${step_pids[$1]} ]]; then wait "${step_pids[$1]}" || step_code=$?; fi
    step_pids[$1]=""
}
step_ids() {  # the SLURM step ids (job.step) of this job's steps called $1
    squeue --noheader --steps --jobs="$SLURM_JOB_ID" --format="%i %j" | awk -v name="$1" '$2 == name { print $1 }'
}
stop_steps() {  # stop_steps [INDEX...] (default: all): SIGTERM to the tasks of each step still running; SIGKILL to
    local i id ids deadline=$(( SECONDS + STOP_GRACE_S )) which=("$@")  # those alive after STOP_GRACE_S
    if (( ${#which[@]} == 0 )); then which=("${!step_pids[@]}"); fi
    for i in "${which[@]}"; do
        if step_alive "$i"; then
            ids=$(step_ids "${step_names[i]}" || true)
            for id in $ids; do scancel --signal=TERM "$id" 2>/dev/null || true; done
            if [[ -z $ids ]]; then kill -TERM "${step_pids[i]}" 2>/dev/null || true; fi  # its srun still waits for
        fi  # SLURM to create the step: it gives up
    done
    for i in "${which[@]}"; do
        while step_alive "$i" && (( SECONDS < deadline )); do sleep 1; done
        if step_alive "$i"; then
            say "${step_names[i]} did not stop within ${STOP_GRACE_S}s (STOP_GRACE_S): killing it"
            for id in $(step_ids "${step_names[i]}"); do scancel --signal=KILL "$id" 2>/dev/null || true; done
            kill -KILL "${step_pids[i]}" 2>/dev/null || true  # an srun still waiting for its step to be created
        fi
        reap_step "$i"
    done
}
clean_up() {  # the job's secret: nothing may use it once the job ends
    if (( ! MEGARL_PREFLIGHT )); then rm -rf "$RUN_DIR/private"; fi
}
# shellcheck disable=SC2317  # called by the trap
on_signal() {
    say "job signalled: stopping every step"
    stop_steps
    clean_up
    exit 143
}
trap on_signal TERM INT
holders_of() {  # holders_of NODE: this job's running steps on NODE and what they hold, as scontrol lists them
    local hosts name tres
    while read -r hosts name tres; do
        if scontrol show hostnames "$hosts" | grep -qxF "$1"; then printf '%s (%s), ' "$name" "$tres"; fi
    done < <(scontrol --oneliner show step 2>/dev/null | awk -v job="$SLURM_JOB_ID" '{
        delete v
        for (i = 1; i <= NF; i++) { k = $i; sub(/=.*/, "", k); v[k] = substr($i, length(k) + 2) }
        split(v["StepId"], id, ".")
        if (id[1] != job || v["State"] != "RUNNING" || v["Name"] == "batch" || v["Name"] == "extern") next
        print v["NodeList"], v["Name"], v["TRES"] (v["TresPerNode"] == "" ? "" : "," v["TresPerNode"]) }')
}
declare -A step_stale=()  # index -> ids (job.step) of its ended steps, which squeue may still list while they complete
await_steps() {  # await_steps INDEX...: wait at most STEP_START_S for SLURM to run these steps; $pending: those it
    local i id name ok running deadline=$(( SECONDS + STEP_START_S ))  # still keeps pending
    while :; do
        running=$(squeue --noheader --steps --jobs="$SLURM_JOB_ID" --format="%i %j" || true)
        pending=()
        for i in "$@"; do  # an srun that already ended is not pending (the watch below judges it)
            ok=0
            while read -r id name; do  # a step of its name that is not one of its ended ones
                if [[ $name == "${step_names[i]}" && " ${step_stale[$i]:-} " != *" $id "* ]]; then ok=1; fi
            done <<< "$running"
            if step_alive "$i" && (( ! ok )); then pending+=("$i"); fi
        done
        if (( ${#pending[@]} == 0 || SECONDS >= deadline )); then return 0; fi
        sleep 1
    done
}
pending_line() {  # pending_line INDEX: why step INDEX is not running, in one line (srun's last message since the
    local reason holders  # step was last started: a restart writes a "--- " line into its .srun log first)
    reason=$(awk '/^--- / { reason = "" } /^srun: / { reason = $0 } END { print reason }' \
        "$logs/${step_names[$1]}.srun" 2>/dev/null || true)
    holders=$(holders_of "${step_where[$1]%%,*}")
    holders=${holders%, }
    holders=${holders:+ steps of this job hold that node: $holders;}
    echo "step ${step_names[$1]} on ${step_where[$1]} did not start within ${STEP_START_S}s (STEP_START_S): SLURM" \
        "keeps it pending;$holders ${reason:-srun gave no reason yet}"
}
wait_for_steps_to_start() {  # fail the job, naming them, if some steps are still not running after STEP_START_S
    local i
    await_steps "${!step_pids[@]}"
    if (( ${#pending[@]} == 0 )); then return 0; fi
    for i in "${pending[@]}"; do
        say "FAILED: $(pending_line "$i")"
        kill -TERM "${step_pids[i]}" 2>/dev/null || true  # an srun still waiting for its step gives up
    done
    say "stopping the job's other steps"
    stop_steps
    clean_up
    exit 1
}

if (( MEGARL_PREFLIGHT )); then
    serve_cmd=(preflight serve)
    rank_cmd=(preflight rank)
else
    serve_cmd=(serve)
    rank_cmd=(rank)
fi
start_replica() {  # start_replica I [RESTART]: replica I's step on its node; a restart appends to the replica's logs
    local i=$1 restart=${2:-0} host=${rollout_hosts[$1 / per_node]} replica_mem open=() again=() on_node
    replica_mem=$(replica_mem_mb "$host")
    on_node=$(( replicas - i / per_node * per_node ))  # the replicas the job puts on this node: per_node, or fewer
    if (( on_node > per_node )); then on_node=$per_node; fi  # on the last node
    if (( restart > 0 )); then open=(--open-mode=append) again=(--restart); fi
    # MEGARL_NODE_REPLICAS: on CPU nodes the replica's TP workers take a slot of their own among the cores the
    # step may use, shared by the node's on_node replicas, unless SLURM confined the step to cores of its own
    # (megarl/rollout/cpu_binding.py)
    # shellcheck disable=SC2046
    run_step "$i" "megarl-serve-$i" "$host" --nodes=1 --ntasks=1 --cpus-per-task="$cpus_per_replica" --exact \
        --export="ALL,MEGARL_NODE_REPLICAS=$on_node" $(gpu_option "$rollout_tp") $(mem_option "$replica_mem") \
        --nodelist="$host" \
        --output="$logs/serve_replica$i.log" "${open[@]}" "${fleet_container[@]}" \
        "${fleet_megarl[@]}" "${serve_cmd[@]}" --config "$config" --replica "$i" "${again[@]}"
}
for (( i = 0; i < replicas; i++ )); do
    : > "$logs/megarl-serve-$i.srun"
    start_replica "$i"
done
trainer=$replicas
trainer_hosts=$(IFS=,; echo "${trainer_hosts_list[*]}")
: > "$logs/megarl-rank.srun"
# shellcheck disable=SC2046
run_step "$trainer" megarl-rank "$trainer_hosts" --nodes="$TRAINER_NODES" --ntasks="$world_size" \
    --ntasks-per-node="$TRAINER_TASKS_PER_NODE" --cpus-per-task="$cpus_per_rank" --exact \
    $(gpu_option "$TRAINER_TASKS_PER_NODE") $(mem_option "$trainer_mem") --nodelist="$trainer_hosts" \
    --kill-on-bad-exit=1 --output="$logs/trainer_rank%t.log" "${trainer_container[@]}" \
    "${trainer_megarl[@]}" "${rank_cmd[@]}" --config "$config"
say "fleet: $replicas replica(s) on ${rollout_hosts[*]}; trainer: $world_size rank(s) on ${trainer_hosts_list[*]};" \
    "logs in $logs"
wait_for_steps_to_start

# --- preflight: every check step ends by itself; then one table, and every problem named ---------------------------
if (( MEGARL_PREFLIGHT )); then
    status=0
    for i in "${!step_pids[@]}"; do
        reap_step "$i"
        if (( step_code != 0 )); then say "preflight step ${step_names[i]} exited with code $step_code"; fi
    done
    scontrol show job --details "$SLURM_JOB_ID" > "$logs/allocation.txt" || true
    # shellcheck disable=SC2046
    srun --job-name=megarl-preflight-report --nodes=1 --ntasks=1 --cpus-per-task=1 --nodelist="${nodes[0]}" \
        $(gpu_option 0) $(mem_option "${node_mem_mb[${nodes[0]}]:-0}") "${trainer_container[@]}" \
        "${trainer_megarl[@]}" preflight report --config "$config" --allocation "$logs/allocation.txt" || status=$?
    exit "$status"
fi

# --- watch: until the trainer ends. A replica whose step ends before it is started again, the same step on the same
# node, at most $restarts times; then it stays down and the trainer goes on with the replicas left (it fails by itself
# below rollout.min_replicas). The job's status is the trainer's.
restarts_made=()  # per replica: how many times it was restarted
exit_codes=()     # per replica: the exit codes of its steps that ended while the trainer ran, e.g. "137,137"
down=()           # per replica: 1 once it stays down
logs_of() {  # logs_of I: where to read why replica I ended
    echo "see $logs/serve_replica$1.log and $logs/vllm_replica$1.log"
}
replica_ended() {  # replica_ended I: replica I's step has ended while the trainer runs: restart it, or leave it down
    local i=$1 restart=$(( ${restarts_made[$1]:-0} + 1 )) when
    reap_step "$i"
    exit_codes[i]=${exit_codes[i]:+${exit_codes[i]},}$step_code
    if (( restart > restarts )); then
        down[i]=1
        say "rollout replica $i exited with code $step_code ($(logs_of "$i")); it stays down (no restart left:" \
            "ROLLOUT_RESTARTS=$restarts); the trainer goes on with the replicas left and fails below" \
            "rollout.min_replicas"
        return 0
    fi
    restarts_made[i]=$restart
    say "rollout replica $i exited with code $step_code ($(logs_of "$i")); restarting it (restart $restart of" \
        "$restarts)"
    # its logs go on where the ended start's stop (`megarl serve --restart` appends to the vLLM log), after a line
    # each, the vLLM log's as `megarl train` writes it when it restarts a replica of its own fleet
    say "restart $restart of $restarts of rollout replica $i (its step exited with code $step_code)" \
        2>> "$logs/serve_replica$i.log" || true
    when=$(date -u '+%Y-%m-%d %H:%M:%S UTC')
    printf '\n===== megarl: restart %s of %s of rollout replica %s (%s) =====\n' "$restart" "$restarts" "$i" "$when" \
        >> "$logs/vllm_replica$i.log" || true
    printf -- '--- megarl job %s: restart %s of %s\n' "${SLURM_JOB_ID:-?}" "$restart" "$restarts" \
        >> "$logs/megarl-serve-$i.srun" || true
    step_stale[$i]="${step_stale[$i]:-} $(step_ids "${step_names[i]}" | tr '\n' ' ' || true)"
    start_replica "$i" "$restart"
    await_steps "$i"
    if (( ${#pending[@]} )); then  # as at the job's start, but the job goes on without it
        say "$(pending_line "$i"); rollout replica $i stays down (restart $restart of $restarts did not start)"
        kill -TERM "${step_pids[i]}" 2>/dev/null || true  # an srun still waiting for its step gives up
        stop_steps "$i"
        down[i]=1
    fi
}
while step_alive "$trainer"; do
    for (( i = 0; i < replicas; i++ )); do
        if [[ -z ${down[i]:-} ]] && ! step_alive "$i" && step_alive "$trainer"; then replica_ended "$i"; fi
    done
    sleep "$POLL_S"
done
reap_step "$trainer"
trainer_code=$step_code
died=""  # the replicas whose steps ended while the trainer ran, or as it ended: the likely cause of its failure
for (( i = 0; i < replicas; i++ )); do
    state="up again"
    if [[ -n ${step_pids[i]} ]] && ! step_alive "$i"; then  # ended as the trainer did: not restarted
        reap_step "$i"
        exit_codes[i]=${exit_codes[i]:+${exit_codes[i]},}$step_code
        state="not restarted"
    elif [[ -n ${down[i]:-} ]]; then
        state="down"
    fi
    if [[ -n ${exit_codes[i]:-} ]]; then
        codes="exit code ${exit_codes[i]}"
        if [[ ${exit_codes[i]} == *,* ]]; then codes="exit codes ${exit_codes[i]}"; fi
        died="${died:+$died; }replica $i ($codes; restarted ${restarts_made[i]:-0} of $restarts time(s); $state;"
        died+=" $(logs_of "$i"))"
    fi
done
status=0
if (( trainer_code != 0 )); then
    say "FAILED: the trainer ranks exited with code $trainer_code (see $logs/trainer_rank*.log)"
    if [[ -n $died ]]; then say "rollout replica(s) that died before it, the likely cause: $died"; fi
    say "stopping the job's other steps"
    status=1
else
    say "trainer finished; outputs in $RUN_DIR (summary.json, metrics.jsonl)"
    if [[ -n $died ]]; then say "rollout replica(s) that died during the run: $died"; fi
fi
stop_steps
clean_up
exit "$status"
