"""Run ``ampkit ARGS`` with one fault injected into checkpoint/metrics writes (test-only).

Production code has no fault hooks: ``python tests/faults/driver.py FAULT NTH ARGS...`` patches
the writers in its own process, then calls ``ampkit.cli.main(ARGS)``. ``--serve`` turns it into a
fork server: torch and ampkit are imported once, and every request (one JSON line on stdin) runs
in a forked child, optionally SIGKILLed after a delay (counted from the fork, or from the moment a
given file appears); the reply (one JSON line) gives its exit
status. Forking from a process that has run no torch op is safe and saves the few seconds an
import of torch costs per trial, which is what lets the suite afford many kill trials. The fault fires on the NTH checkpoint
save (for ``kill-mid-prune``: the NTH checkpoint deletion; for ``metrics-enospc``: the NTH metrics
record). Just before it fires, the sha256 of every file in ``--out``/checkpoints is written to
``$AMPKIT_FAULT_SNAPSHOT`` (JSON), so a test can prove earlier checkpoints stayed byte-for-byte intact.

Faults:
  kill-mid-write          half the checkpoint's bytes reach the temp file, then SIGKILL
  kill-before-rename      temp file complete and fsync'ed, SIGKILL before os.replace
  kill-after-rename       SIGKILL right after os.replace (before the directory fsync and pruning)
  kill-mid-prune          SIGKILL right after pruning deleted an old checkpoint
  sigint-twice-mid-write  half the bytes written, then two SIGINTs (the write finishes, then the run stops)
  enospc                  half the bytes written, then OSError(ENOSPC)
  enospc-zip              the file's writes fail with ENOSPC after half the bytes, inside torch.save: torch's
                          zip writer raises its RuntimeError ("unexpected pos") over the OSError
  readonly                creating the temp file fails with OSError(EROFS)
  metrics-enospc          writing a metrics.jsonl record fails with OSError(ENOSPC)
"""
import errno
import hashlib
import io
import json
import os
import signal
import sys
import tempfile

import torch

FAULTS = ("none", "kill-mid-write", "kill-before-rename", "kill-after-rename", "kill-mid-prune",
          "sigint-twice-mid-write", "enospc", "enospc-zip", "readonly", "metrics-enospc")


def _snapshot(ckpt_dir):
    path = os.environ.get("AMPKIT_FAULT_SNAPSHOT")
    if not path:
        return
    files = {}
    for name in sorted(os.listdir(ckpt_dir)):
        with open(os.path.join(ckpt_dir, name), "rb") as f:
            files[name] = hashlib.sha256(f.read()).hexdigest()
    with open(path, "w") as f:
        json.dump(files, f)


def _kill():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _FullDisk(io.RawIOBase):
    """A file whose disk fills up after ``room`` bytes: later writes raise OSError(ENOSPC)."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def writable(self):
        return True

    def write(self, b):
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(b)
        return self.f.write(b)


def install(fault, nth, ckpt_dir):
    count = {"n": 0}

    def due():
        count["n"] += 1
        if count["n"] == nth:
            _snapshot(ckpt_dir)
            return True
        return False

    if fault in ("kill-mid-write", "sigint-twice-mid-write", "enospc", "enospc-zip", "kill-before-rename",
                 "kill-after-rename"):
        real_save, real_replace = torch.save, os.replace
        state = {"armed": False}

        def save(obj, f, *a, **kw):
            if not due():
                return real_save(obj, f, *a, **kw)
            if fault in ("kill-before-rename", "kill-after-rename"):
                state["armed"] = True
                return real_save(obj, f, *a, **kw)
            buf = io.BytesIO()
            real_save(obj, buf, *a, **kw)
            if fault == "enospc-zip":
                return real_save(obj, _FullDisk(f, len(buf.getvalue()) // 2), *a, **kw)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            if fault == "kill-mid-write":
                _kill()
            if fault == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C: the write goes on to its end
            f.write(buf.getvalue()[len(buf.getvalue()) // 2:])

        def replace(src, dst):
            if state["armed"] and str(dst).endswith(".pt"):
                if fault == "kill-before-rename":
                    _kill()
                real_replace(src, dst)
                _kill()
            return real_replace(src, dst)

        torch.save, os.replace = save, replace
    elif fault == "kill-mid-prune":
        real_unlink = os.unlink

        def unlink(path, *a, **kw):
            real_unlink(path, *a, **kw)
            if os.path.basename(str(path)).startswith("step-") and due():
                _kill()

        os.unlink = unlink
    elif fault == "readonly":
        real_mkstemp = tempfile.mkstemp

        def mkstemp(*a, **kw):
            if os.path.basename(str(kw.get("dir", ""))) == "checkpoints" and due():
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), kw["dir"])
            return real_mkstemp(*a, **kw)

        tempfile.mkstemp = mkstemp
    elif fault == "metrics-enospc":
        from ampkit.train import metrics

        real_write = metrics.MetricsLogger._write

        def write(self, record):
            if self.path and due():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
            return real_write(self, record)

        metrics.MetricsLogger._write = write
    elif fault != "none":
        raise SystemExit(f"unknown fault {fault!r}: use one of {', '.join(FAULTS)}")


def main(argv):
    fault, nth, args = argv[0], int(argv[1]), argv[2:]
    out = args[args.index("--out") + 1]
    install(fault, nth, os.path.join(out, "checkpoints"))
    from ampkit.cli import main as ampkit_main

    return ampkit_main(args)


def _child(req):
    """In the forked child: redirect output to the request's files, inject, run, exit."""
    os.environ.update(req.get("env", {}))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    if req.get("uid") is not None:  # run as an unprivileged user (root ignores file permissions)
        os.setgroups([])
        os.setgid(req["uid"])
        os.setuid(req["uid"])
    code = 1
    try:
        code = main([req["fault"], str(req.get("nth", 0)), *req["args"]])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve():
    """Fork server: one JSON request per stdin line -> one JSON reply per stdout line."""
    import time

    import importlib.readers  # noqa: F401  (sklearn's data files; unreadable after dropping root)

    import ampkit.cli.train  # noqa: F401  (import everything a run needs, once)
    import ampkit.data  # noqa: F401
    import ampkit.models  # noqa: F401
    import ampkit.train  # noqa: F401
    import sklearn.datasets  # noqa: F401
    import sklearn.metrics  # noqa: F401
    import sklearn.model_selection  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: seconds per child otherwise)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            _child(req)
        # the kill clock starts at fork, or once `clock_file` exists (training has begun)
        kill_after, killed, overdue, clock_file = req.get("kill_after"), False, False, req.get("clock_file")
        t_clock = None if clock_file else t0
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if t_clock is None and os.path.exists(clock_file):
                t_clock = time.perf_counter()
            overdue = time.perf_counter() - t0 > req.get("timeout", 300)  # a hung child must not outlive the suite
            if overdue or (kill_after is not None and t_clock is not None and time.perf_counter() - t_clock >= kill_after):
                os.kill(pid, signal.SIGKILL)  # not reaped yet, so the pid cannot have been reused
                killed = True
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.001)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"returncode": code, "killed": killed and not overdue, "timed_out": overdue,
                          "elapsed": time.perf_counter() - t0,
                          "clock_started": None if t_clock is None else t_clock - t0}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        sys.exit(main(sys.argv[1:]))
