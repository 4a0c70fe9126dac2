"""No process of a local cell outlives its launcher, even one killed outright (SIGKILL, the OOM killer).

The local launcher (``zeroexp.launch.local``) forks its ranks from a forkserver that it spawned. Two links, each a Linux
parent-death signal (``PR_SET_PDEATHSIG``): the forkserver dies with the launcher, and every rank dies with the
forkserver (``zeroexp.rank.worker.rank_entry``). The first is armed when the forkserver imports this module as its
first preload (``set_forkserver_preload``); imported anywhere else, the module does nothing.

A leaf: it imports nothing of zeroexp.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["die_with_parent", "in_forkserver"]


def _libc_prctl():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


#: libc's ``prctl``, looked up when this module is imported: :func:`die_with_parent` is called in the child of a fork
#: (a rank; a test's ``preexec_fn``), where loading a library could wait forever on a lock another thread of the
#: parent held at the fork. None where there is no glibc.
_PRCTL = _libc_prctl()


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where that is not available."""
    return _PRCTL is not None and _PRCTL(1, int(sig)) == 0  # PR_SET_PDEATHSIG


def in_forkserver() -> bool:
    """True while ``multiprocessing.forkserver.main`` is importing its preload modules in this process."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(os.path.join("multiprocessing", "forkserver.py")):
            return True
        frame = frame.f_back
    return False


if in_forkserver():
    # The forkserver exits by itself once it reads EOF on its "alive" pipe, but only after Python's shutdown with
    # torch loaded (seconds on a busy host), and ranks inherit that pipe's write end (zeroexp.rank.worker closes it).
    # SIGKILL when the launcher goes: at once, and the ranks' own death signal follows.
    _PARENT = os.getppid()
    die_with_parent()
    if os.getppid() != _PARENT:  # the launcher died before the signal was armed
        os._exit(1)
