#!/usr/bin/python3
"""posix-checks.py - POSIX file-system semantics, checked by several users.

usage: posix-checks.py REFERENCE_DIR DIR [DIR ...]

Runs as root. Every check runs in a child process that has taken a test
user's ids (setgroups, setresgid, setresuid): users A (uid 2001), B (2002)
and C (2003); A and B share group 3000. Each check records what it observed
(an errno name, or the owner, mode and times it saw) in REFERENCE_DIR (the
export's own directory: the referee) and in each DIR (a mount of it), and
the run fails where a DIR disagrees with the referee, or where either
disagrees with the result POSIX gives (the `want` of a check), except for
the differences docs/mount.md names (`mount_differs`).

Written for lwio (docs/mount.md, "Identities"); no code of any public
suite. Prints one line per check and 'N passed, N failed'.
"""
import errno
import json
import os
import socket
import stat
import sys
import time
import traceback

A, B, C = 2001, 2002, 2003
SHARED = 3000
USERS = {
    "A": (A, A, [A, SHARED]),
    "B": (B, B, [B, SHARED]),
    "C": (C, C, [C]),
    "root": (0, 0, [0]),
}


def as_user(who, fn, *args):
    """Run fn(*args) in a child with `who`'s ids; its result or errno name."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            uid, gid, groups = USERS[who]
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.umask(0o022)
            try:
                out = fn(*args)
                out = "ok" if out is None else out
            except OSError as e:
                out = errno.errorcode.get(e.errno, str(e.errno))
            os.write(w, json.dumps(out).encode())
        except BaseException:
            os.write(w, json.dumps("CRASH " + traceback.format_exc()).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        data += b
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def own(p):
    st = os.lstat(p)
    return f"{st.st_uid}:{st.st_gid} {stat.filemode(st.st_mode)}"


def touch(p, mode=0o644):
    os.close(os.open(p, os.O_CREAT | os.O_WRONLY | os.O_EXCL, mode))


def mkdir_as(root, who, name, mode=0o755):
    p = os.path.join(root, name)
    res = as_user(who, os.mkdir, p, mode)
    assert res == "ok", f"setup: {who} mkdir {name}: {res}"
    os.chmod(p, mode)  # exact mode, whatever the umask
    return p


def ctime_moves(p, fn):
    before = os.lstat(p).st_ctime_ns
    time.sleep(0.02)
    fn()
    after = os.lstat(p).st_ctime_ns
    return "ctime advanced" if after > before else f"ctime unchanged ({before} -> {after})"


# ------------------------------------------------------------------ checks
# Each takes the scratch directory `d` (empty, 0777, root's) and returns
# what it observed. A check's `want` is what POSIX (Linux) gives.

CHECKS = []


def check(want=None, mount_differs=None):
    def reg(fn):
        CHECKS.append((fn.__name__, fn, want, mount_differs))
        return fn
    return reg


@check(want=["ok", "2001:2001 -rw-r--r--"])
def create_owned_by_creator(d):
    p = f"{d}/f"
    return [as_user("A", touch, p), own(p)]


@check(want=["ok", "2001:2001 drwxr-xr-x", "2002:2002 -rw-r--r--"])
def mkdir_owned_by_creator(d):
    p = f"{d}/sub"
    r = as_user("A", os.mkdir, p, 0o755)
    os.chmod(d, 0o777)
    as_user("B", touch, f"{d}/b")
    return [r, own(p), own(f"{d}/b")]


@check(want=["2001:3000 -rw-r--r--", "2001:3000 drwxr-sr-x"])
def setgid_directory_inherits(d):
    g = mkdir_as(d, "A", "g", 0o2775)
    os.chown(g, A, SHARED)
    os.chmod(g, 0o2775)
    as_user("A", touch, f"{g}/f")
    as_user("A", os.mkdir, f"{g}/sub", 0o755)
    return [own(f"{g}/f"), own(f"{g}/sub")]


@check(want=["ok", "EPERM", "EPERM", "2001:3000 -rw-r--r--"])
def chown_by_owner_only_to_own_groups(d):
    p = f"{d}/f"
    as_user("A", touch, p)
    return [
        as_user("A", os.chown, p, -1, SHARED),
        as_user("A", os.chown, p, -1, B),
        as_user("A", os.chown, p, B, -1),
        own(p),
    ]


@check(want=["EPERM", "EPERM", "2001:2001 -rw-r--r--"])
def chmod_chown_by_non_owner(d):
    p = f"{d}/f"
    as_user("A", touch, p)
    os.chmod(p, 0o644)
    return [as_user("B", os.chmod, p, 0o777), as_user("B", os.chown, p, -1, SHARED), own(p)]


@check(want=["2001:3000 -rwxr-xr-x"])
def chown_clears_setuid(d):
    p = f"{d}/f"
    as_user("A", touch, p)
    os.chmod(p, 0o4755)
    as_user("A", os.chown, p, -1, SHARED)
    return [own(p)]


@check(want=["ok", "2001:2002 -rwxr-xr-x"])
def chmod_by_non_member_drops_setgid(d):
    p = f"{d}/f"
    as_user("A", touch, p)
    os.chown(p, A, B)
    return [as_user("A", os.chmod, p, 0o2755), own(p)]


@check(want=["ok", "2001:2001 -rwxrwxrwx"], mount_differs=None)
def write_by_non_owner_clears_setuid(d):
    p = f"{d}/f"
    as_user("A", touch, p)
    os.chmod(p, 0o4777)

    def w():
        fd = os.open(p, os.O_WRONLY)
        os.write(fd, b"x")
        os.close(fd)

    return [as_user("B", w), own(p)]


@check(want=["EPERM", "EPERM", "ok", "ok", "ENOENT"])
def sticky_directory(d):
    t = f"{d}/t"
    os.mkdir(t)
    os.chmod(t, 0o1777)
    as_user("A", touch, f"{t}/a")
    as_user("A", touch, f"{t}/a2")
    return [
        as_user("B", os.unlink, f"{t}/a"),
        as_user("B", os.rename, f"{t}/a", f"{t}/b"),
        as_user("A", os.unlink, f"{t}/a"),
        as_user("root", os.unlink, f"{t}/a2"),
        as_user("A", os.stat, f"{t}/a"),
    ]


@check(want=["EACCES", "EACCES", "EACCES", "ok"])
def open_and_truncate_permissions(d):
    p = f"{d}/f"
    as_user("A", touch, p, 0o600)
    os.chmod(p, 0o600)

    def rd():
        os.close(os.open(p, os.O_RDONLY))

    def wr():
        os.close(os.open(p, os.O_WRONLY))

    return [as_user("B", rd), as_user("B", wr), as_user("B", os.truncate, p, 0), as_user("A", rd)]


@check(want=["EACCES", "EACCES", "ok"])
def search_permission(d):
    p = mkdir_as(d, "A", "private", 0o700)
    as_user("A", touch, f"{p}/f")

    def ls():
        os.listdir(p)

    return [as_user("B", os.stat, f"{p}/f"), as_user("B", ls), as_user("A", ls)]


@check(want=["EACCES", "ok"])
def create_needs_write_permission(d):
    p = mkdir_as(d, "A", "ro", 0o755)
    return [as_user("B", touch, f"{p}/x"), as_user("A", touch, f"{p}/x")]


@check(want=["ok", "EPERM", "ok", "ok", "EACCES"])
def utimensat_rules(d):
    p = f"{d}/f"
    as_user("A", touch, p)
    os.chmod(p, 0o666)
    q = f"{d}/g"
    as_user("A", touch, q)
    os.chmod(q, 0o644)
    return [
        as_user("B", os.utime, p, None),  # UTIME_NOW: write access suffices
        as_user("B", os.utime, p, (1, 1)),  # explicit: owner only
        as_user("A", os.utime, p, (1, 1)),
        as_user("A", os.utime, p, (5, 5)),
        as_user("B", os.utime, q, None),  # no write access: EACCES
    ]


def utimensat(path, atime, mtime):
    """utimensat(2) with raw (sec, nsec) pairs: UTIME_NOW and UTIME_OMIT
    are nsec values Python's os.utime cannot pass."""
    import ctypes

    class Ts(ctypes.Structure):
        _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]

    libc = ctypes.CDLL(None, use_errno=True)
    ts = (Ts * 2)(Ts(*atime), Ts(*mtime))
    if libc.utimensat(-100, path.encode(), ts, 0) != 0:  # AT_FDCWD
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2


