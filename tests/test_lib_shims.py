"""Each shim of ``zeroexp/_lib`` against the installed libraries: a test fails when the private API it wraps moved
(tests/test_private_names.py keeps the private names inside ``_lib``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch


# -- zeroexp._lib.trainer ------------------------------------------------------------------------------------------

def test_skip_sigterm_broadcast_replaces_lightnings_method():
    """The private method exists on Lightning's training epoch loop (a rename would leave the shim setting an
    attribute nothing reads), and the shim makes it a no-op on the trainer's loop."""
    import lightning.pytorch as pl
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from zeroexp._lib.trainer import skip_sigterm_broadcast

    assert callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    loop = trainer.fit_loop.epoch_loop
    assert isinstance(loop, _TrainingEpochLoop)
    skip_sigterm_broadcast(trainer)
    assert "_broadcast_sigterm_tensor" in vars(loop) and loop._broadcast_sigterm_tensor() is None


# -- zeroexp._lib.fake_tensors -------------------------------------------------------------------------------------

def test_fake_tensor_mode_makes_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from zeroexp._lib.fake_tensors import fake_tensor_mode

    mode = fake_tensor_mode()
    assert isinstance(mode, FakeTensorMode)
    with mode:
        t = torch.ones(3, 5)
    assert isinstance(t, FakeTensor) and t.shape == (3, 5)
    assert isinstance(mode.from_tensor(torch.zeros(2)), FakeTensor)


def test_real_tensors_inside_a_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensor

    from zeroexp._lib.fake_tensors import fake_tensor_mode, real_tensors

    with fake_tensor_mode():
        with real_tensors():
            t = torch.arange(4)
        assert not isinstance(t, FakeTensor) and t.tolist() == [0, 1, 2, 3]
        assert isinstance(torch.arange(4), FakeTensor)


def test_is_data_dependent_names_fake_tensors_refusal():
    from zeroexp._lib.fake_tensors import fake_tensor_mode, is_data_dependent

    with fake_tensor_mode():
        t = torch.ones(3)
        with pytest.raises(Exception) as info:
            t.tolist()  # reads the values a fake tensor has not
    assert is_data_dependent(info.value)
    assert not is_data_dependent(ValueError("x"))


def test_untraceable_names_the_op_a_fake_step_cannot_run():
    from zeroexp._lib.fake_tensors import fake_tensor_mode, untraceable

    with fake_tensor_mode():
        t = torch.ones(3)
        with pytest.raises(Exception) as shape:
            torch.nonzero(t)  # a data-dependent output shape
        with pytest.raises(Exception) as values:
            t.sum().item()
    assert "aten.nonzero" in untraceable(shape.value) and "DynamicOutputShapeException" in untraceable(shape.value)
    assert "DataDependentOutputException" in untraceable(values.value)
    wrapped = RuntimeError("in the step")
    wrapped.__cause__ = shape.value
    assert untraceable(wrapped) == untraceable(shape.value)
    assert untraceable(ValueError("x")) is None


# -- public APIs that replaced private ones (what the code now relies on) ----------------------------------------

@pytest.fixture
def fake_group():
    import torch.distributed as dist

    dist.init_process_group("fake", rank=0, world_size=4)  # the dry run's: no store, torch makes its own
    try:
        yield 4
    finally:
        dist.destroy_process_group()


def test_fake_group_without_a_store(fake_group):
    import torch.distributed as dist

    assert dist.get_backend() == "fake" and dist.get_world_size() == fake_group
    t = torch.ones(2)
    dist.all_reduce(t)  # returns at once, nothing reduced
    assert t.tolist() == [1.0, 1.0]


