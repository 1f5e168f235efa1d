"""Runs one tool command and, when it ends, kills every process it left behind.

Started by tools/runner.py as `python -I -S reaper.py PARENT_PID ISOLATE ARGV...` in a session of
its own. A process group is not enough: a child can call setsid() (or `setsid`, or a double-forking
daemon) and leave the group, and the command can kill or stop the process that watches it.

Where the kernel lets an unprivileged process make namespaces (ISOLATE "1" and unshare allowed),
the command runs in a user, PID and mount namespace of its own, under a small init (PID 1 there,
forked from this process) with a /proc of that namespace only:
  - the command cannot signal its init (the kernel drops SIGKILL and SIGSTOP sent to a namespace's
    init from inside it) nor see this process or flashmoe (not in its PID namespace);
  - when the init exits, the kernel kills every process left in the namespace, daemons included;
  - /proc shows no process outside, so no ancestor's environment can be read there.
User ids stay what they were (root maps every id to itself; another user only its own, so files of
other users read as nobody's and set-uid programs such as sudo do not work inside).

Elsewhere this process marks itself a child subreaper (Linux prctl), so every orphaned descendant
is re-parented to it instead of to init, and after the command exits (or when it is told to stop,
or when its parent dies) it kills the whole tree of its descendants. The command runs in a session
of its own (so `kill 0` does not reach this process) and dies with it (PR_SET_PDEATHSIG); if the
command kills this process anyway, its orphans go to flashmoe, which sweeps them (runner.py).

It passes the command's exit status on: the same exit code, or death by the same signal.
Standard library only, since it runs without site-packages.
"""

import ctypes
import errno
import os
import resource
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 1 << 18
GRACE_S = 0.5  # between SIGTERM and SIGKILL when the command is stopped early
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stop(Exception):
    pass


def _on_signal(signum, frame):
    raise Stop(signum)


def descendants(me):
    """Every process whose chain of parents reaches `me`, from /proc."""
    parent = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        parent[int(name)] = int(fields[1])
    found = set()
    for pid in parent:
        p, seen = pid, 0
        while p in parent and p not in (0, 1) and seen < 4096:
            p = parent[p]
            seen += 1
            if p == me:
                found.add(pid)
                break
    return found


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(me, sig=signal.SIGKILL):
    """Signal every descendant until none is left (a process may fork while we look)."""
    for _ in range(100):
        pids = descendants(me)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig != signal.SIGKILL:
            return
        time.sleep(0.005)
        reap()


