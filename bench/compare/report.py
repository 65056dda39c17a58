# report.py RUNDIR: the markdown summary of one bench/compare.sh run.
#
# Reads RUNDIR/r*/index.tsv (one directory per repetition; cells are medians over them), the raw
# tool outputs beside each index, RUNDIR/env.txt and RUNDIR/r*/commands.tsv; writes
# RUNDIR/summary.md and prints it. RUNDIR/elapsed_s: the run's total wall time, if it finished.
#
# index.tsv columns: peer test tool rc bg "t0 t1" "busy0 srv0" "busy1 srv1" "user sys wall"
#   (times from /usr/bin/time of the client command; busy/srv from snap.py before and after).
import glob
import json
import os
import re
import statistics
import sys

RUN = sys.argv[1]
try:
    with open(os.path.join(RUN, 'elapsed_s')) as fh:
        TOTAL = float(fh.read())
except (OSError, ValueError):
    TOTAL = None
GiB = float(1 << 30)
NCPU = os.cpu_count() or 2
PEERS = [('nbd', 'NBD'), ('smb', 'SMB3'), ('nfs3', 'NFSv3')]   # "best peer" candidates
LWIO = [('lwio-poll', 'poll'), ('lwio-interrupt', 'interrupt')]
SYSTEMS = [
    ('local', 'local: fio io_uring on the tmpfs file'),
    ('tcp', 'raw TCP: iperf3 1 stream / sockperf 64 B ping-pong'),
    ('nbd', 'NBD: nbdkit file plugin + fio nbd engine'),
    ('smb', 'SMB3: smbd + libsmbclient (rio, QD = processes)'),
    ('nfs3', 'NFSv3: nfs-ganesha VFS + libnfs async (rio)'),
    ('lwio-poll', 'lwio soft provider, --completion poll'),
    ('lwio-interrupt', 'lwio soft provider, --completion interrupt'),
]
LABEL = dict(SYSTEMS)


# ------------------------------------------------------------------ parsers: raw output -> metrics
# Each returns bytes/ios/iops/GBps/p50_us/p99_us as far as the tool knows them, and cli_loop_s
# (client CPU over the timed loop) when the tool measures it itself.
def fio_parse(txt):
    j = json.loads(txt[txt.index('{'):])["jobs"][0]
    d = j["read"] if j["read"]["io_bytes"] > 0 else j["write"]
    p = d.get("lat_ns", {}).get("percentile", {}) or d.get("clat_ns", {}).get("percentile", {})
    m = dict(bytes=d["io_bytes"], ios=d["total_ios"], iops=d["iops"], GBps=d["bw_bytes"] / 1e9,
             p50_us=p.get("50.000000", 0) / 1e3, p99_us=p.get("99.000000", 0) / 1e3)
    # fio's usr_cpu/sys_cpu cover the job's own thread over its runtime: all of the client's work for
    # the nbd engine, but not io_uring's io-wq kernel workers (on tmpfs every buffered I/O is punted
    # to them); for io_uring the whole-process /usr/bin/time figure is used instead.
    if j.get("job options", {}).get("ioengine") != "io_uring":
        m["cli_loop_s"] = (j["usr_cpu"] + j["sys_cpu"]) / 100.0 * j["job_runtime"] / 1e3
    return m


def rio_parse(txt):
    j = json.loads(txt.strip().splitlines()[-1])
    return dict(bytes=j["ios"] * j["bs"], ios=j["ios"], iops=j["iops"], GBps=j["GBps"],
                p50_us=j["p50_us"], p99_us=j["p99_us"], cli_loop_s=j["cpu_s"])


def lwio_parse(txt):
    j = json.loads(txt.strip().splitlines()[-1])
    return dict(bytes=j["ios"] * j["bs"], ios=j["ios"], iops=j["iops"], GBps=j["bandwidth_bytes_per_s"] / 1e9,
                p50_us=j["lat_us"]["p50"], p99_us=j["lat_us"]["p99"], cli_loop_s=j["client_cpu_s"])


def iperf_parse(txt):
    j = json.loads(txt)["end"]
    return dict(bytes=j["sum_sent"]["bytes"], GBps=j["sum_received"]["bits_per_second"] / 8e9)


def sockperf_parse(txt):
    t = re.sub(r'\x1b\[[0-9;]*m', '', txt)
    tot = int(re.search(r'\[Total Run\].*?SentMessages=(\d+)', t).group(1))
    m = re.search(r'\[Valid Duration\] RunTime=([\d.]+) sec; SentMessages=\d+; ReceivedMessages=(\d+)', t)

    def pct(q):
        return float(re.search(r'percentile %s =\s*([\d.]+)' % q, t).group(1))
    return dict(ios=tot, iops=int(m.group(2)) / float(m.group(1)), p50_us=pct('50.000'), p99_us=pct('99.000'))


