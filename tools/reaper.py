"""Runs one tool command and, when it ends, kills every process it left behind.

Started by tools/runner.py as `python -I -S reaper.py PARENT_PID ARGV...` in a session of its own.
A process group is not enough: a child can call setsid() (or `setsid`, or a double-forking
daemon) and leave the group. This process marks itself a child subreaper (Linux prctl), so every
orphaned descendant is re-parented to it instead of to init, and after the command exits (or when
it is told to stop, or when its parent dies) it kills the whole tree of its descendants.

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
GRACE_S = 0.5  # between SIGTERM and SIGKILL when the command is stopped early


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
        fields = stat[stat.rfind(b")") + 2:].split()
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


def main(argv):
    parent, command = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    me = os.getpid()
    status = None
    try:
        if os.getppid() != parent:  # the parent died before we could ask to hear of it
            return 1
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        child = os.fork()
        if child == 0:
            os.close(read_end)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            try:
                os.execvp(command[0], command)
            except OSError as e:
                os.write(write_end, f"{e.errno}".encode())
            os._exit(127)
        os.close(write_end)
        failed = os.read(read_end, 64)
        os.close(read_end)
        if failed:
            code = int(failed)
            sys.stdout.write(f"cannot run {command[0]!r}: {os.strerror(code)}\n")
            sys.stdout.flush()
            os.waitpid(child, 0)
            return 127
        while status is None:
            pid, st = os.waitpid(-1, 0)
            if pid == child:
                status = st
    except Stop:
        kill_tree(me, signal.SIGTERM)
        end = time.monotonic() + GRACE_S
        while time.monotonic() < end and descendants(me):
            time.sleep(0.02)
            reap()
        status = None
    except ChildProcessError:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        kill_tree(me)
    if status is None:
        return 128 + signal.SIGTERM
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(me, sig)
        return 128 + sig
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except OSError as e:
        if e.errno == errno.EPIPE:
            sys.exit(1)
        raise
