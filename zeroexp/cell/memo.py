"""What one invocation computes once about the cells it reads: a model's shape, a traced step, a model found good.

The cache belongs to an invocation (a run or a sweep, ``python -m zeroexp.plan``, ``zeroexp.recommend``, a rank), which
opens it (:func:`invocation_memo`) and drops it when it ends; outside one, every answer is computed afresh. No module
keeps answers of its own between calls: a function that may be asked twice for the same thing asks :func:`memoized`.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

__all__ = ["STORED_TABLES", "invocation_memo", "memoized", "memo_table", "recall", "remember", "stored_answers"]

#: The open invocation's tables by name (None: no invocation open). A ContextVar, not a dict: it holds no answer itself.
_ACTIVE: ContextVar[dict[str, dict[Any, Any]] | None] = ContextVar("zeroexp_invocation_memo", default=None)
#: The newest answers a table keeps (a recommend over many models would otherwise keep every traced step).
MOST = 64
#: The tables whose answers a store on disk keeps between invocations (:func:`stored_answers`): each a pure function
#: of its key and the model's and zeroexp's code, picklable (a built module, ``fake_builds``, is not among them).
STORED_TABLES = frozenset({"plan_shapes", "wrap_units", "step_traces", "forward_traces", "activation_bytes",
                           "op_counts"})
#: The open invocation's store on disk (None: none open: answers live only as long as the invocation).
_STORE: ContextVar[Any] = ContextVar("zeroexp_answer_store", default=None)


@contextmanager
def stored_answers(store: Any) -> Iterator[Any]:
    """For the body, read and write the answers of :data:`STORED_TABLES` in ``store``
    (a :class:`zeroexp.cell.store.AnswerStore`; None: none); yield it."""
    token = _STORE.set(store)
    try:
        yield store
    finally:
        _STORE.reset(token)


def _stored(name: str, key: Any) -> tuple[bool, Any]:
    store = _STORE.get()
    if store is None or name not in STORED_TABLES or key is None:
        return False, None
    return store.load(name, key)


def _store(name: str, key: Any, value: Any) -> None:
    store = _STORE.get()
    if store is not None and name in STORED_TABLES and key is not None:
        store.save(name, key, value)


@contextmanager
def invocation_memo(fresh: bool = False) -> Iterator[dict[str, dict[Any, Any]]]:
    """Open this invocation's memo for the body (nested: the body shares the open one, unless ``fresh``: a memo of its
    own, the open one back after it); yield its tables."""
    open_ = _ACTIVE.get()
    if open_ is not None and not fresh:
        yield open_
        return
    tables: dict[str, dict[Any, Any]] = {}
    token = _ACTIVE.set(tables)
    try:
        yield tables
    finally:
        _ACTIVE.reset(token)


def memo_table(name: str) -> dict[Any, Any] | None:
    """The open invocation's table ``name`` (made empty on first use); None when no invocation is open."""
    tables = _ACTIVE.get()
    return None if tables is None else tables.setdefault(name, {})


def remember(name: str, key: Any, value: Any) -> Any:
    """Keep ``value`` in table ``name`` under ``key`` (the :data:`MOST` newest), as :func:`memoized` would have
    computed it (an answer computed beside another); ``value``. Nothing is kept outside an invocation."""
    table = memo_table(name)
    if table is not None and key is not None:
        if key not in table:
            _store(name, key, value)
            if len(table) >= MOST:
                table.pop(next(iter(table)))
        table[key] = value
    return value


def recall(name: str, key: Any) -> tuple[bool, Any]:
    """(found, the answer) of ``key`` in table ``name``: this invocation's, else the open store's (then kept in the
    table too)."""
    table = memo_table(name)
    if table is None or key is None:
        return False, None
    if key in table:
        return True, table[key]
    found, value = _stored(name, key)
    if found:
        if len(table) >= MOST:
            table.pop(next(iter(table)))
        table[key] = value
    return found, value


def memoized(name: str, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, remembered in table ``name`` under ``key`` for the rest of the invocation (the :data:`MOST`
    newest), and read from and written to the open store (:func:`stored_answers`) for a table of
    :data:`STORED_TABLES`; computed every time outside an invocation or for a ``key`` of None (arguments with no
    stable key)."""
    table = memo_table(name)
    if table is None or key is None:
        return compute()
    if key in table:
        return table[key]
    found, value = _stored(name, key)
    if not found:
        value = compute()
        _store(name, key, value)
    if len(table) >= MOST:
        table.pop(next(iter(table)))
    table[key] = value
    return value
