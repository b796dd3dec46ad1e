#!/usr/bin/env bash
# A tree looked over again after a pause, through the mount with the old default timeout
# (--attr-timeout 1) and the new one (auto: 60 s over a local lower), against the lower alone.
#
#   again.sh PMSTACK TREE_TAR REPS [PAUSE_S]
#
# One 1 GiB ext4 loop image under LOWER_BASE (default /var/tmp) holds three copies of the
# tree: one looked at directly, one under each mount. Each repetition, in an order that
# alternates, pauses PAUSE_S seconds (default 2) before each look and times `find -ls`,
# `du -s` and `ls -lR` of the copy, each on its own. The first look of each mount fills
# the kernel's cache and is not counted. Prints milliseconds per command and configuration:
# runs, median, ratio to the lower alone.
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,11p "$0"; exit 2; }
p=$1 tar=$2 reps=$3 pause=${4:-2}
work=$(mktemp -d "${LOWER_BASE:-/var/tmp}/pmstack-again-XXXXXX")
img=$work/img mnt=$work/mnt
cleanup() {
  for m in ttl1 auto; do "$p" umount "$mnt/m-$m" >/dev/null 2>&1 || true; done
  umount "$mnt" 2>/dev/null || true
  rm -rf "$work" /dev/shm/pmstack-again-$$-*.pm
}
trap cleanup EXIT
mkdir -p "$mnt"
fallocate -l 1G "$img"
mkfs.ext4 -q -F "$img"
mount -o loop "$img" "$mnt"
for d in alone l-ttl1 l-auto m-ttl1 m-auto; do mkdir "$mnt/$d"; done
for d in alone l-ttl1 l-auto; do tar -xf "$tar" -C "$mnt/$d"; done
sync -f "$mnt"
"$p" mount --attr-timeout 1 --pm /dev/shm/pmstack-again-$$-1.pm --pm-size 64M "$mnt/l-ttl1" "$mnt/m-ttl1" 2>/dev/null
"$p" mount --pm /dev/shm/pmstack-again-$$-a.pm --pm-size 64M "$mnt/l-auto" "$mnt/m-auto" 2>/dev/null
ms() { local s e; s=$(date +%s%N); "$@" > /dev/null; e=$(date +%s%N); echo $(( (e - s) / 1000000 )); }
look() {
  echo "find-ls $2 $(ms find "$1" -ls)"
  echo "du-s $2 $(ms du -s "$1")"
  echo "ls-lR $2 $(ms ls -lR "$1")"
}
for d in m-ttl1 m-auto; do look "$mnt/$d" "$d" > /dev/null; done
for i in $(seq 1 "$reps"); do
  if [ $((i % 2)) = 1 ]; then order="alone m-ttl1 m-auto"; else order="m-auto m-ttl1 alone"; fi
  for d in $order; do
    sleep "$pause"
    look "$mnt/$d" "$d"
  done
done | python3 -c '
import sys, statistics as st
r = {}
for l in sys.stdin:
    c, k, v = l.split(); r.setdefault((c, k), []).append(max(int(v), 1))
for c in ["find-ls", "du-s", "ls-lR"]:
    base = st.median(r[(c, "alone")])
    for k in ["alone", "m-ttl1", "m-auto"]:
        m = st.median(r[(c, k)])
        print(f"{c:7} {k:7} {r[(c, k)]} median {m} ms, {base / m:.2f}x of the lower alone")'
