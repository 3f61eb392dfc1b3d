# Shared by sanity.sh and agent_sanity.sh (sourced): run independent jobs JOBS at a time, one thread each
# (small matrices scale badly across threads), each logging to $LOGS/NAME.log; the first failure stops the
# others (a rerun must not race them) and names its log.
in_parallel() {  # in_parallel "NAME COMMAND..." ...
    local threads=$(($(nproc) / JOBS)) spec pids=() names=()
    mkdir -p "$LOGS"
    for spec in "$@"; do
        while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 2; done
        OMP_NUM_THREADS=$((threads > 0 ? threads : 1)) bash -c "${spec#* }" > "$LOGS/${spec%% *}.log" 2>&1 &
        pids+=($!) names+=("${spec%% *}")
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || {
            # `|| true`: under the callers' set -e a pkill that matches nothing (a job bash exec'd into its one
            # command has no children) would end the script here and leave the other jobs running
            for p in $(jobs -rp); do pkill -P "$p" || true; kill "$p" || true; done 2>/dev/null
            echo "$(basename "$0"): ${names[$i]} failed, see $LOGS/${names[$i]}.log"; exit 1; }
        echo "done: ${names[$i]}"
    done
}