@check(want=["ok", "EPERM", "EPERM", "1000000000 7"])
def utime_omit_and_now(d):
    p = f"{d}/f"
    as_user("A", touch, p)
    os.chmod(p, 0o666)
    os.utime(p, ns=(7, 1_000_000_007))
    return [
        # Both omitted: nothing to change, no permission needed.
        as_user("C", utimensat, p, (0, UTIME_OMIT), (0, UTIME_OMIT)),
        # Now for one, omit the other: only "both now" is allowed to any
        # writer (Linux utimensat(2)); this needs the owner.
        as_user("B", utimensat, p, (0, UTIME_NOW), (0, UTIME_OMIT)),
        # A time given: the owner only.
        as_user("B", utimensat, p, (5, 0), (0, UTIME_OMIT)),
        f"{os.lstat(p).st_mtime_ns // 1_000_000_000 * 1_000_000_000} {os.lstat(p).st_mtime_ns % 1_000_000_000}",
    ]


@check(want=["ctime advanced"] * 5)
def ctime_updates(d):
    p = f"{d}/f"
    as_user("A", touch, p)
    out = [
        ctime_moves(p, lambda: os.chmod(p, 0o640)),
        ctime_moves(p, lambda: os.chown(p, A, SHARED)),
        ctime_moves(p, lambda: os.truncate(p, 10)),
    ]
    before = os.lstat(p).st_ctime_ns
    time.sleep(0.02)
    os.rename(p, f"{d}/g")
    after = os.lstat(f"{d}/g").st_ctime_ns
    out.append("ctime advanced" if after > before else "ctime unchanged by rename")
    out.append(ctime_moves(d, lambda: os.unlink(f"{d}/g")))
    return out


