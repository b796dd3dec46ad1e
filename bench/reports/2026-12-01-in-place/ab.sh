#!/usr/bin/env bash
# Two builds of the preload library side by side under `pmstack run`, interleaved:
#
#   ab.sh DIR BEFORE.so AFTER.so [REPS]
#
# DIR: a directory `pmstack serve` serves (by the build of this checkout). Runs, REPS (5)
# times each, in turn with each library (PMSTACK_PRELOAD): fio's 64-byte sequential O_SYNC
# writes (psync, 3 s), and a Python loop that creates, writes and closes 3,000 files and
# removes them; prints each one's runs and median. varmail: bench/ab-run with two
# directories holding the same pmstack binary beside each library.
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,10p "$0"; exit 2; }
dir=$1 before=$2 after=$3 reps=${4:-5}
pmstack="$(cd "$(dirname "$0")/../../.." && pwd)/target/release/pmstack"
osync() {
  rm -f "$dir/job.0.0"
  PMSTACK_PRELOAD=$1 "$pmstack" run --require-daemon --root "$dir" -- fio --name=job --directory="$dir" \
    --runtime=3000ms --time_based --ioengine=psync --size=64M --rw=write --bs=64 --sync=1 --output-format=json |
    python3 -c "import json, sys; print(int(json.load(sys.stdin)['jobs'][0]['write']['iops']))"
}
pyloop() {
  mkdir -p "$dir/py"
  PMSTACK_PRELOAD=$1 "$pmstack" run --require-daemon --root "$dir" -- python3 -c "
import os, sys, time
d = sys.argv[1]
t = time.perf_counter()
for i in range(3000):
    fd = os.open(f'{d}/f{i}', os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b'x' * 100)
    os.close(fd)
for i in range(3000):
    os.unlink(f'{d}/f{i}')
print(round(6000 / (time.perf_counter() - t)))" "$dir/py"
}
for w in osync pyloop; do
  for _ in $(seq 1 "$reps"); do
    echo "before $($w "$before")"
    echo "after $($w "$after")"
  done | python3 -c "
import collections, statistics, sys
d = collections.defaultdict(list)
for l in sys.stdin:
    m, v = l.split()
    d[m].append(int(v))
b, a = statistics.median(d['before']), statistics.median(d['after'])
print('$w', 'before', d['before'], 'median', b, '| after', d['after'], 'median', a, '| after/before %.2f' % (a / b))
"
done
