#!/usr/bin/env bash
# The measurements that need a machine with at least 16 cores, in one command: weak scaling
# (issue 14), the scale-out of a large keyed count from 4 to 8 workers (issue 17) and the load
# shift on 8 workers (issue 18). Run from the repository root on a machine with python3, numpy,
# msgpack, networkx and Cython, and the wheels of pyzmq, fsspec and prometheus-client in .whl/
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#   --platform manylinux_2_28_x86_64 -d .whl pyzmq fsspec prometheus-client`).
#
#   OUT=/tmp/out bash bench/device16.sh [section ...]
#
# Sections: scaling latency migration autobalance (the default: the first run's figures), and the
# shorter scaling-ends latency-ends precopy autobalance-target (the rerun after the changes), and
# relay (the progress modes compared), relay16 (the same, open loop at 16 workers only), profile
# (worker 0's cProfile and every thread's CPU at 2 and 16 workers), precopy40 (the scale-out with
# the 40 M keys).
#
# Every section writes its full output under $OUT and has its own time limit; the log ends with
# each section's table.
set -u
OUT=${OUT:-bench/out/device16}
mkdir -p "$OUT"
SECTIONS=${*:-scaling latency migration autobalance}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
t0=$(date +%s)
if ! python3 -c "import zmq" 2>/dev/null; then
    pip install -q --no-index --target /tmp/site .whl/*.whl || exit 1
fi
# At most 8 files come back from a device run: the build log stays outside $OUT unless it failed.
python3 setup.py -q build_ext --inplace >/tmp/build.log 2>&1 || { tail -20 /tmp/build.log; exit 1; }
echo "cores: $(nproc); $(python3 --version); built in $(( $(date +%s) - t0 )) s"

section() {  # section NAME LIMIT_S command...
    local name=$1 limit=$2; shift 2
    local s; s=$(date +%s)
    echo "== $name: $*"
    timeout -k 5 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    echo "== $name: rc=$? in $(( $(date +%s) - s )) s (at $(( $(date +%s) - t0 )) s)"
    # Leftover workers of a timed-out run would distort the next section.
    pkill -f "multiprocessing.spawn" 2>/dev/null; sleep 0.5
}

for s in $SECTIONS; do
    case $s in
    scaling)  # closed loop: records/s and records per CPU-second, 1-16 workers
        section scaling 160 python3 bench/scaling.py --workload count q3 --workers 1 2 4 8 16 --runs 3 \
            --records 2000000 --no-latency ;;
    scaling-ends)  # the same at 2 and 16 workers only (the targets compare these)
        section scaling-ends 90 python3 bench/scaling.py --workload count q3 --workers 2 16 --runs 3 \
            --records 2000000 --no-latency ;;
    latency)  # Q3 on Megaphone, open loop at the 125k events/s per worker
        section latency 120 python3 bench/scaling.py --workload q3-flex --workers 2 4 8 16 --runs 2 \
            --latency-only --rate 125000 --duration 6 ;;
    latency-ends)
        section latency-ends 80 python3 bench/scaling.py --workload q3-flex --workers 2 8 16 --runs 2 \
            --latency-only --rate 125000 --duration 6 ;;
    relay)  # progress direct or through worker 0, alternating: closed-loop Q3 and the open loop's latency
        section relay 150 python3 bench/scaling.py --workload q3 --workers 8 16 --runs 3 --no-latency \
            --progress direct relay
        section relay-latency 120 python3 bench/scaling.py --workload q3-flex --workers 8 16 --runs 2 \
            --latency-only --rate 125000 --duration 6 --progress direct relay ;;
    relay16)  # the open loop's latency at 16 workers, progress direct or through worker 0
        section relay16 70 python3 bench/scaling.py --workload q3-flex --workers 16 --runs 2 \
            --latency-only --rate 125000 --duration 6 --progress direct relay ;;
    profile)  # where worker 0's CPU goes, and the CPU of every worker thread, at 2 and 16 workers
        section profile-open 60 python3 bench/worker_profile.py --workload q3-flex --workers 2 16 \
            --rate 125000 --duration 6 --top 25 --dir /tmp/prof
        section profile-closed 45 python3 bench/worker_profile.py --workload q3 --workers 2 16 \
            --events 8000000 --window 0 --top 25 --dir /tmp/prof ;;
    precopy40)  # the 40 M keys, 4 -> 8 workers: pre-copy at the default (idle-paced) share, and restart
        section precopy40 110 python3 bench/migration.py --workers 8 --spare 4 --keys 40000000 \
            --rate 400000 --duration 20 --migrate-at 5 --runs 1 --strategies batched+precopy,restart \
            --out /tmp/precopy40 --no-plot ;;
    migration)  # scale-out 4 -> 8 workers of a large keyed count, every strategy in the same run
        section migration 150 python3 bench/migration.py --workers 8 --spare 4 --keys 10000000 \
            --rate 400000 --duration 14 --migrate-at 5 --runs 1 \
            --strategies batched,batched+precopy,all_at_once,restart --out "$OUT" ;;
    precopy)  # the same scale-out: pre-copy at the default share and at 20%, and stop-and-restart
        section precopy 80 python3 bench/migration.py --workers 8 --spare 4 --keys 10000000 \
            --rate 400000 --duration 14 --migrate-at 5 --runs 1 --strategies batched+precopy,restart \
            --out "$OUT" --no-plot
        section precopy-share 45 python3 bench/migration.py --workers 8 --spare 4 --keys 10000000 \
            --rate 400000 --duration 14 --migrate-at 5 --runs 1 --strategies batched+precopy \
            --precopy-share 0.2 --out "$OUT/share" --no-plot ;;
    autobalance)  # the load shift on 8 workers (no rebalancing, AutoBalancer, best static table)
        section autobalance 70 python3 bench/autobalance.py --workers 8 --rate 32000 --seconds 10 --runs 1 ;;
    autobalance-target)  # AutoBalancer against the best static table, 10 s after the shift
        section autobalance-target 70 python3 bench/autobalance.py --workers 8 --rate 32000 --seconds 20 \
            --modes auto static --runs 1 ;;
    *) echo "unknown section $s"; exit 2 ;;
    esac
done
echo "== total $(( $(date +%s) - t0 )) s"
for f in "$OUT"/*.txt; do echo "---- $f"; grep -v "^run \|^plot\|^json" "$f" | tail -n 14; done