def test_fsdp2_public_reads_equal_the_private_ones(fake_group):
    """zeroexp.strategies.fsdp2 reads a shard with ``to_local()`` under no_grad (the DTensor's own local tensor, as
    ``_local_tensor`` was) and a parameter's size from ``sharded_param.shape`` (torch's ``FSDPParam._orig_size``)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from zeroexp.strategies.fsdp2 import _local

    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", (fake_group,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        d = p.detach()
        assert isinstance(d, DTensor) and _local(d) is d._local_tensor
        with torch.no_grad():
            assert p.to_local().untyped_storage().data_ptr() == p._local_tensor.untyped_storage().data_ptr()
    for layer in model:
        for fsdp_param in layer._get_fsdp_state()._fsdp_param_group.fsdp_params:
            assert fsdp_param.sharded_param.shape == fsdp_param._orig_size


def test_fsdp1_allocated_by_size_reads_a_fake_storage_by_its_size():
    """A fake tensor's storage has no data pointer, so torch's ``_flat_param._data_ptr_allocated`` calls it freed;
    inside the context a storage is allocated while it has bytes (FSDP's ``_free_storage`` resizes it to 0); torch's
    function is back after."""
    import torch
    from torch.distributed.fsdp import _flat_param

    from zeroexp._lib.fake_tensors import fake_tensor_mode
    from zeroexp._lib.fsdp1 import allocated_by_size

    torchs = _flat_param._data_ptr_allocated
    with fake_tensor_mode():
        fake = torch.empty(8)
        assert not torchs(fake)  # the assert FSDP1's SHARD_GRAD_OP with use_orig_params trips in a dry run
        with allocated_by_size() as active:
            assert active and _flat_param._data_ptr_allocated(fake)
            fake.untyped_storage().resize_(0)
            assert not _flat_param._data_ptr_allocated(fake)
    assert _flat_param._data_ptr_allocated is torchs


# -- zeroexp._lib.fsdp2 --------------------------------------------------------------------------------------------

def test_fsdp2_chunking_replaces_and_restores_torchs_function(fake_group):
    """FSDP2's parameter module has the private ``_chunk_with_empty`` it calls; inside the context it is the given
    function (torch's own passed as ``original``), fully_shard shards through it, and torch's is back after."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from zeroexp._lib.fsdp2 import fsdp2_chunking

    torchs = _fsdp_param._chunk_with_empty
    calls = []

    def chunk(tensor, num_chunks, dim, original):
        calls.append((tuple(tensor.shape), num_chunks, dim))
        assert original is torchs
        return original(tensor, num_chunks, dim)

    with fsdp2_chunking(chunk) as active:
        assert active and _fsdp_param._chunk_with_empty is not torchs
        fully_shard(nn.Linear(6, 5), mesh=init_device_mesh("cpu", (fake_group,)))
    assert _fsdp_param._chunk_with_empty is torchs
    assert ((5, 6), fake_group, 0) in calls and ((5,), fake_group, 0) in calls


def test_fsdp2_post_forward_mesh_in_builds_the_mesh_in_the_context_and_restores(fake_group):
    """Under FakeTensorMode, fully_shard with an int reshard_after_forward fails in torch's
    ``_get_post_forward_mesh_info`` (it reads ``DeviceMesh.mesh``); inside the context it is built with real tensors:
    each unit's post-forward group has 2 of the 4 ranks. Torch's function is back after."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    from zeroexp._lib.fake_tensors import fake_tensor_mode, real_tensors
    from zeroexp._lib.fsdp2 import fsdp2_param_group, fsdp2_post_forward_mesh_in

    torchs, mesh = _fsdp_init._get_post_forward_mesh_info, init_device_mesh("cpu", (fake_group,))
    with fake_tensor_mode():
        with pytest.raises(AssertionError, match="FakeTensor"):
            fully_shard(nn.Linear(8, 8), mesh=mesh, reshard_after_forward=2)
        with fsdp2_post_forward_mesh_in(real_tensors) as active:
            unit = fully_shard(nn.Linear(8, 8), mesh=mesh, reshard_after_forward=2)
    assert active and _fsdp_init._get_post_forward_mesh_info is torchs
    assert fsdp2_param_group(unit).post_forward_mesh_info.shard_mesh_size == 2


# -- zeroexp._lib.profiler -----------------------------------------------------------------------------------------

def test_profiler_enabled_follows_the_profiler():
    from torch.profiler import ProfilerActivity, profile

    from zeroexp._lib.profiler import profiler_enabled

    assert profiler_enabled() is False
    with profile(activities=[ProfilerActivity.CPU]):
        assert profiler_enabled() is True
    assert profiler_enabled() is False


def test_is_torch_op_finds_the_operators_in_the_event_tree():
    from torch.profiler import ProfilerActivity, profile, record_function

    from zeroexp._lib.profiler import is_torch_op

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("zx_mark"):
            torch.ones(3).add(1)
    ops, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if is_torch_op(e):
            ops.append(e.name)
    assert "aten::add" in ops and "zx_mark" in ops  # record_function's range is a TorchOp record too


# -- zeroexp._lib.modules ------------------------------------------------------------------------------------------

def test_conv_base_is_every_convolutions_base():
    from torch import nn

    from zeroexp._lib.modules import conv_base

    base = conv_base()
    for cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                nn.LazyConv2d):
        assert issubclass(cls, base)
    assert not issubclass(nn.Linear, base) and not issubclass(nn.RNNBase, base)


def test_hybrid_shard_zero2_is_fsdps_member():
    from torch.distributed.fsdp import ShardingStrategy

    from zeroexp._lib.modules import hybrid_shard_zero2

    member = hybrid_shard_zero2()
    assert isinstance(member, ShardingStrategy) and member.name == "_HYBRID_SHARD_ZERO2"
    assert member not in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.SHARD_GRAD_OP)


def test_wrapper_prefixes_are_what_the_wrappers_put_in_a_path():
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from zeroexp._lib.modules import wrapper_prefixes

    prefixes = wrapper_prefixes()
    names = [n for n, _ in nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2))).named_parameters()]
    assert names == ["0." + prefixes["checkpoint"] + "weight", "0." + prefixes["checkpoint"] + "bias"]
    assert prefixes["fsdp"] == "_fsdp_wrapped_module."  # FSDP1 needs a process group to wrap: its name, read
    from zeroexp._lib.modules import strip_wrappers

    assert strip_wrappers(names[0]) == "0.weight"


# -- zeroexp._lib.memtrack.mem_tracker -----------------------------------------------------------------------------

def test_mem_tracker_follows_storages():
    from torch.distributed._tools import MemTracker

    from zeroexp._lib.memtrack import mem_tracker, totals

    mt = mem_tracker()
    assert isinstance(mt, MemTracker)
    with mt:
        t = torch.zeros(1024)  # 4 KiB
        peak, _ = totals(mt.get_tracker_snapshot("peak"), "cpu")
    assert peak >= t.numel() * t.element_size()


def test_import_mem_tracker_imports_torchs_module():
    import sys

    from zeroexp._lib.memtrack import import_mem_tracker

    import_mem_tracker()
    assert hasattr(sys.modules["torch.distributed._tools.mem_tracker"], "MemTracker")
    assert "zeroexp._lib.step_memtrack" in sys.modules


# -- zeroexp._lib.step_memtrack ------------------------------------------------------------------------------------

def test_step_mem_tracker_overrides_methods_mem_tracker_has():
    """The private MemTracker methods the step's tracker overrides exist on torch's class (a rename would leave the
    override uncalled)."""
    from torch.distributed._tools import MemTracker

    from zeroexp._lib.memtrack import step_mem_tracker
    from zeroexp._lib.step_memtrack import StepMemTracker

    assert isinstance(step_mem_tracker(), StepMemTracker)
    for method in ("_register_global_optimizer_hook", "_track_module_params_and_buffers", "_update_snap",
                   "_update_peak_stats", "_update_and_maybe_create_winfos", "_track", "get_tracker_snapshot",
                   "__torch_dispatch__"):
        assert callable(getattr(MemTracker, method, None)), method


def test_step_mem_tracker_counts_each_storage_in_blocks():
    """``StepMemTracker(block)`` counts every storage in blocks (CUDA's 512 B, torch's MemTracker's own rule for CUDA
    storages) whatever its device: a 4-byte scalar, a storage grown from 0 bytes by ``resize_``; an empty one 0."""
    from zeroexp._lib.memtrack import step_mem_tracker, totals

    for block, scalar, grown in ((1, 4, 12), (512, 512, 512)):
        mt = step_mem_tracker(block)
        with mt:
            before, _ = totals(mt.get_tracker_snapshot("current"), "cpu")
            s = torch.zeros(())  # 4 B
            e = torch.empty(0)
            after_s, _ = totals(mt.get_tracker_snapshot("current"), "cpu")
            e.untyped_storage().resize_(12)  # FSDP's storage-resize alloc: 0 B, then grown
            after_e, _ = totals(mt.get_tracker_snapshot("current"), "cpu")
            del s
            freed, _ = totals(mt.get_tracker_snapshot("current"), "cpu")
        assert (after_s - before, after_e - after_s, after_e - freed) == (scalar, grown, scalar), block


class _Func(torch.nn.Module):
    """A function as a module outside the model's named hierarchy, as transformers' hub kernels wrap one (``Func``)."""

    def __init__(self, inner: torch.nn.Module | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a registered child: ModTracker names it by its class

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2 if self.inner is not None else x + 1


class _CallsNestedFuncs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        object.__setattr__(self, "func", _Func(_Func()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.func(self.lin(x))


@pytest.mark.parametrize("tracker", ["mem_tracker", "step_mem_tracker"])
def test_step_mem_tracker_is_quiet_where_a_module_name_repeats(tracker):
    """A module outside the named hierarchy inside another of its class (two ``Func``): torch's MemTracker warns that
    its module hierarchy may be messed up (``NAME_REPEATED``) and replaces ``warnings.formatwarning``; the step's
    tracker (the planner's and the memory probe's) neither warns nor leaves the format changed, and counts the step."""
    import warnings

    from zeroexp._lib import memtrack
    from zeroexp._lib.step_memtrack import NAME_REPEATED

    model, fmt = _CallsNestedFuncs(), warnings.formatwarning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mt = getattr(memtrack, tracker)()
        with mt:
            model(torch.ones(2, 4)).sum().backward()
        repeated = [w for w in seen if NAME_REPEATED in str(w.message)]
        changed = warnings.formatwarning is not fmt
        warnings.formatwarning = fmt
    if tracker == "mem_tracker":  # torch's own: the warning this shim silences still comes (else drop the shim)
        assert repeated and changed
    else:
        assert not repeated and not changed
        assert mt.get_tracker_snapshot("peak")


# -- zeroexp._lib.checkpointing ------------------------------------------------------------------------------------

def test_checkpoint_modules_wraps_the_classes_non_reentrant():
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper

    from zeroexp._lib.checkpointing import checkpoint_modules, checkpoint_prefix

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    checkpoint_modules(model, (nn.Linear,))
    wrapped = [m for m in model if isinstance(m, CheckpointWrapper)]
    assert len(wrapped) == 2 and all(m.checkpoint_impl == CheckpointImpl.NO_REENTRANT for m in wrapped)
    names = [name for name, _ in model.named_parameters()]
    assert checkpoint_prefix() == "_checkpoint_wrapped_module." and all(checkpoint_prefix() in n for n in names)
    assert sorted(n.replace(checkpoint_prefix(), "") for n in names) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    model(torch.ones(3, 4)).sum().backward()


def test_fsdp2_param_group_of_a_unit(fake_group):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zeroexp._lib.fsdp2 import fsdp2_param_group

    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU())
    fully_shard(model[0], mesh=init_device_mesh("cpu", (fake_group,)))
    group = fsdp2_param_group(model[0])
    assert [tuple(q.sharded_param.shape) for q in group.fsdp_params] == [(5, 6), (5,)]
    assert fsdp2_param_group(model[1]) is None and fsdp2_param_group(model) is None


# -- zeroexp._lib.storages -----------------------------------------------------------------------------------------

def test_storage_address_is_one_per_storage():
    from zeroexp._lib.fake_tensors import fake_tensor_mode
    from zeroexp._lib.storages import storage_address

    t = torch.zeros(8)
    assert storage_address(t[2:].untyped_storage()) == storage_address(t.view(2, 4).untyped_storage())
    assert storage_address(t.untyped_storage()) != storage_address(torch.zeros(8).untyped_storage())
    with fake_tensor_mode():  # a fake storage: the address still names it
        f = torch.zeros(8)
        assert storage_address(f[1:].untyped_storage()) == storage_address(f.untyped_storage()) != 0


# -- zeroexp._lib.hydra_internals ----------------------------------------------------------------------------------

def test_hydras_classes_have_the_methods_zeroexp_patches():
    import inspect

    from zeroexp._lib.hydra_internals import config_loader_class, hydra_class

    assert list(inspect.signature(hydra_class().get_mode).parameters) == ["self", "config_name", "overrides"]
    assert list(inspect.signature(config_loader_class().load_configuration).parameters) == [
        "self", "config_name", "overrides", "run_mode", "from_shell", "validate_sweep_overrides"]
    assert list(inspect.signature(config_loader_class().get_group_options).parameters) == [
        "self", "group_name", "results_filter", "config_name", "overrides"]


def test_hydras_config_loader_makes_the_repository_that_lists_groups():
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.object_type import ObjectType

    from zeroexp._lib.hydra_internals import caching_repo
    from zeroexp.cli.hydra_app import CONF_DIR

    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(CONF_DIR))
    repo = caching_repo(loader, "config", [])
    assert "ddp" in repo.get_group_options("strategy", ObjectType.CONFIG)
    assert repo.get_group_options("strategy", ObjectType.CONFIG) == loader.get_group_options("strategy")


def test_hydras_basic_sweeper_splits_a_sweep_into_jobs():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from zeroexp._lib.hydra_internals import basic_sweeper_class

    parsed = OverridesParser.create().parse_overrides(["a=1,2", "b=x,y,z"])
    batches = basic_sweeper_class().split_arguments(parsed, None)
    assert [list(job) for batch in batches for job in batch] == [
        [f"a={a}", f"b={b}"] for a in (1, 2) for b in "xyz"]


# -- zeroexp._lib.dispatch -----------------------------------------------------------------------------------------

def test_dispatch_mode_base_sees_ops_and_their_argument_names():
    from zeroexp._lib.dispatch import dispatch_mode_base, op_argument_names

    seen = {}

    class Names(dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[str(func)] = op_argument_names(func)
            return func(*args, **(kwargs or {}))

    with Names():
        torch.ones(2).add(torch.ones(2), alpha=2)
    assert seen["aten.add.Tensor"] == ["self", "other", "alpha"]
    assert op_argument_names(torch.ops._c10d_functional.all_reduce.default) == ["input", "reduce_op", "group_name"]


def test_process_group_named_resolves_a_groups_name(fake_group):
    import torch.distributed as dist

    from zeroexp._lib.dispatch import process_group_named

    world = dist.group.WORLD
    assert process_group_named(world.group_name) is world
    with pytest.raises((RuntimeError, ValueError, KeyError)):
        process_group_named("no such group")


# -- zeroexp._lib.parallel -----------------------------------------------------------------------------------------

@pytest.fixture
def gloo_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_grad_buckets_hold_the_models_parameters(gloo_group):
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from zeroexp._lib.parallel import ddp_grad_buckets

    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model = DistributedDataParallel(net)
    numels = sorted(p.numel() for bucket in ddp_grad_buckets(model) for p in bucket.parameters())
    assert numels == sorted(p.numel() for p in net.parameters())


@pytest.mark.parametrize("bucket_view", [False, True])
def test_zero_partitions_and_buckets(gloo_group, bucket_view):
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from zeroexp._lib.parallel import zero_buckets, zero_partitions

    net = nn.Linear(4, 3)
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.SGD, lr=0.1,
                                  parameters_as_bucket_view=bucket_view)
    owned = zero_partitions(opt)
    assert len(owned) == 1 and sorted(p.numel() for g in owned[0] for p in g["params"]) == [3, 12]
    buckets = zero_buckets(opt)
    if bucket_view:
        assert sum(b.numel() for device_buckets in buckets for b in device_buckets) == 15
    else:
        assert isinstance(buckets, list)


def test_lightnings_private_hooks_exist():
    """The two Lightning methods zeroexp's strategy and DeepSpeed precision plugin call, with the arguments they pass
    (a rename or a new signature fails here, not in a rank)."""
    import inspect

    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy

    assert list(inspect.signature(DDPStrategy._register_ddp_hooks).parameters) == ["self"]
    assert list(inspect.signature(Precision._after_closure).parameters) == ["self", "model", "optimizer"]


def test_after_closure_runs_lightnings_hook():
    from zeroexp._lib.parallel import after_closure, register_ddp_hooks

    calls = []

    class Plugin:
        def _after_closure(self, model, optimizer):
            calls.append((model, optimizer))
            return "ran"

        def _register_ddp_hooks(self):
            calls.append("hooks")

    assert after_closure(Plugin(), "m", "o") == "ran"
    register_ddp_hooks(Plugin())
    assert calls == [("m", "o"), "hooks"]


# -- zeroexp._lib.deepspeed_internals ------------------------------------------------------------------------------

def test_deepspeeds_optimizers_have_the_link_and_set_the_mapping():
    """The private method exists on the stage 1/2 and BF16 optimizers, and their source sets ``_hp_mapping`` (a
    rename in DeepSpeed fails here, not in a checkpoint's restore)."""
    import inspect

    pytest.importorskip("deepspeed")
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (DeepSpeedZeroOptimizer, BF16_Optimizer):
        assert callable(getattr(cls, "_lazy_init_hp_params_optimizer_state", None))
        assert "._hp_mapping = None" in inspect.getsource(cls)


def test_link_optimizer_state_and_linked_to_fp32_partition():
    from zeroexp._lib.deepspeed_internals import link_optimizer_state, linked_to_fp32_partition

    calls = []

    class Stage2:
        def _lazy_init_hp_params_optimizer_state(self):
            calls.append("linked")

    assert link_optimizer_state(Stage2()) is True and calls == ["linked"]
    assert link_optimizer_state(object()) is False
    p = torch.nn.Parameter(torch.ones(2))
    assert not linked_to_fp32_partition(p)
    p._hp_mapping = None  # what DeepSpeed sets where this rank holds none of the parameter
    assert linked_to_fp32_partition(p)


def test_own_parameters_and_buffers_are_the_modules_live_dicts():
    from torch import nn

    from zeroexp._lib.modules import own_buffers, own_parameters

    inner = nn.BatchNorm1d(3)
    outer = nn.Sequential(inner)
    assert list(own_parameters(inner)) == ["weight", "bias"] and own_parameters(outer) == {}
    assert list(own_buffers(inner)) == ["running_mean", "running_var", "num_batches_tracked"]
    new = nn.Parameter(torch.zeros(3))
    own_parameters(inner)["weight"] = new
    own_buffers(inner)["running_mean"] = torch.ones(3)
    assert inner.weight is new and inner.running_mean.tolist() == [1.0, 1.0, 1.0]
    assert own_parameters(inner) is own_parameters(inner)


# -- zeroexp._lib.fsdp1 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_flat_param_internals(fake_group, use_orig_params):
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from zeroexp._lib import fsdp1

    cpu = torch.device("cpu")  # FSDP1 on CPU runs with gloo given device_id (as zeroexp.strategies.fsdp)
    inner = nn.Linear(4, 3)
    model = FSDP(nn.Sequential(FSDP(inner, use_orig_params=use_orig_params, device_id=cpu), nn.Linear(3, 2)),
                 use_orig_params=use_orig_params, device_id=cpu)
    units = FSDP.fsdp_modules(model)
    assert not fsdp1.is_root(model)  # None until FSDP's lazy init, in the first forward
    model(torch.ones(2, 4)).sum().backward()
    assert fsdp1.is_root(model) and not fsdp1.is_root(units[1])
    flat = fsdp1.flat_param(units[1])
    assert flat is not None and [info.param_name for info in fsdp1.param_infos(flat)] == ["weight", "bias"]
    assert list(fsdp1.shared_param_infos(flat)) == []
    assert list(fsdp1.numels(flat)) == [12, 3]
    pieces = [k for k, pad in zip(fsdp1.numels_with_padding(flat), fsdp1.is_padding_mask(flat)) if not pad]
    assert pieces == [12, 3] and fsdp1.padded_unsharded_numel(flat) == 16  # 15 padded to 4 ranks
    shard = fsdp1.shard_param_infos(flat)
    assert [info.numel_in_shard for info in shard if info.in_shard] == [4]  # rank 0: the weight's first 4
    assert hasattr(flat, "_full_param_padded") and fsdp1.full_param_padded(flat) is flat._full_param_padded
    params = fsdp1.orig_params(flat)
    assert (params is not None and len(params) == 2) if use_orig_params else not params


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hf_masks_make_a_fake_trace_save_what_the_run_saves():
    """A Llama with no KV cache (training): without the shim the fake trace keeps a packed-sequence mask and repeats
    grouped K/V, another path than the run's; with it, the fake trace's saved bytes are the real forward's."""
    import torch
    from omegaconf import OmegaConf

    from zeroexp._lib.hf_masks import install_unpacked_positions
    from zeroexp.models import build_model, loss_of, zeros_batch
    from zeroexp.plan.activations import trace_activations

    cfg = OmegaConf.create({"_target_": "transformers.LlamaForCausalLM", "name": "llama", "input_shape": [16],
                            "dtype": "long", "low": 0, "high": 64, "loss": "next_token", "wrap": None,
                            "config": {"_target_": "transformers.LlamaConfig", "hidden_size": 32,
                                       "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                       "num_key_value_heads": 2, "vocab_size": 64, "use_cache": False}})
    net, saved = build_model(cfg), {}
    assert install_unpacked_positions()  # transformers' masking module is loaded by the build
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    batch = zeros_batch(cfg, 2)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(cfg)(net(batch), batch)
    assert trace_activations(cfg, 2).saved_bytes == sum(saved.values())


def test_grouped_mm_meta_takes_every_floating_dtype():
    """torch's own meta kernel of ``aten._grouped_mm`` takes bf16 alone; the shim's takes fp32 too, on the meta
    device and on fake tensors, forward and backward, with the CPU kernel's output shape."""
    import torch

    from zeroexp._lib.fake_tensors import fake_tensor_mode
    from zeroexp._lib.grouped_mm import grouped_mm_op, install_grouped_mm_meta

    assert install_grouped_mm_meta() and install_grouped_mm_meta()  # idempotent
    assert grouped_mm_op() is torch.ops.aten._grouped_mm  # the FLOP counter's key (zeroexp.plan.flops)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    real = torch._grouped_mm(torch.randn(8, 8), torch.randn(2, 8, 4), offs=offs)
    with torch.device("meta"):
        out = torch._grouped_mm(torch.randn(8, 8), torch.randn(2, 8, 4), offs=offs.to("meta"))
    assert out.shape == real.shape and out.dtype == torch.float32
    with fake_tensor_mode():
        a = torch.randn(8, 4, requires_grad=True)
        b = torch.randn(2, 4, 6, requires_grad=True)
        torch._grouped_mm(a, b, offs=torch.tensor([3, 8], dtype=torch.int32)).sum().backward()
        assert a.grad.shape == a.shape and b.grad.shape == b.shape
    with pytest.raises(RuntimeError, match="one floating dtype"), torch.device("meta"):
        torch._grouped_mm(torch.randn(8, 4), torch.randn(2, 4, 6, dtype=torch.bfloat16), offs=offs.to("meta"))


def test_sharded_tensor_holds_this_ranks_pieces_and_every_ranks_places(fake_group):
    """A 3 x 4 tensor cut at element 5 of 12 over two ranks (zeroexp's ZeRO buckets cut anywhere): rank 0 holds one
    whole row and the first column of the next, as views into its flat shard; the metadata places rank 1's two
    rectangles too, and the whole tensor is covered."""
    from zeroexp._lib.sharded_tensor import is_sharded_tensor, sharded_tensor
    from zeroexp.strategies._zero_checkpoint import rectangles

    flat = torch.arange(12, dtype=torch.float32)
    mine = rectangles((3, 4), 0, 5)
    assert [(o, z) for o, z, _ in mine] == [((0, 0), (1, 4)), ((1, 0), (1, 1))]
    pieces = [(flat[f:f + z[0] * z[1]].view(z), o) for o, z, f in mine]
    places = [(o, z, 0) for o, z, _ in mine] + [(o, z, 1) for o, z, _ in rectangles((3, 4), 5, 12)]
    st = sharded_tensor(pieces, places, (3, 4), torch.float32, 0, torch.device("cpu"))
    assert is_sharded_tensor(st) and not is_sharded_tensor(flat) and tuple(st.size()) == (3, 4)
    assert [s.tensor.data_ptr() for s in st.local_shards()] == [flat.data_ptr(), flat[4:].data_ptr()]
    shards = st.metadata().shards_metadata
    assert sum(m.shard_sizes[0] * m.shard_sizes[1] for m in shards) == 12 and len(shards) == 2 + 2
    assert rectangles((), 0, 1) == [((), (), 0)] and rectangles((), 1, 1) == []  # a scalar parameter: itself
    scalar = sharded_tensor([(flat[3:4].view(()), ())], [((), (), 0)], (), torch.float32, 0, torch.device("cpu"))
    assert tuple(scalar.size()) == () and scalar.local_shards()[0].tensor.data_ptr() == flat[3:].data_ptr()


def test_flop_counts_are_torchs_registry_and_attention_counts():
    """zeroexp._lib.flop_counts: a matmul's FLOPs as FlopCounterMode counts them (2 x M x K x N), none for an
    elementwise op; attention's 4 x B x H x S x S x D forward, 2.5 times it backward."""
    import torch

    from zeroexp._lib.flop_counts import attention_flops, op_flops

    a, b = torch.empty(3, 5), torch.empty(5, 7)
    assert op_flops(torch.ops.aten.mm.default, (a, b), {}, torch.empty(3, 7)) == 2 * 3 * 5 * 7
    assert op_flops(torch.ops.aten.add.Tensor, (a, a), {}, a) is None
    q = torch.Size([2, 4, 16, 8])
    assert attention_flops(q, q, q) == 4 * 2 * 4 * 16 * 16 * 8
    assert attention_flops(q, q, q, q) == 10 * 2 * 4 * 16 * 16 * 8
