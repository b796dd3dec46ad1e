import os, sys, time
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
fd = os.open(d, os.O_RDONLY)
lat = []
t_end = time.time() + float(sys.argv[2])
while time.time() < t_end:
    t = time.perf_counter_ns(); os.fsync(fd); lat.append(time.perf_counter_ns() - t)
lat.sort()
print("n %d p50 %.1f us p90 %.1f us p99 %.1f us" % (len(lat), lat[len(lat)//2]/1e3, lat[len(lat)*9//10]/1e3, lat[len(lat)*99//100]/1e3))
