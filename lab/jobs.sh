# Sourced by the lab scripts: jobs JOBS at a time, nproc/JOBS threads each (THREADS overrides it, for two
# drivers at once), logging to $LOGS/NAME.log, leaving NAME.done or NAME.failed; the first failure stops the
# others and names its log. `after NAME...` waits for earlier jobs of the queue (only earlier ones, so the
# slots never all wait).
in_parallel() {  # in_parallel "NAME COMMAND..." ...
    local threads=${THREADS:-$(($(nproc) / JOBS))} spec name pids=() names=()
    mkdir -p "$LOGS"
    export LOGS
    for spec in "$@"; do rm -f "$LOGS/${spec%% *}".{done,failed}; done
    for spec in "$@"; do
        while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 2; done
        compgen -G "$LOGS/*.failed" > /dev/null && break  # a job failed: start no more
        name=${spec%% *}
        OMP_NUM_THREADS=$((threads > 0 ? threads : 1)) bash -c "set -e; trap 'touch \"$LOGS/$name.failed\"' EXIT
${spec#* }
trap - EXIT; touch '$LOGS/$name.done'" > "$LOGS/$name.log" 2>&1 &
        pids+=($!) names+=("$name")
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || {
            # `|| true`: under set -e a pkill that matches nothing would end the script, the jobs left running
            for p in $(jobs -rp); do pkill -P "$p" || true; kill "$p" || true; done 2>/dev/null
            echo "$(basename "$0"): ${names[$i]} failed, see $LOGS/${names[$i]}.log"; exit 1; }
        echo "done: ${names[$i]}"
    done
}
after() {  # after NAME...: wait until each of these jobs (earlier in the same queue) has succeeded
    local name
    for name; do
        until [ -e "$LOGS/$name.done" ]; do
            [ ! -e "$LOGS/$name.failed" ] || { echo "after: $name failed"; exit 1; }
            sleep 3
        done
    done
}
export -f after
