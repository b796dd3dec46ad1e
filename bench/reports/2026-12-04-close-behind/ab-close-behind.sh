#!/bin/bash
# usage: ab-close-behind.sh BASE THREADS ROUNDS: varmail in BASE/alone, BASE/cto (a daemon of the
# experiment/close-behind build started with --close-to-open) and BASE/run (its daemon without it).
B=$1; T=$2; R=$3
P=${BUILD:-/work/main/target}/release/pmstack; F=${BUILD:-/work/main/target}/release/examples/fsload
o() { python3 -c 'import json,sys; print(int(json.load(sys.stdin)["ops_per_s"]))'; }
for r in $(seq 1 $R); do
  a=$($F --personality varmail --threads $T --seconds 3 --dir $B/alone | o); sleep 1
  if [ $((r % 2)) = 0 ]; then
    b=$($P run --root $B/run -- $F --personality varmail --threads $T --seconds 3 --dir $B/run | o); sleep 1
    c=$($P run --root $B/cto -- $F --personality varmail --threads $T --seconds 3 --dir $B/cto | o); sleep 1
  else
    c=$($P run --root $B/cto -- $F --personality varmail --threads $T --seconds 3 --dir $B/cto | o); sleep 1
    b=$($P run --root $B/run -- $F --personality varmail --threads $T --seconds 3 --dir $B/run | o); sleep 1
  fi
  echo "$a $c $b"
done | python3 -c '
import sys, statistics as s
rows=[list(map(int,l.split())) for l in sys.stdin]
for r in rows: print(*r)
m=[s.median(c) for c in zip(*rows)]
print("median alone %d close-to-open %d (%.2fx) behind %d (%.2fx)" % (m[0], m[1], m[1]/m[0], m[2], m[2]/m[0]))'
