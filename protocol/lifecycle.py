"""Process lifecycle helpers shared by the scheduler and worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time


def become_child() -> None:
    """Make a child process leave Ctrl-C to its parent and die with it.

    The parent shuts children down in order; a SIGINT reaching the whole
    process group must not kill them half-way. If the parent vanishes
    (killed, crashed), the child exits instead of lingering as an orphan.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def stop_child(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 5.0) -> int:
    """Ask a child to stop with `sig`; kill it if it is still there after `timeout` s."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