@check(want=[2, 4, 3])
def directory_link_counts(d):
    p = f"{d}/n"
    os.mkdir(p)
    a = os.lstat(p).st_nlink
    os.mkdir(f"{p}/x")
    os.mkdir(f"{p}/y")
    b = os.lstat(p).st_nlink
    os.rmdir(f"{p}/y")
    return [a, b, os.lstat(p).st_nlink]


@check(want=["ok", "ENAMETOOLONG", "ENAMETOOLONG"])
def name_length(d):
    ok = f"{d}/" + "n" * 255
    long = f"{d}/" + "n" * 256
    return [as_user("root", touch, ok), as_user("root", touch, long), as_user("root", os.mkdir, long)]


@check(want=["ok", "ok", "ENAMETOOLONG"])
def path_max(d):
    # Absolute paths of PATH_MAX - 1 bytes (4095, with the NUL 4096) work;
    # one byte more is ENAMETOOLONG. Components of 200 bytes, then a last
    # name of at most 255.
    comp = "p" * 200

    def run():
        cur = d
        while 4094 - len(cur) > 255:
            cur = f"{cur}/{comp[: min(200, 4094 - len(cur) - 2)]}"
            os.mkdir(cur)
        name = "f" * (4094 - len(cur))
        target = f"{cur}/{name}"
        assert len(target) == 4095 and len(name) <= 255, (len(target), len(name))
        touch(target)
        os.stat(target)
        too = f"{cur}/" + "g" * (len(name) + 1)
        try:
            touch(too)
            return ["ok", "ok", "ok"]
        except OSError as e:
            return ["ok", "ok", errno.errorcode[e.errno]]

    return as_user("root", run)


@check(want=["ok", "fifo 2001:2001 prw-r-----", "ok", "socket"])
def fifo_and_socket(d):
    p = f"{d}/pipe"

    def mk():
        os.mkfifo(p, 0o640)

    r = as_user("A", mk)
    st = os.lstat(p)

    def bind():
        s = socket.socket(socket.AF_UNIX)
        s.bind(f"{d}/sock")
        s.close()

    r2 = as_user("A", bind)
    kind = "socket" if stat.S_ISSOCK(os.lstat(f"{d}/sock").st_mode) else "not a socket"
    return [r, f"{'fifo' if stat.S_ISFIFO(st.st_mode) else 'not a fifo'} {own(p)}", r2, kind]


@check(want=["ok"], mount_differs=["EPERM"])
def device_node_by_root(d):
    return [as_user("root", os.mknod, f"{d}/dev", 0o600 | stat.S_IFCHR, os.makedev(1, 3))]


@check(want=["EEXIST", "EISDIR", "ENOTEMPTY", "ENOTEMPTY", "ENOTDIR", "EISDIR"])
def namespace_errnos(d):
    as_user("A", touch, f"{d}/f")
    os.mkdir(f"{d}/full")
    os.mkdir(f"{d}/full2")
    touch(f"{d}/full/x")
    touch(f"{d}/full2/y")

    def wr_dir():
        os.open(f"{d}/full", os.O_WRONLY)

    return [
        as_user("A", touch, f"{d}/f"),
        as_user("root", wr_dir),
        as_user("root", os.rmdir, f"{d}/full"),
        as_user("root", os.rename, f"{d}/full2", f"{d}/full"),
        as_user("root", os.rmdir, f"{d}/f"),
        as_user("root", os.unlink, f"{d}/full"),
    ]


@check(want=["ok"])
def fsync_directory(d):
    def run():
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)

    return [as_user("root", run)]


# ------------------------------------------------------------------- main

def run_all(root, tag, is_ref):
    out = {}
    base = os.path.join(root, f"posix-checks-{os.getpid()}-{tag}")
    os.mkdir(base)
    os.chmod(base, 0o777)
    for name, fn, _, _ in CHECKS:
        d = os.path.join(base, name)
        os.mkdir(d)
        os.chmod(d, 0o777)
        try:
            out[name] = fn(d)
        except Exception as e:  # a crash of the check itself is a result too
            out[name] = f"check crashed: {e!r}"
    return out


def main():
    if len(sys.argv) < 3 or os.geteuid() != 0:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        sys.exit(2)
    ref_dir, dirs = sys.argv[1], sys.argv[2:]
    ref = run_all(ref_dir, "ref", True)
    passed = failed = 0
    for i, dd in enumerate(dirs):
        got = run_all(dd, f"m{i}", False)
        for name, _, want, differs in CHECKS:
            r, g = ref[name], got[name]
            problems = []
            if want is not None and r != want:
                problems.append(f"referee {r} != POSIX {want}")
            expect_mount = differs if differs is not None else r
            if g != expect_mount:
                problems.append(f"mount {g} != {'documented ' + str(differs) if differs is not None else 'referee ' + str(r)}")
            if problems:
                failed += 1
                print(f"FAIL {name} [{dd}]: " + "; ".join(problems))
            else:
                passed += 1
                print(f"PASS {name} [{dd}]: {g}")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
