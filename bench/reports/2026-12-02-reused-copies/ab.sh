#!/usr/bin/env bash
# Two builds of the preload library side by side under `pmstack run`, interleaved:
#
#   [ROOT=SERVED] ab.sh DIR BEFORE.so AFTER.so [REPS]
#
# DIR: a directory under SERVED (default: DIR itself), which `pmstack serve` serves (by the
# build of this checkout). Runs fio (psync, 64 MiB file, 3 s) REPS (5) times with each
# library in turn (PMSTACK_PRELOAD): 64 KiB and 4 KiB sequential O_SYNC writes, 4 KiB random
# writes each followed by fsync (or $WORKLOADS); prints each one's runs (IOPS), medians and
# their ratio.
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,9p "$0"; exit 2; }
dir=$1 before=$2 after=$3 reps=${4:-5}
pmstack="$(cd "$(dirname "$0")/../../.." && pwd)/target/release/pmstack"
fiojob() { # lib, args...
  local lib=$1; shift
  rm -f "$dir"/job.*
  PMSTACK_PRELOAD=$lib "$pmstack" run --require-daemon --root "${ROOT:-$dir}" -- fio --name=job --directory="$dir" \
    --runtime=3000ms --time_based --ioengine=psync --size=64M "$@" --output-format=json |
    python3 -c "import json, sys; print(int(json.load(sys.stdin)['jobs'][0]['write']['iops']))"
}
# WORKLOADS: other fio job options to run instead, separated by ';'.
IFS=';' read -r -a jobs <<< "${WORKLOADS:---rw=write --bs=64k --sync=1;--rw=write --bs=4k --sync=1;--rw=randwrite --bs=4k --fsync=1}"
for w in "${jobs[@]}"; do
  for _ in $(seq 1 "$reps"); do
    echo "before $(fiojob "$before" $w)"
    echo "after $(fiojob "$after" $w)"
  done | python3 -c "
import collections, statistics, sys
d = collections.defaultdict(list)
for l in sys.stdin:
    m, v = l.split()
    d[m].append(int(v))
b, a = statistics.median(d['before']), statistics.median(d['after'])
print('$w:', 'before', d['before'], 'median', b, '| after', d['after'], 'median', a, '| after/before %.2f' % (a / b))
"
done