def _write(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def map_ids(pid):
    """Write the id maps of `pid`'s new user namespace from this, the parent, namespace: root keeps
    every id as it is (only a writer outside the namespace may map more than its own ids); another
    user, or a root the kernel refuses that to, maps its own ids only."""
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        try:
            _write(f"/proc/{pid}/uid_map", "0 0 4294967295\n")
            _write(f"/proc/{pid}/gid_map", "0 0 4294967295\n")
            return
        except OSError:
            pass
    _write(f"/proc/{pid}/setgroups", "deny")
    _write(f"/proc/{pid}/uid_map", f"{uid} {uid} 1\n")
    _write(f"/proc/{pid}/gid_map", f"{gid} {gid} 1\n")


def fork_into_namespaces():
    """Fork a child that enters a new user, PID and mount namespace (its next child is the PID
    namespace's init). Returns True in the child; in this process the child's pid, or None when
    the kernel refused (the child has then exited, and nothing has started)."""
    libc = ctypes.CDLL(None, use_errno=True)
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    child = os.fork()
    if child == 0:
        os.close(ready_r)
        os.close(go_w)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        entered = libc.unshare(CLONE_NEWUSER) == 0
        os.write(ready_w, b"1" if entered else b"0")
        entered = entered and os.read(go_r, 1) == b"1" and libc.unshare(CLONE_NEWPID | CLONE_NEWNS) == 0
        os.write(ready_w, b"1" if entered else b"0")
        os.close(ready_w)
        os.close(go_r)
        if not entered:
            os._exit(1)
        return True
    os.close(ready_w)
    os.close(go_r)
    ok = os.read(ready_r, 1) == b"1"
    if ok:
        try:
            map_ids(child)
        except OSError:
            ok = False
        os.write(go_w, b"1" if ok else b"0")
    ok = os.read(ready_r, 1) == b"1" and ok
    os.close(go_w)
    os.close(ready_r)
    if not ok:
        os.waitpid(child, 0)
        return None
    return child


def namespaces_work():
    """Whether this kernel lets this user make the namespaces (tried with a throwaway child)."""
    child = fork_into_namespaces()
    if child is True:
        os._exit(0)
    if child is None:
        return False
    os.waitpid(child, 0)
    return True


def start(command, new_session):
    """Fork and exec the command; (its pid, None) or (None, exit code) when it cannot run."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    child = os.fork()
    if child == 0:
        os.close(read_end)
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        try:
            if new_session:
                os.setsid()  # so that `kill 0` reaches the command's own group only
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            os.execvp(command[0], command)
        except OSError as e:
            os.write(write_end, f"{e.errno}".encode())
        os._exit(127)
    os.close(write_end)
    failed = os.read(read_end, 64)
    os.close(read_end)
    if failed:
        sys.stdout.write(f"cannot run {command[0]!r}: {os.strerror(int(failed))}\n")
        sys.stdout.flush()
        os.waitpid(child, 0)
        return None, 127
    return child, None


def wait_for(child):
    """The child's wait status, reaping every other process that ends meanwhile."""
    while True:
        pid, st = os.waitpid(-1, 0)
        if pid == child:
            return st


def namespace_init(command, report, alive):
    """PID 1 of the namespace: run the command, then exit, which makes the kernel kill every
    process still in the namespace. Writes the command's wait status to `report`."""
    import select

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if select.select([alive], [], [], 0)[0]:  # EOF: its parent died before it could ask to hear of it
        os._exit(1)
    libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None)
    libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)  # else ancestors stay visible
    status = (128 + signal.SIGTERM) << 8
    try:
        child, code = start(command, new_session=True)
        status = code << 8 if child is None else wait_for(child)
    except Stop:
        os.kill(-1, signal.SIGTERM)  # -1 from a namespace's init: every process of the namespace
        end = time.monotonic() + GRACE_S
        while time.monotonic() < end:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    time.sleep(0.02)
            except ChildProcessError:
                break
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    os.write(report, str(status).encode())
    os._exit(0)


def stop_child(pid, grace):
    """SIGTERM to a child, SIGKILL if it has not ended after `grace` seconds; reaped."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)  # an init's exit takes its whole namespace down
            os.waitpid(pid, 0)
            return
        time.sleep(0.02)


def isolated(command):
    """In the namespaces: run the command under a namespace init; its wait status (None when
    stopped early)."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    alive_r, alive_w = os.pipe2(os.O_CLOEXEC)
    init = os.fork()
    if init == 0:
        os.close(read_end)
        os.close(alive_w)
        namespace_init(command, write_end, alive_r)
    os.close(write_end)
    os.close(alive_r)
    try:
        st = wait_for(init)
    except Stop:
        stop_child(init, GRACE_S + 0.5)
        return None
    report = os.read(read_end, 64)
    return int(report) if report else st


def namespaced(command):
    """Run the command in namespaces of its own: (whether they could be made, its wait status)."""
    holder = fork_into_namespaces()
    if holder is True:  # the child in the namespaces passes the status on by its own exit
        os._exit(pass_on(isolated(command)))
    if holder is None:
        return False, None
    try:
        return True, wait_for(holder)
    except Stop:
        stop_child(holder, GRACE_S + 1.0)
        return True, None


def supervised(me, command):
    """Run the command as this subreaper's child, then kill what it left; its wait status (None
    when stopped early)."""
    status = None
    try:
        child, code = start(command, new_session=True)
        status = code << 8 if child is None else wait_for(child)
    except Stop:
        kill_tree(me, signal.SIGTERM)
        end = time.monotonic() + GRACE_S
        while time.monotonic() < end and descendants(me):
            time.sleep(0.02)
            reap()
    except ChildProcessError:
        pass
    finally:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        kill_tree(me)
    return status


def pass_on(status):
    """This process's exit for the command's wait status: the same code, or the same signal."""
    if status is None:
        return 128 + signal.SIGTERM
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def main(argv):
    parent, isolate, command = int(argv[0]), argv[1] == "1", argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        if os.getppid() != parent:  # the parent died before we could ask to hear of it
            return 1
        entered, status = namespaced(command) if isolate else (False, None)
        if not entered:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            status = supervised(os.getpid(), command)
    except Stop:  # before the command started
        status = None
    return pass_on(status)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except OSError as e:
        if e.errno == errno.EPIPE:
            sys.exit(1)
        raise
