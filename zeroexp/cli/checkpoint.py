"""``python -m zeroexp.checkpoint convert SRC DST [checkpoint=full|sharded] [strategy=NAME] [world_size=N]``.

Converts a kept zeroexp checkpoint offline, in this one process, without training: its state read whole (a sharded one
through torch.distributed.checkpoint's ``dcp_to_torch_save`` reading, no process group) and written as the other kind
in torch's state-dict layout (``full``: one ``full.pt``; ``sharded``: torch.distributed.checkpoint's files written by
one process, which any world size loads, resharded), recorded for the strategy and world size it is meant for (the
source's by default). ``meta.json`` records the source's cell with the new strategy and world size, and what it was
converted from; ``convert.json`` lists every tensor converted. Then the written checkpoint is read back whole and
compared with the source tensor by tensor (the checkpoint probe's :func:`~zeroexp.probes.checkpoint.moved_state`):
bit-identical, or exit 3 and nothing kept. A cell starts from it with ``checkpoint.load_from=DST``.

Refused before anything is written (exit 2, naming the argument): another command, a key other than the three, a
source that is not a whole zeroexp checkpoint (zeroexp.cell.source), a kind a strategy keeps in a layout of its own
(``StrategyAdapter.moved_kinds``: zro's owner state, DeepSpeed's sharded partitions), a target strategy that does not
read the kind, and a DST that exists and is not empty. The work is done in ``DST.partial`` and renamed when verified.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroexp.cli.plain_args import args_or_help
from zeroexp.errors import ConfigError

__all__ = ["main", "Conversion", "conversion", "convert", "USAGE"]

USAGE = ("usage: python -m zeroexp.checkpoint convert SRC DST [checkpoint=full|sharded] [strategy=NAME] "
         "[world_size=N]")
KEYS = ("checkpoint", "strategy", "world_size")
KINDS = ("full", "sharded")


@dataclass(frozen=True)
class Conversion:
    """A conversion validated: the source (zeroexp.cell.source.Source), where to, the kind, strategy and world size
    the converted checkpoint records."""

    source: Any
    dst: Path
    kind: str
    strategy: str
    world_size: int


def conversion(src: str, dst: str, overrides: list[str]) -> Conversion:
    """Check the arguments and the source (no tensor read, every file hashed); ConfigError names what is refused."""
    from zeroexp.cell.source import CheckpointError, Source
    from zeroexp.strategies import registered

    given: dict[str, str] = {}
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or key not in KEYS:
            raise ConfigError(key or item, value or None, ", ".join(f"{k}=" for k in KEYS),
                              why="convert changes only the checkpoint's kind and the strategy and world size it "
                                  "records; the model and the optimizer are the source's")
        given[key] = value
    try:
        source = Source.read(src)
    except CheckpointError as e:
        raise ConfigError("SRC", src, "the directory of a checkpoint a zeroexp cell kept", why=str(e)) from None
    adapters = registered()
    writer = adapters.get(source.strategy)
    from zeroexp.config.moves import movable_kinds

    movable = movable_kinds()
    why = "no strategy of that name" if writer is None else writer.unreadable(source.kind, Path(source.dir))
    if why:
        raise ConfigError("SRC", src, f"a checkpoint in torch's state-dict layout ({movable}), or DeepSpeed's "
                          "sharded one at stages 1-3 without frozen parameters", why=why)
    kind = given.get("checkpoint", "sharded" if source.kind == "full" else "full")
    if kind not in KINDS:
        raise ConfigError("checkpoint", kind, "full, sharded")
    strategy = given.get("strategy", source.strategy)
    if strategy not in adapters or kind not in adapters[strategy].moved_kinds:
        raise ConfigError("strategy", strategy, f"a strategy that reads {kind} checkpoints: "
                          + ", ".join(n for n, a in sorted(adapters.items()) if kind in a.moved_kinds))
    world = given.get("world_size", str(source.world_size))
    if not world.isdigit() or int(world) < 1:
        raise ConfigError("world_size", world, "a positive integer")
    target = Path(dst).expanduser().resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError("DST", dst, "a new or empty directory", why="it exists and is not empty: convert writes "
                          "a whole checkpoint of its own, never into another")
    return Conversion(source, target, kind, strategy, int(world))


def convert(plan: Conversion, say: Any = print) -> dict[str, Any]:
    """Write ``plan``'s checkpoint and verify it; the manifest (``convert.json``). ``say``: progress, a line each.
    Raises RuntimeError (nothing kept) when the written state is not the source's bit for bit."""
    import torch
    import torch.distributed.checkpoint as dcp

    from zeroexp.cell.source import FORMAT, META, file_sha256
    from zeroexp.probes.checkpoint import moved_reasons, moved_state, state_tensors
    from zeroexp.results.files import write_json
    from zeroexp.strategies._checkpoint import FULL_FILE, compact, read_whole

    src = plan.source
    t0 = time.perf_counter()
    from zeroexp.strategies import registered

    whole = registered()[src.strategy].read_whole(src.kind, Path(src.dir))  # DeepSpeed's sharded: its universal
    tensors = state_tensors(whole["model"], whole["optim"])
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    say(f"read {src.dir} ({src.kind}, written by {src.strategy} at N={src.world_size}, step {src.step}): "
        f"{len(tensors)} tensors, {size / 2**20:.2f} MiB, {time.perf_counter() - t0:.1f} s")
    work = plan.dst.with_name(plan.dst.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        if plan.kind == "full":
            torch.save(compact(whole), work / FULL_FILE)  # a view's padded storage is not the state
        else:  # one process writes every item; a loading strategy at any N reads its own slices (DCP reshards)
            import warnings

            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.save(whole, storage_writer=dcp.FileSystemWriter(work), no_dist=True)
        files = sorted(f for f in work.rglob("*") if f.is_file())
        say(f"wrote {len(files)} files ({plan.kind}) in {work}")
        back = read_whole(plan.kind, work)
        moved = moved_state(whole, back["model"], back["optim"])
        reasons = moved_reasons(moved)
        if reasons or moved["cast"]:
            raise RuntimeError(f"the converted state is not the source's: {'; '.join(r.text for r in reasons)}"
                               + (f"; {len(moved['cast'])} tensors changed dtype" if moved["cast"] else ""))
        say(f"verified: {moved['bit_identical_tensors']} of {moved['compared_tensors']} tensors bit-identical")
        manifest = {"from": src.record(), "to": {"kind": plan.kind, "strategy": plan.strategy,
                                                 "world_size": plan.world_size, "dir": str(plan.dst)},
                    "tensors": [{"tensor": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                                 "bytes": t.numel() * t.element_size()} for n, t in tensors.items()],
                    "tensor_count": len(tensors), "bytes": size,
                    "verified": {k: moved[k] for k in ("compared_tensors", "bit_identical_tensors", "max_abs_diff")},
                    "seconds": time.perf_counter() - t0}
        write_json(work / "convert.json", manifest)
        write_json(work / META, {"format": FORMAT, "kind": plan.kind, "strategy": plan.strategy,
                                 "strategy_label": src.label if plan.strategy == src.strategy else plan.strategy,
                                 "world_size": plan.world_size, "step": src.step,
                                 "cell": {**src.cell, "world_size": plan.world_size}, "converted_from": src.record(),
                                 "files": [{"name": f.relative_to(work).as_posix(), "bytes": f.stat().st_size,
                                            "sha256": file_sha256(f), "rank": 0} for f in files]})
        if plan.dst.exists():
            plan.dst.rmdir()  # empty (conversion() refused any other)
        work.rename(plan.dst)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest


def main(argv: list[str] | None = None) -> None:
    """The command line; exit 0 converted and verified, 2 refused (the argument named), 3 not verified."""
    args = args_or_help(argv, __doc__, USAGE)
    try:
        if args[0] != "convert":
            raise ConfigError("command", args[0], "convert")
        if len(args) < 3:
            raise ConfigError("DST", None, "SRC and DST, then the overrides", why=USAGE)
        plan = conversion(args[1], args[2], args[3:])
    except ConfigError as e:
        print(f"{e}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2) from None
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 - progress on stderr, the answer on stdout
    try:
        manifest = convert(plan, say)
    except RuntimeError as e:
        print(f"not converted: {e}", file=sys.stderr)
        raise SystemExit(3) from None
    print(json.dumps({"dst": str(plan.dst), "kind": plan.kind, "strategy": plan.strategy,
                      "world_size": plan.world_size, "tensors": manifest["tensor_count"], "bytes": manifest["bytes"],
                      "verified": manifest["verified"]}))
