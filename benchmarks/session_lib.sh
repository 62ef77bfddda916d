# Shared by the GPU session scripts (source it): the gpu-marked tests in parallel groups.
#   run_test_groups PREFIX LIMIT "group 1 args" "group 2 args" ...
# runs `pytest -m gpu` on each group at once, each under `timeout LIMIT`, logs to
# $OUT/PREFIX_<i>.log with the exit status appended; waits for every group.
run_test_groups() {
  local prefix=$1 limit=$2
  shift 2
  local groups=("$@") pids=() i
  for i in "${!groups[@]}"; do
    # shellcheck disable=SC2086
    timeout "$limit" python -m pytest -q -m gpu -p no:cacheprovider ${groups[$i]} \
      >"$OUT/${prefix}_$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    echo "pytest exit: $?" >>"$OUT/${prefix}_$i.log"
  done
}

# print_test_logs PREFIX: the failures and the summary line of each group's log.
print_test_logs() {
  local log
  for log in "$OUT/$1"_*.log; do
    [[ -f $log ]] && { echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|pytest exit" "$log" | tail -8; }
  done
}