PARSE = {'fio': fio_parse, 'rio': rio_parse, 'lwio': lwio_parse, 'iperf3': iperf_parse, 'sockperf': sockperf_parse}

recs = []   # (rep, peer, test, metrics)
fails = []  # (rep, peer, test, why)
for idx in sorted(glob.glob(os.path.join(RUN, 'r*', 'index.tsv'))):
    rep = os.path.basename(os.path.dirname(idx))
    for line in open(idx):
        f = line.rstrip('\n').split('\t')
        if len(f) < 9:
            continue
        peer, test, tool, rc, bg, tt, s0, s1, tm = f[:9]
        base = os.path.join(os.path.dirname(idx), '%s.%s' % (peer, test))

        def tail(n=3):
            try:
                lines = [x for x in open(base + '.err', errors='replace').read().splitlines() if x.strip()]
            except OSError:
                return ''
            return ' / '.join(lines[-n:])[-400:]
        if rc != '0':
            fails.append((rep, peer, test, 'rc=%s: %s' % (rc, tail())))
            continue
        try:
            m = PARSE[tool](open(base + '.out', errors='replace').read())
            t0, t1 = map(float, tt.split())
            b0, v0 = map(float, s0.split())
            b1, v1 = map(float, s1.split())
            u, s = map(float, tm.split()[:2])
        except Exception as ex:  # noqa: BLE001 - any malformed output is a failed test
            fails.append((rep, peer, test, 'unparsable output (%s: %s) %s' % (type(ex).__name__, ex, tail())))
            continue
        wall = t1 - t0
        cli_total = u + s
        cli = m.get('cli_loop_s', cli_total)
        srv = v1 - v0
        host = b1 - b0
        m.update(cli_s=cli, cli_total_s=cli_total, srv_s=srv, bg=float(bg),
                 other_frac=max(0.0, host - cli_total - srv) / (wall * NCPU) if wall > 0 else 0.0)
        if m.get('bytes'):
            m['cli_s_per_GiB'] = cli / (m['bytes'] / GiB)
            m['srv_s_per_GiB'] = srv / (m['bytes'] / GiB)
        if m.get('ios'):
            m['cli_us_per_io'] = cli / m['ios'] * 1e6
            m['srv_us_per_io'] = srv / m['ios'] * 1e6
        recs.append((rep, peer, test, m))
reps = sorted(set(os.path.basename(os.path.dirname(i)) for i in glob.glob(os.path.join(RUN, 'r*', 'index.tsv'))))


def vals(peer, test, key):
    return [m[key] for (_, p, t, m) in recs if p == peer and t == test and key in m]


def failed(peer, test):
    return [w for (_, p, t, w) in fails if p == peer and t == test]


def med(peer, test, key):
    v = vals(peer, test, key)
    return statistics.median(v) if v else None


def cell(peer, test, key, fmt):
    """Median [min-max] over repetitions; FAILED when the test ran and never succeeded."""
    v = vals(peer, test, key)
    nf = len(failed(peer, test))
    if not v:
        return 'FAILED' if nf else 'n/a'
    s = fmt.format(statistics.median(v))
    if len(v) > 1:
        s += ' [' + fmt.format(min(v)) + '-' + fmt.format(max(v)) + ']'
    if nf:
        s += ' (%d FAILED)' % nf
    return s


out = []
P = out.append
env = open(os.path.join(RUN, 'env.txt'), errors='replace').read() if os.path.exists(os.path.join(RUN, 'env.txt')) else ''
P('# lwio vs NBD / SMB3 / NFS / raw TCP / local: one run of bench/compare.sh\n')
P('```')
P(env.strip())
if TOTAL is not None:
    P('total wall time of bench/compare.sh (install check, build, all tests): %.0f s' % TOTAL)
P('```\n')
P('Repetitions: %d (%s); cells are medians [min-max] over them. FAILED = the test ran and exited non-zero'
  ' or printed nothing parsable (see Failures).\n' % (len(reps), ', '.join(reps)))

# ------------------------------------------------------------------ targets
P('## Targets: lwio : best peer\n')
P('Peers = NBD, SMB3, NFSv3 (not local, not raw TCP). "best" = highest throughput/IOPS, lowest latency/CPU.\n')
P('| metric | lwio | lwio value | best peer | peer value | ratio | target | met |')
P('|---|---|---:|---|---:|---:|---|---|')


def best(test, key, lower):
    c = [(med(p, test, key), name) for p, name in PEERS if med(p, test, key) is not None]
    if not c:
        return None, None
    v, name = (min if lower else max)(c)
    return v, name


