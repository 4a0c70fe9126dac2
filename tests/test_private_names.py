"""Library internals fenced: a private name of torch, Lightning, Hydra/OmegaConf, DeepSpeed or W&B
is used in ``zeroexp/_lib/`` alone, behind a named shim (each with its own test: tests/test_lib_shims.py).

What counts as a use (:func:`private_uses`, over each module's AST):

(a) an ``import`` or ``from ... import`` of a module path of those libraries with a component starting with ``_``
    (``torch._subclasses.fake_tensor``, ``torch.distributed._tools``), or an imported name starting with ``_``
    (``from torch.distributed.distributed_c10d import _resolve_process_group``);
(b) an attribute ``._x`` (one leading underscore, not a dunder) anywhere in a dotted chain rooted at a name imported
    from those libraries (``torch.autograd._profiler_enabled``, ``nn.modules.conv._ConvNd``);
(c) an attribute ``._x``, or a ``getattr``/``hasattr``/``setattr`` string ``"_x"``, on any object, where ``_x`` is in
    :data:`LIBRARY_PRIVATE_ATTRS`: private attributes of those libraries' objects that zeroexp reads or has read
    (``DTensor._local_tensor``, an FSDP handle's ``_shard_param_infos``). Which object an attribute is read on is not
    known statically, so (c) is a list, not a rule: a new private attribute of a library object read through a
    variable is not found until it is added here.

:data:`NOT_YET_FENCED` is what is found outside ``_lib`` today, per file; it can only shrink: a use not in it fails,
and so does an entry no longer found.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zeroexp"
FENCE = PACKAGE / "_lib"
LIBRARIES = frozenset({"torch", "lightning", "pytorch_lightning", "hydra", "omegaconf", "deepspeed", "wandb"})

#: Rule (c): private attributes of the libraries' objects (not of zeroexp's own, nor of the standard library's).
LIBRARY_PRIVATE_ATTRS = frozenset({
    # torch
    "_local_tensor", "_orig_size", "_chunk_with_empty", "_fsdp_param_group", "_get_fsdp_state", "_handle",
    "_is_padding_mask", "_is_root", "_numels_with_padding", "_padded_unsharded_size", "_param_infos",
    "_shard_param_infos", "_shared_param_infos", "_full_param_padded", "_params", "_parameters", "_buffers", "_cdata",
    "_schema", "_opname", "_buckets", "_partition_parameters", "_get_zeros_like_grad_buckets", "_profiler_enabled",
    # Lightning
    "_broadcast_sigterm_tensor", "_register_ddp_hooks", "_after_closure",
    # DeepSpeed
    "_lazy_init_hp_params_optimizer_state", "_hp_mapping",
})

#: What is found outside ``zeroexp/_lib`` today (module path -> names as :func:`private_uses` reports them).
NOT_YET_FENCED: dict[str, set[str]] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _of_library(module: str) -> bool:
    return module.split(".")[0] in LIBRARIES


def private_uses(source: str) -> set[str]:
    """The private library names ``source`` uses (module docstring): (a) module paths and imported names as written,
    (b) the dotted chain from the imported root to the private attribute, (c) ``._x``, or ``"_x"`` for a
    ``getattr``/``hasattr``/``setattr``/``delattr`` string."""
    tree = ast.parse(source)
    found: set[str] = set()
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _of_library(alias.name):
                    if any(_private(part) for part in alias.name.split(".")):
                        found.add(alias.name)
                    roots.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _of_library(node.module):
            if any(_private(part) for part in node.module.split(".")):
                found.add(node.module)
            for alias in node.names:
                if _private(alias.name):
                    found.add(f"{node.module}.{alias.name}")
                roots.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in LIBRARY_PRIVATE_ATTRS:
                found.add(f".{node.attr}")
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in roots and _private(node.attr):
                found.add(".".join([base.id, *reversed(chain)]))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in LIBRARY_PRIVATE_ATTRS):
            found.add(f'"{node.args[1].value}"')
    return found


def _outside_fence() -> dict[str, set[str]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if FENCE in path.parents:
            continue
        found = private_uses(path.read_text(encoding="utf-8"))
        if found:
            out[path.relative_to(ROOT).as_posix()] = found
    return out


def test_private_library_names_only_inside_lib():
    found = _outside_fence()
    new = {path: sorted(names - NOT_YET_FENCED.get(path, set())) for path, names in found.items()}
    new = {path: names for path, names in new.items() if names}
    assert not new, f"private library names outside zeroexp/_lib (put them behind a _lib shim): {new}"


def test_not_yet_fenced_only_shrinks():
    found = _outside_fence()
    gone = {path: sorted(names - found.get(path, set())) for path, names in NOT_YET_FENCED.items()}
    gone = {path: names for path, names in gone.items() if names}
    assert not gone, f"no longer found: remove them from NOT_YET_FENCED: {gone}"


def test_the_rule_catches_planted_uses():
    source = """
import torch
import torch.distributed as dist
import torch.distributed._tools.mem_tracker
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.distributed_c10d import _resolve_process_group, new_group
from lightning.pytorch import Trainer
from zeroexp._lib.memtrack import totals
from . import _sibling

def f(t, trainer):
    torch._C._current_graph_task_id()
    dist._something(t)
    Trainer._private_thing
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
    getattr(t, "_local_tensor", None)
    torch.__version__, torch.nn.Linear, t._own_attribute, totals._cache, _sibling._x
"""
    assert private_uses(source) == {
        "torch.distributed._tools.mem_tracker", "torch._subclasses.fake_tensor",
        "torch.distributed.distributed_c10d._resolve_process_group", "torch._C", "torch._C._current_graph_task_id",
        "dist._something", "Trainer._private_thing", "._broadcast_sigterm_tensor", '"_local_tensor"'}


def test_the_fence_itself_is_scanned_the_same_way():
    """``zeroexp/_lib`` is where the private names live: the rule finds them there (it is not blind to them)."""
    found = set().union(*(private_uses(p.read_text(encoding="utf-8")) for p in FENCE.rglob("*.py")))
    assert "torch.distributed.distributed_c10d._resolve_process_group" in found
