# snap.py PIDS: print "host_busy_s server_cpu_s" (part of bench/compare.sh).
#   host_busy_s   busy CPU seconds of the whole host so far (/proc/stat, all CPUs, not idle/iowait)
#   server_cpu_s  user+sys CPU seconds (including reaped children) of the server processes: every
#                 process whose PID, or an ancestor's PID, is in PIDS (comma list). Ancestors catch
#                 forked workers (smbd's per-client children). By PID, never by name: the lwio
#                 client and server are both called "lwio".
# The difference of two snapshots around a test is the server's CPU time during it.
import os
import sys

pids = set(int(x) for x in filter(None, sys.argv[1].split(','))) if len(sys.argv) > 1 else set()
tck = os.sysconf('SC_CLK_TCK')
with open('/proc/stat') as f:
    c = [int(x) for x in f.readline().split()[1:9]]
busy = sum(c) - c[3] - c[4]
procs = {}  # pid -> (ppid, cpu ticks incl. reaped children)
for p in os.listdir('/proc'):
    if not p.isdigit():
        continue
    try:
        with open('/proc/%s/stat' % p) as f:
            s = f.read()
    except OSError:
        continue
    f = s[s.rindex(')') + 2:].split()
    procs[int(p)] = (int(f[1]), int(f[11]) + int(f[12]) + int(f[13]) + int(f[14]))


def is_server(pid):
    seen = 0
    while pid > 1 and pid in procs and seen < 64:
        if pid in pids:
            return True
        pid = procs[pid][0]
        seen += 1
    return False


srv = sum(t for pid, (_, t) in procs.items() if is_server(pid))
print("%.2f %.2f" % (busy / tck, srv / tck))