def target_row(metric, lp, mode, test, key, fmt, lower, goal, cmp, ref=None):
    """One target: lwio (lp, test, key) against the best peer (or ref=(label, value))."""
    if ref is None:
        pv, pname = best(test, key, lower)
        pfail = any(failed(p, test) for p, _ in PEERS)
    else:
        pname, pv = ref
        pfail = bool(failed('tcp', 'iperf3'))
    lv = med(lp, test, key)
    lcell = cell(lp, test, key, fmt)
    if lv is None or pv is None:
        ratio, met = ('FAILED' if lv is None and failed(lp, test) else 'n/a'), '-'
    elif pv == 0:
        ratio, met = 'n/a', '-'
    else:
        r = lv / pv
        ratio = '%.2f' % r
        met = 'yes' if (r >= goal if cmp == '>=' else r <= goal) else 'no'
    P('| %s | %s | %s | %s | %s | %s | %s %s | %s |' % (
        metric, mode, lcell, pname or 'none', fmt.format(pv) if pv is not None else ('FAILED' if pfail else 'n/a'), ratio, cmp, goal, met))


for lp, mode in LWIO:
    target_row('seq read 1 MiB QD8, GB/s', lp, mode, 'seqread', 'GBps', '{:.2f}', False, 1.5, '>=')
for lp, mode in LWIO:
    iv = med('tcp', 'iperf3', 'GBps')
    target_row('seq read 1 MiB QD8, GB/s : iperf3 1 stream', lp, mode, 'seqread', 'GBps', '{:.2f}', False, 1.0, '>=',
               ref=('iperf3', iv))
for lp, mode in LWIO:
    target_row('seq write 1 MiB QD8, GB/s', lp, mode, 'seqwrite', 'GBps', '{:.2f}', False, 1.5, '>=')
for lp, mode in LWIO:
    nv = med('nbd', 'seqwrite16', 'GBps')
    target_row('seq write 16 MiB QD2, GB/s : NBD', lp, mode, 'seqwrite16', 'GBps', '{:.2f}', False, 1.5, '>=',
               ref=('NBD', nv))
for suf, pl in (('', 'unpinned'), ('.same', 'same vCPU'), ('.split', 'split vCPUs')):
    if not any(vals(p, 'rr1' + suf, 'p50_us') or failed(p, 'rr1' + suf) for p, _ in PEERS + LWIO):
        continue
    for lp, mode in LWIO:
        target_row('4k randread QD1 p50 us, %s' % pl, lp, mode, 'rr1' + suf, 'p50_us', '{:.1f}', True,
                   0.33 if mode == 'poll' else 1.0, '<=')
for lp, mode in LWIO:
    target_row('4k randread QD32 IOPS', lp, mode, 'rr32', 'iops', '{:,.0f}', False, 2, '>=')
for lp, mode in LWIO:
    target_row('client CPU us per 4k read, QD32', lp, mode, 'rr32', 'cli_us_per_io', '{:.1f}', True, 0.5, '<=')

# ------------------------------------------------------------------ compact matrix
P('\n## System x workload\n')
P('seq = 1 MiB QD8 (seq write 16M: 16 MiB QD2); rr = 4 KiB random read; rw = 4 KiB random write; CPU = client CPU in the timed loop.\n')
P('| system | seq read GB/s | seq write GB/s | seq write 16M QD2 GB/s | rr QD1 IOPS | rr QD1 p50 us | rr QD1 p99 us | rr QD32 IOPS | rr QD32 p99 us | rw QD1 IOPS | rw QD1 p50 us | client us/4k QD32 | server us/4k QD32 | client s/GiB seq read | server s/GiB seq read |')
P('|---|' + '---:|' * 14)
for peer, label in SYSTEMS:
    sr = 'iperf3' if peer == 'tcp' else 'seqread'
    r1 = 'pingpong' if peer == 'tcp' else 'rr1'
    row = [cell(peer, sr, 'GBps', '{:.2f}'), cell(peer, 'seqwrite', 'GBps', '{:.2f}'),
           cell(peer, 'seqwrite16', 'GBps', '{:.2f}'),
           cell(peer, r1, 'iops', '{:,.0f}'), cell(peer, r1, 'p50_us', '{:.1f}'), cell(peer, r1, 'p99_us', '{:.1f}'),
           cell(peer, 'rr32', 'iops', '{:,.0f}'), cell(peer, 'rr32', 'p99_us', '{:.1f}'),
           cell(peer, 'rw1', 'iops', '{:,.0f}'), cell(peer, 'rw1', 'p50_us', '{:.1f}'),
           cell(peer, 'rr32', 'cli_us_per_io', '{:.1f}'), cell(peer, 'rr32', 'srv_us_per_io', '{:.1f}'),
           cell(peer, sr, 'cli_s_per_GiB', '{:.2f}'), cell(peer, sr, 'srv_s_per_GiB', '{:.2f}')]
    if all(x == 'n/a' for x in row):
        continue
    P('| %s | %s |' % (label, ' | '.join(row)))

