"""``python -m zeroexp.recommend``: which configuration to run (``conf/recommend.yaml``), as a table, JSON or a
self-contained HTML page of each recommendation as a picture (``zeroexp.report.plan_picture``).

Exit codes: 0 answered (also when nothing fits: the answer then lists the nearest changes); 2 bad input, with a
message naming the key.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from zeroexp.config.allocator import AllocatorConfig
from zeroexp.errors import ConfigError
from zeroexp.formulas.peak.checkpointing import MODES
from zeroexp.plan.core import HEADROOM, check_headroom, untraced

__all__ = ["RecommendConfig", "main", "run"]

_STARTED = False
#: The overrides of this command line that only a run reads (zeroexp.cli.plan.split_run_only), told in a note.
_IGNORED: tuple[str, ...] = ()
_OFFLOADS, _PREFETCH = ("none", "optimizer", "full"), ("pre", "post", "none")


@dataclass
class SearchConfig:
    """``recommend.*``: the search's axes and the answer's size."""

    top_k: int = 5
    headroom: float = HEADROOM  # zeroexp.plan.core.HEADROOM: the one rule of plan, recommend and a run
    tie: Optional[float] = None
    strategies: Any = None
    offload: Any = field(default_factory=lambda: ["none"])
    activation_checkpointing: Any = field(default_factory=lambda: ["none", "full"])
    micro_batches: Any = None
    bucket_cap_mb: Any = field(default_factory=lambda: [25, 100])
    prefetch: Any = field(default_factory=lambda: list(_PREFETCH))
    shard_size: Any = None
    sync_each_microbatch: Any = None  # null: both ways (zeroexp.recommend.space.Axes.syncs); or a list of them
    overlap_comm: Any = None  # null: both ways where a row reads it (DeepSpeed's stages 2-3); or a list of them
    verify: Any = None
    verify_model: Any = None
    verify_world_size: Any = None
    verify_steps: Any = 20
    verify_rounds: Any = 2
    verify_batch_size: Any = None
    verify_dir: Any = None


@dataclass
class RecommendConfig:
    """The recommender's keys (conf/recommend.yaml); ``model`` and ``network`` are the planner's config groups."""

    model: Any = None
    network: Any = None
    params: Any = None
    world_size: Any = None
    nodes: Any = None
    gpus_per_node: Any = None
    device_memory: Any = None
    global_batch: Any = None
    global_tokens: Any = None
    precisions: Any = field(default_factory=lambda: ["bf16"])
    wrap: Optional[List[str]] = None
    device: Any = None
    compute_capability: Any = None
    format: str = "table"
    cache: bool = True  # shapes, units, traces of an earlier answer of the same model and code (zeroexp.cell.store)
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)  # the CUDA caching allocator's mode
    recommend: SearchConfig = field(default_factory=SearchConfig)
    # a run's own keys (conf/recommend.yaml): each given fixes its axis (:func:`as_run`)
    strategy: Any = None
    precision: Any = None
    offload: Any = None
    activation_checkpointing: Any = None
    prefetch: Any = None
    batch_size: Any = None
    grad_accum: Any = None


def register() -> None:
    """The runner's schemas (the model and network options extend them) and the recommender's."""
    from zeroexp.config.schemas import register_schemas

    register_schemas()
    ConfigStore.instance().store(name="recommend_schema", node=RecommendConfig)


def _ints(value: Any, key: str, low: int = 1) -> tuple[int, ...] | None:
    if value is None:
        return None
    values = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
        raise ConfigError(key, value, f"null or a list of integers >= {low}")
    return tuple(values)


def _names(value: Any, key: str, accepted: tuple[str, ...]) -> tuple[str, ...]:
    values = [str(v) for v in (value if isinstance(value, (list, tuple, ListConfig)) else [value])]
    bad = [v for v in values if v not in accepted]
    if not values or bad:
        raise ConfigError(key, bad or value, ", ".join(accepted))
    return tuple(dict.fromkeys(values))


def _positive(value: Any, key: str, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, what)
    return value


def _world(cfg: DictConfig) -> tuple[int, int | None]:
    """(world size, ranks per node): ``world_size``, or ``nodes`` x ``gpus_per_node`` (else the network's)."""
    net = cfg.network or {}
    per_node = _positive(cfg.gpus_per_node, "gpus_per_node", "null or an integer >= 1") or net.get("ranks_per_node")
    nodes = _positive(cfg.nodes, "nodes", "null or an integer >= 1")
    n = _positive(cfg.world_size, "world_size", "an integer >= 1 (or nodes= and gpus_per_node=)")
    if n is not None and nodes is not None:
        raise ConfigError("nodes", nodes, "either world_size= or nodes= x gpus_per_node=, not both")
    if n is None and nodes is None:
        raise ConfigError("world_size", None, "an integer >= 1, or nodes= (x gpus_per_node=)", why="neither given")
    if n is None:
        if per_node is None:
            raise ConfigError("gpus_per_node", None, "an integer >= 1", why="nodes= given, the network has no "
                              "ranks_per_node")
        n = nodes * per_node
    return n, per_node


def _precision(name: str) -> tuple[str, bool]:
    """(param_dtype, loss scaling) of a precision option, from its YAML (conf/precision/<name>.yaml)."""
    from zeroexp.recommend.space import CONF_DIR

    node = OmegaConf.load(CONF_DIR / "precision" / f"{name}.yaml")
    return str(node.param_dtype), node.get("loss_scale") is not None


def as_run(cfg: DictConfig) -> DictConfig:
    """A run's own keys on a recommend command line, each fixing its axis: ``strategy=`` (with its ``strategy.*``
    keys) the row alone and its ``bucket_cap_mb`` / ``shard_size``, ``precision=`` the precisions, ``offload=``,
    ``activation_checkpointing=``, ``prefetch=`` their axes, ``batch_size=`` the micro-batch, and with it
    ``grad_accum=`` the global batch (x world_size). A run's key beside the search key it fixes is refused."""
    fixes = {"strategy": "recommend.strategies", "batch_size": "recommend.micro_batches"}
    for key, search in fixes.items():
        if cfg.get(key) is not None and OmegaConf.select(cfg, search) is not None:
            raise ConfigError(search, OmegaConf.select(cfg, search), f"null with {key}= (which fixes it)",
                              why=f"both {key}= and {search}= given")
    if cfg.get("grad_accum") is not None and (cfg.get("batch_size") is None or cfg.global_batch is not None
                                              or cfg.global_tokens is not None):
        raise ConfigError("grad_accum", cfg.grad_accum, "with batch_size= and no global_batch= / global_tokens=",
                          why="it sets the global batch: batch_size x grad_accum x world_size")
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if cfg.get("strategy") is not None:
        if cfg.strategy.get("overlap_comm") is not None:  # refused below stage 2, as a cell refuses it
            from zeroexp.cell.strategy import check_ds_overlap_comm

            check_ds_overlap_comm(cfg.strategy.overlap_comm, cfg.strategy.get("stage"))
        out.recommend.strategies = [str(cfg.strategy.layout)]
        for key, axis in (("bucket_cap_mb", "bucket_cap_mb"), ("shard_size", "shard_size"),
                          ("sync_each_microbatch", "sync_each_microbatch"), ("overlap_comm", "overlap_comm")):
            if cfg.strategy.get(key) is not None:
                out.recommend[axis] = [cfg.strategy[key]]
    if cfg.get("precision") is not None:
        out.precisions = [str(cfg.precision.name)]
    for group in ("offload", "activation_checkpointing", "prefetch"):
        if cfg.get(group) is not None:
            out.recommend[group] = [str(cfg[group].name)]
    if cfg.get("batch_size") is not None:
        out.recommend.micro_batches = [cfg.batch_size]
        if cfg.get("grad_accum") is not None:
            out.global_batch = int(cfg.batch_size) * int(cfg.grad_accum) * _world(cfg)[0]
    return out


def run(cfg: DictConfig, model_overrides: list[str] | None = None) -> dict[str, Any]:
    """Validate a composed recommend config and answer it; :class:`ConfigError` on bad input, before any work."""
    from zeroexp.cli.plan import _device
    from zeroexp.cli.planned_model import answer_store, model_shape, wrap_units
    from zeroexp.plan.core import parse_bytes
    from zeroexp.recommend import MEASURED_TIME_ERROR, Axes, Problem, recommend
    from zeroexp.recommend.core import with_world_size
    from zeroexp.recommend.space import CONF_DIR

    from zeroexp.cli.plan import FORMATS
    from zeroexp.config.known_keys import check_known_keys

    check_known_keys(cfg, RecommendConfig)
    if cfg.format not in FORMATS:
        raise ConfigError("format", cfg.format, ", ".join(FORMATS))
    cfg = as_run(cfg)
    if cfg.network is None:
        raise ConfigError("network", None, "h100_ib, a100_ib (presets) or this_machine (its calibration): the step "
                          "time ranks the configurations")
    r = cfg.recommend
    n, per_node = _world(cfg)
    top_k = _positive(r.top_k, "recommend.top_k", "an integer >= 1")
    headroom = check_headroom(r.headroom, "recommend.headroom")
    if r.tie is not None and (isinstance(r.tie, bool) or not isinstance(r.tie, (int, float)) or r.tie < 0):
        raise ConfigError("recommend.tie", r.tie, "null or a fraction >= 0")
    options = tuple(sorted(p.stem for p in (CONF_DIR / "precision").glob("*.yaml")))
    precisions = _names(cfg.precisions, "precisions", options)
    from zeroexp.formulas import LAYOUTS

    rows = _names(r.strategies, "recommend.strategies", tuple(n for n, row in LAYOUTS.items() if not row.reference)) \
        if r.strategies is not None else tuple(LAYOUTS)
    offloads = _names(r.offload, "recommend.offload", _OFFLOADS)
    ac = _names(r.activation_checkpointing, "recommend.activation_checkpointing", MODES)
    prefetch = _names(r.prefetch, "recommend.prefetch", _PREFETCH)
    caps = list(r.bucket_cap_mb) if isinstance(r.bucket_cap_mb, ListConfig) else [r.bucket_cap_mb]
    if not caps or any(isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0 for c in caps):
        raise ConfigError("recommend.bucket_cap_mb", r.bucket_cap_mb, "a list of positive MiB: [25, 100]")
    micro = _ints(r.micro_batches, "recommend.micro_batches")
    shards = _ints(r.shard_size, "recommend.shard_size", 2)
    syncs = list(Axes.syncs) if r.sync_each_microbatch is None else list(r.sync_each_microbatch) if isinstance(
        r.sync_each_microbatch, ListConfig) else [r.sync_each_microbatch]
    if not syncs or any(not isinstance(v, bool) for v in syncs):
        raise ConfigError("recommend.sync_each_microbatch", r.sync_each_microbatch,
                          "a list of true / false: [false, true] (FSDP's and FSDP2's rows with grad_accum > 1)")
    overlaps = list(Axes.overlaps) if r.overlap_comm is None else list(r.overlap_comm) if isinstance(
        r.overlap_comm, ListConfig) else [r.overlap_comm]
    if not overlaps or any(not isinstance(v, bool) for v in overlaps):
        raise ConfigError("recommend.overlap_comm", r.overlap_comm,
                          "a list of true / false: [false, true] (DeepSpeed's stage 2-3 rows)")
    try:
        memory = parse_bytes(cfg.device_memory if cfg.device_memory is not None else cfg.network.get("device_memory"))
    except ValueError as e:
        raise ConfigError("device_memory", cfg.device_memory, "a size: 80GB, 80GiB (the network gives none)",
                          why=str(e)) from e
    from zeroexp.plan.network import network_of, tokens_per_sample

    tokens = 1 if cfg.model is None else tokens_per_sample(cfg.model)
    samples = _samples(cfg, n, tokens)
    stored: list[str] = []
    with answer_store(cfg, stored):  # a model's shape, units and traces of an earlier answer (zeroexp.cell.store)
        device = _device(cfg, memory)  # its keys refused before the model is built
        shape, model = model_shape(cfg)
        networks = {p: network_of(cfg.network, p, tokens) for p in precisions}
        dtypes = {p: _precision(p) for p in precisions}
        wrap, flops = [], None
        if cfg.model is not None:
            wrap = wrap_units(cfg)
            flops = _flops_of(cfg.model, tuple(wrap))
        peaks = cfg.network.get("peak_flops") or {}
        problem = Problem(shape, n, networks, device, memory, headroom, {p: d for p, (d, _) in dtypes.items()},
                          {p: s for p, (_, s) in dtypes.items()}, tokens, cfg.model, wrap, flops,
                          {p: peaks.get(p) for p in precisions})
        axes = Axes(rows, precisions, offloads, _checkpointing_axis(cfg, ac), samples, micro,
                    tuple(float(c) for c in caps), prefetch, shards, tuple(dict.fromkeys(syncs)),
                    tuple(dict.fromkeys(overlaps)))
        tie = float(r.tie) if r.tie is not None else MEASURED_TIME_ERROR[0]
        overrides = model_overrides if model_overrides is not None else (
            [f"model={model}"] if cfg.model is not None else [])
        with untraced(model):
            answer = recommend(problem, axes, top_k, tie, overrides, per_node, lambda m: with_world_size(problem, m))
    answer.update(model=model, numel=shape.numel, network=cfg.network.name, samples_per_rank=samples,
                  global_batch=samples * n, tokens_per_sample=tokens, precisions=list(precisions),
                  device_semantics=device.name)
    answer["notes"] += _notes(cfg, r.tie, networks, device, tie) + stored
    return answer


def _checkpointing_axis(cfg: DictConfig, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The options of ``recommend.activation_checkpointing`` as their YAML sets them, or, for the one a run's
    ``activation_checkpointing=`` fixed, with its keys as given."""
    from zeroexp.config.checkpointing import checked_option, option

    given = checked_option(cfg) if cfg.get("activation_checkpointing") is not None else None
    return tuple(given if given is not None and given.mode == n else option(n) for n in names)


def _samples(cfg: DictConfig, n: int, tokens: int) -> int:
    """Samples a rank computes per optimizer step: ``global_batch`` (or ``global_tokens``) over the ranks."""
    batch, toks = cfg.global_batch, cfg.global_tokens
    if batch is not None and toks is not None:
        raise ConfigError("global_tokens", toks, "either global_batch= or global_tokens=, not both")
    if toks is not None:
        _positive(toks, "global_tokens", "an integer >= 1")
        if toks % tokens:
            raise ConfigError("global_tokens", toks, f"a multiple of the model's {tokens} tokens a sample")
        batch = toks // tokens
    if batch is None:
        return 8
    _positive(batch, "global_batch", "an integer >= 1 (samples per optimizer step)")
    if batch % n:
        raise ConfigError("global_batch", batch, f"a multiple of world_size={n} (each rank computes as many samples)")
    return batch // n


def _flops_of(model_cfg: Any, wrap: tuple[type, ...]) -> Any:
    """(micro-batch, checkpointing) -> the step's counted FLOPs (``zeroexp.plan.flops.step_flops``): counted at 1
    and 2 samples, the rest F(1) + (m - 1) x (F(2) - F(1)) (every counted op's FLOPs are linear in its batch dim,
    the batch-free ones constant; tests/test_recommend.py holds F(4) to it)."""
    from zeroexp.plan.flops import step_flops

    def flops(m: int, checkpointing: Any) -> float:
        one = step_flops(model_cfg, 1, wrap, checkpointing)
        return one + (m - 1) * (step_flops(model_cfg, 2, wrap, checkpointing) - one) if m > 1 else one
    return flops


def _notes(cfg: DictConfig, tie_given: Any, networks: dict[str, Any], device: Any, tie: float) -> list[str]:
    from zeroexp.recommend import MEASURED_TIME_ERROR

    net = next(iter(networks.values()))
    notes = [f"step time computed on {net.source} (zeroexp.formulas.time.overlap; docs/planner.md, Step time); peaks "
             "by the peak model (docs/planner.md); * judged on state + activations, no peak model for the row"]
    notes.append(f"ties (=k): steps within {100 * tie:.0f} % of each other, "
                 + ("recommend.tie as given" if tie_given is not None else MEASURED_TIME_ERROR[1]))
    if device.name == "cuda":
        notes.append(f"device=cuda: fits judged on reserved memory; not modelled: {', '.join(device.not_modelled)}")
    if cfg.network.get("kind") == "calibration":
        notes.append("a calibration times fp32 compute on this machine: other precisions' compute not modelled")
    if cfg.model is None:
        notes.append("a parameter count: no traced step, judged on model state alone; one token a sample; no FLOPs")
    return notes


def model_overrides(task: list[str]) -> list[str]:
    """The overrides of a recommend command line that say which model, as a cell takes them: ``model=``,
    ``model.<key>=`` and ``+model.<key>=`` as given, the planner's ``wrap=`` as the cell's ``model.wrap=`` (the units
    every strategy of the run then wraps). The run commands recommend prints carry them, so that each builds the
    model that was planned."""
    out = []
    for o in task:
        key, _, value = o.partition("=")
        if key.lstrip("+~").split(".")[0] == "model":
            out.append(o)
        elif key == "wrap" and value not in ("", "null"):
            out.append(f"model.wrap={value}")
    return out


def task(cfg: DictConfig) -> None:
    """Hydra's task: answer and print (a table on stdout; with JSON, the answer alone; with HTML, the answer drawn
    as one page, ``zeroexp.report.plan_picture.answer_page``)."""
    import json

    from hydra.core.hydra_config import HydraConfig
    from rich.console import Console

    from zeroexp.recommend.answer import render

    global _STARTED
    _STARTED = True
    overrides = model_overrides(HydraConfig.get().overrides.task)
    ignored = [f"ignored: {a} (a run's key: the recommendation reads none of it)" for a in _IGNORED]
    console = Console(highlight=False, width=100)
    errors = Console(stderr=True, highlight=False)
    try:
        from zeroexp.cli.verify import settings

        checks = settings(cfg)
        if checks is not None and checks.k > cfg.recommend.top_k:
            cfg.recommend.top_k = checks.k
        with errors.status("searching: the model's shapes, every configuration's step, the fastest ones' peaks"):
            answer = run(cfg, overrides or None)
            answer["notes"] += ignored
    except ConfigError as e:
        errors.print(f"[red]error:[/] {e}")
        sys.exit(2)
    if checks is not None:
        from zeroexp.cli.verify import verify

        if cfg.format == "table":
            render(answer, console)
        answer["verify"] = verify(cfg, answer, checks, lambda line: print(line, file=sys.stderr, flush=True))
    if cfg.format == "json":
        print(json.dumps(answer, indent=1, default=str))
    elif cfg.format == "html":
        from zeroexp.report.plan_picture import answer_page

        sys.stdout.write(answer_page(answer))
    elif checks is None:
        render(answer, console)
    else:
        from zeroexp.cli.verify import render as render_verify

        render_verify(answer["verify"], console)


def main() -> None:
    """``python -m zeroexp.recommend``."""
    from zeroexp.cli.hydra_app import run_hydra_app

    from zeroexp.cli.plan import split_run_only

    global _IGNORED
    register()
    sys.argv[1:], dropped = split_run_only(sys.argv[1:])
    _IGNORED = tuple(dropped)
    run_hydra_app("recommend", task, lambda: _STARTED)
