#!/bin/bash
# usage: ab-varmail.sh BASE THREADS ROUNDS: varmail in BASE/alone (the lower alone), BASE/old (served by
# the BEFORE build's daemon, its library) and BASE/run (the AFTER build's), interleaved, medians.
# Start both daemons first: $BEFORE/release/pmstack serve BASE/old; $AFTER/release/pmstack serve BASE/run
B=$1; T=$2; R=$3
N=${AFTER:-/work/main/target}/release/pmstack; O=${BEFORE:-/tmp/before/target}/release/pmstack; F=${AFTER:-/work/main/target}/release/examples/fsload
o() { python3 -c 'import json,sys; print(int(json.load(sys.stdin)["ops_per_s"]))'; }
old() { PMSTACK_PRELOAD=${BEFORE:-/tmp/before/target}/release/libpmstack_preload.so $O run --root $B/old -- $F --personality varmail --threads $T --seconds 3 --dir $B/old | o; }
new() { $N run --root $B/run -- $F --personality varmail --threads $T --seconds 3 --dir $B/run | o; }
for r in $(seq 1 $R); do
  a=$($F --personality varmail --threads $T --seconds 3 --dir $B/alone | o); sleep 1
  if [ $((r % 2)) = 0 ]; then b=$(new); sleep 1; c=$(old); sleep 1; else c=$(old); sleep 1; b=$(new); sleep 1; fi
  echo "$a $c $b"
done | python3 -c '
import sys, statistics as s
rows=[list(map(int,l.split())) for l in sys.stdin]
for r in rows: print(*r)
m=[s.median(c) for c in zip(*rows)]
print("median alone %d before %d (%.2fx) after %d (%.2fx)" % (m[0], m[1], m[1]/m[0], m[2], m[2]/m[0]))'