# ------------------------------------------------------------------ placements
P('\n## QD1 round trip by CPU placement (4 KiB random read; raw TCP: 64 B ping-pong RTT)\n')
P('unpinned = scheduler decides; same = client and every server thread on vCPU 0; split = client on vCPU 0,'
  ' server on vCPU 1. The same pinning for every system.\n')
P('| system | unpinned IOPS | p50 us | p99 us | same IOPS | p50 us | p99 us | split IOPS | p50 us | p99 us | client us/IO unpinned / same / split |')
P('|---|' + '---:|' * 10)
for peer, label in SYSTEMS:
    if peer == 'local':
        continue
    t = 'pingpong' if peer == 'tcp' else 'rr1'
    row, cpu = [], []
    for suf in ('', '.same', '.split'):
        row += [cell(peer, t + suf, 'iops', '{:,.0f}'), cell(peer, t + suf, 'p50_us', '{:.1f}'),
                cell(peer, t + suf, 'p99_us', '{:.1f}')]
        cpu.append(cell(peer, t + suf, 'cli_us_per_io', '{:.1f}'))
    if all(x == 'n/a' for x in row):
        continue
    P('| %s | %s | %s |' % (label, ' | '.join(row), ' / '.join(cpu)))

# ------------------------------------------------------------------ every test
P('\n## Every test\n')
P('client CPU = the tool\'s own count over its timed loop where it has one (lwio bench JSON client_cpu_s;'
  ' rio getrusage of the loop, parent + workers; fio nbd (usr_cpu+sys_cpu) x job_runtime of the job thread),'
  ' else the whole process from /usr/bin/time (fio io_uring, whose io-wq workers fio does not count; iperf3,'
  ' sockperf); "whole" = /usr/bin/time user+sys of the'
  ' client command incl. its setup. server CPU = /proc user+sys of the server processes (by PID and their'
  ' descendants, e.g. smbd\'s per-client processes) between just before and just after the client command.'
  ' other = host CPU used by neither, share of all vCPUs (>10%: contended, e.g. builds on a shared host).\n')
P('| system | test | n | GB/s | IOPS | p50 us | p99 us | client us/IO | client s/GiB | client whole s | server us/IO | server s/GiB | other CPU |')
P('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
seen = []
for (_, p, t, _) in recs:
    if (p, t) not in seen:
        seen.append((p, t))
for (_, p, t, _) in fails:
    if (p, t) not in seen:
        seen.append((p, t))
order = [s for s, _ in SYSTEMS]
seen.sort(key=lambda pt: order.index(pt[0]) if pt[0] in order else len(order))
for p, t in seen:
    oth = vals(p, t, 'other_frac')
    P('| %s | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |' % (
        p, t, len(oth), cell(p, t, 'GBps', '{:.2f}'), cell(p, t, 'iops', '{:,.0f}'), cell(p, t, 'p50_us', '{:.1f}'),
        cell(p, t, 'p99_us', '{:.1f}'), cell(p, t, 'cli_us_per_io', '{:.1f}'), cell(p, t, 'cli_s_per_GiB', '{:.2f}'),
        cell(p, t, 'cli_total_s', '{:.2f}'), cell(p, t, 'srv_us_per_io', '{:.1f}'), cell(p, t, 'srv_s_per_GiB', '{:.2f}'),
        (('%.0f%%' % (100 * max(oth))) + (' contended' if max(oth) > 0.10 else '')) if oth else 'FAILED'))

if fails:
    P('\n## Failures\n')
    P('| rep | system | test | why (exit status, last lines of stderr) |')
    P('|---|---|---|---|')
    for rep, p, t, w in fails:
        P('| %s | %s | %s | %s |' % (rep, p, t, w.replace('|', '\\|')))

# ------------------------------------------------------------------ commands
P('\n## Commands\n')
P('Servers run inside `unshare -m -n` (only loopback; private /run and a private tmpfs at the data dir);'
  ' client commands are run under `/usr/bin/time -f "%U %S %e"`; `taskset -c 0` prefixes the pinned runs.\n')
P('```')
cmds = glob.glob(os.path.join(RUN, 'r*', 'commands.tsv'))
if cmds:
    for line in open(sorted(cmds)[0], errors='replace'):
        f = line.rstrip('\n').split('\t', 2)
        if len(f) == 3:
            P('%-16s %-14s %s' % (f[0], f[1], f[2]))
P('```')

txt = '\n'.join(out) + '\n'
with open(os.path.join(RUN, 'summary.md'), 'w') as fh:
    fh.write(txt)
print(txt)
