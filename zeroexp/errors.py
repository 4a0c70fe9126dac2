"""The errors zeroexp refuses a configuration with: a leaf module (it imports nothing of zeroexp), so every layer
(config, strategies, planner, CLI) can raise them."""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigError", "Interrupted", "InvalidCell", "NotApplicableHere", "one_line"]


class ConfigError(ValueError):
    """A configuration that zeroexp refuses before any work starts.

    The message always names the offending key, the given value and what is accepted.
    """

    #: The message's first words: what kind of refusal it is.
    kind = "invalid config"

    def __init__(self, key: str, value: Any, accepted: str, why: str = "") -> None:
        self.key, self.value, self.accepted, self.why = key, value, accepted, why
        msg = f"{self.kind}: {key}={value!r}: {why + '; ' if why else ''}accepted: {accepted}"
        super().__init__(msg)


class InvalidCell(ConfigError):
    """A configuration whose keys and values are each valid, refused for this cell's combination: its strategy does
    not implement this model, precision, offload, init or checkpoint (FSDP1 and a unit that mixes frozen and trainable
    parameters), or the cell does not fit this machine (the cell stage of ``zeroexp.config.schemas.validate``). A
    single run exits 2; in a ``--multirun`` sweep the job is recorded ``refused`` with this message and the sweep runs
    its other jobs (docs/results.md). Its message is the refusal's, unchanged."""

    @classmethod
    def of(cls, e: ConfigError) -> "InvalidCell":
        """``e`` as an :class:`InvalidCell`: the same key, value, accepted values and reason."""
        return cls(e.key, e.value, e.accepted, why=e.why)


class NotApplicableHere(ConfigError):
    """A cell of valid axis values that cannot run, on this machine (FSDP CPU offload with no accelerator) or in
    this combination (DeepSpeed offload at stage 0): refused up front in a single run; in a ``--multirun`` sweep
    the cell is ``skipped`` with this message and the sweep goes on (a sweep is a product of axes). Its message says
    so ("not applicable here: ..."): nothing in it is invalid."""

    kind = "not applicable here"


class Interrupted(KeyboardInterrupt):
    """The main process was asked to stop: Ctrl-C (SIGINT), or SIGTERM (``kill``, SLURM) or SIGHUP (the terminal
    went away), raised by the handlers of ``zeroexp.launch.runner.stop_on_signals``. A KeyboardInterrupt, so every path
    that cleans up after Ctrl-C (the launcher reaping its ranks, the runner marking the cell failed) does the same
    for the others."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = int(signum)
        self.signal_name = signal.Signals(self.signum).name
        super().__init__(self.signal_name)


_TENSOR_STARTS = ("Parameter containing:", "tensor(")


def one_line(text: str, limit: int = 1000) -> str:
    """An error message as one line for the terminal and the manifest: every tensor repr (``tensor([...])``,
    ``Parameter containing:\ntensor(...)``, a repr cut short included) replaced by ``<tensor>``, so no parameter's
    values reach the user; whitespace runs (newlines) collapsed; at most ``limit`` characters."""
    out, i = [], 0
    while i < len(text):
        starts = [(text.find(m, i), m) for m in _TENSOR_STARTS]
        found = [(at, m) for at, m in starts if at >= 0]
        if not found:
            out.append(text[i:])
            break
        at, mark = min(found)
        out.append(text[i:at] + "<tensor>")
        j = text.find("tensor(", at) if mark != "tensor(" else at
        j = j + len("tensor(") if j >= 0 else len(text)
        depth = 1
        while j < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            j += 1
        i = j
    line = " ".join("".join(out).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."
