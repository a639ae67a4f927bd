#!/usr/bin/env bash
# Run the timing-sensitive test files N times under a CPU hog (stress-ng busy on one core,
# at normal priority, while the tests run at nice 10), and count the failures.
#   bench/contention_runs.sh [runs=10] [hogs=1]
# Needs stress-ng (Debian: apt-get install -y stress-ng).
set -u
runs=${1:-10}
hogs=${2:-1}
python=${PYTHON:-/work/main/.venv/bin/python}
files=(tests/server/test_hardening_shutdown.py tests/server/test_loadtest_live.py)
stress-ng --cpu "$hogs" --timeout 0 --quiet &
hog=$!
trap 'kill "$hog" 2>/dev/null' EXIT
failures=0
for run in $(seq 1 "$runs"); do
    start=$(date +%s)
    if nice -n 10 "$python" -m pytest -q -p no:cacheprovider "${files[@]}" >"/tmp/contention-$run.log" 2>&1; then
        verdict=pass
    else
        verdict=FAIL
        failures=$((failures + 1))
    fi
    echo "run $run: $verdict in $(($(date +%s) - start)) s, load $(cut -d' ' -f1-3 /proc/loadavg): $(tail -1 "/tmp/contention-$run.log")"
done
echo "failures: $failures of $runs runs"
