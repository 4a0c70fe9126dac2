"""Where training parts from the unsharded reference (zeroexp.probes.divergence): cells made to diverge on purpose
name the first step, the tensor, what of it and the cause; correct cells replayed on request locate nothing."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from conftest import HF_LLAMA, STEPS, WINDOWS, compose_config
from zeroexp.config.schemas import validate
from zeroexp.launch.runner import run_cell
from zeroexp.models import build_model
from zeroexp.probes.causes import ROUNDOFF, rounding_format, uniform_scale
from zeroexp.probes.divergence import Watch, replay_wanted
from zeroexp.probes.reference import PREFIX, Reference
from zeroexp.rank.faults import ENV as FAULT_ENV

TRACE = "probes.trace_divergence=true"
#: conftest's BASE without the mlp's width: the cells of models that have none.
OWN_SIZE = ("logger=none", f"steps={STEPS}", *WINDOWS)


@pytest.fixture
def faulted(compose, tmp_path, monkeypatch):
    """``faulted(fault, *overrides)``: the cell run with ``ZEROEXP_FAULT=fault`` (None: none); its equivalence
    section (``faulted.dirs``: the cells' directories, in order)."""

    def run(fault: str | None, *overrides: str) -> dict:
        if fault:
            monkeypatch.setenv(FAULT_ENV, fault)
        mlp = not any(o.startswith("model=") for o in overrides)
        cfg = compose(*overrides) if mlp else compose(*overrides, base=OWN_SIZE)
        result = run_cell(cfg, tmp_path / f"cell{len(run.dirs)}")
        assert result.status == "ok", result.error
        run.dirs.append(result.cell_dir)
        run.summaries.append(result.summary)
        return result.summary["equivalence"]

    run.dirs, run.summaries = [], []
    return run


def test_perturbed_batch_names_the_rank_step_and_gradient(faulted, capsys):
    eq = faulted("1:4:perturb", "strategy=ddp", "world_size=2")  # rank 1 trains on other data at step 4
    assert eq["check"] == "FAIL" and eq["max_abs_err"] > eq["threshold"], eq
    d = eq["divergence"]  # a FAIL replays the cell unasked
    assert (d["found"], d["step"], d["kind"], d["cause"], d["ranks"]) == (True, 4, "grad", "rank_batch", [1]), d
    assert d["size"] > d["bound"] and d["steps_compared"] == 5
    told = _explained(faulted.dirs[-1], capsys)  # python -m zeroexp.explain CELL: the same, from the files
    assert told["failed"] == 1 and told["checks"][0]["check"] == "equivalence"
    assert told["equivalence"]["divergence"] == d and told["equivalence"]["replay"] is None
    from zeroexp.report import build_report  # a sweep's report: the FAIL, where it parted, the command explaining it

    (line,) = build_report(faulted.dirs[-1].parent).verdicts.failures
    assert "equivalence FAIL" in line and "step 4" in line and "rank_batch" in line
    assert shlex.split(line.rpartition("`python")[2].rstrip(")`"))[-1] == str(faulted.dirs[-1].resolve())


def test_a_fail_not_replayed_is_explained_by_the_command_that_replays_it(faulted, capsys):
    eq = faulted("1:1:perturb", "strategy=ddp", "world_size=2", "probes.trace_divergence=false")
    assert eq["check"] == "FAIL" and "divergence" not in eq
    command = _explained(faulted.dirs[-1], capsys)["equivalence"]["replay"]
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "zeroexp"] and words[-1] == TRACE
    validate(compose_config(words[3:]))  # runs as printed: it composes and validates


def _explained(cell_dir, capsys) -> dict:
    from zeroexp.cli.explain import main

    capsys.readouterr()
    main([str(cell_dir), "format=json"])
    return json.loads(capsys.readouterr().out)


def test_frozen_parameter_updated_on_a_sharded_model(faulted):
    """lora_gpt (a frozen GPT under LoRA adapters) under FSDP2 at N=3: rank 0's shard of the first frozen parameter
    moved after step 1."""
    eq = faulted("0:1:frozen", "strategy=fsdp2_full", "world_size=3", "model=lora_gpt")
    first_frozen = next(n for n, p in build_model(compose_config(["model=lora_gpt"]).model).named_parameters()
                        if not p.requires_grad)
    d = eq["divergence"]
    assert eq["check"] == "FAIL"
    assert (d["step"], d["tensor"], d["kind"], d["cause"]) == (1, first_frozen, "param", "frozen_updated"), d
    assert d["size"] == pytest.approx(1e-2, rel=1e-3) and not d["relative"]
    g = faulted.summaries[-1]["grad_norm"]  # frozen parameters hold no gradient: the norm is the trainable ones'
    assert (g["check"], g["source"], g["ranks"]) == ("PASS", "probe", [0, 1, 2]), g


def test_gradients_rounded_to_bf16_in_an_fp32_cell(faulted):
    """The equivalence PASSes (AdamW's update hardly moves with a gradient's last bits), the replay asked for finds
    the rounding at its step."""
    eq = faulted("0:2:round_grads", "strategy=fsdp2_full", "world_size=2", TRACE)
    d = eq["divergence"]
    assert (d["found"], d["step"], d["kind"], d["cause"]) == (True, 2, "grad", "rounding"), d
    assert ROUNDOFF["bf16"] / 8 <= d["evidence"]["relative"] <= 2 * ROUNDOFF["bf16"]


def test_weight_decay_on_an_unused_parameter_at_uneven_n(faulted):
    """zeroexp's ZeRO-1 keeps every parameter in a flat buffer: one forward never uses gets a zero gradient and AdamW
    decays it, by design (the equivalence excuses it); the replay names it, with the design's reason."""
    eq = faulted(None, "strategy=zero1", "world_size=3", "model=custom", "model._target_=corpus.unused_branch",
                 "model.input_shape=[8]", TRACE)
    d = eq["divergence"]
    assert eq["check"] == "PASS" and [t["tensor"] for t in eq["not_compared"]] == [PREFIX + "unused.weight"]
    assert (d["tensor"], d["kind"], d["cause"]) == ("unused.weight", "param", "decay_without_gradient"), d
    assert d["by_design"]
    # AdamW's decay alone moves it (its moments stay 0): max|w0| * (1 - (1 - lr * wd)^(step + 1)) at the step reported
    cfg = compose_config(["model=custom", "model._target_=corpus.unused_branch", "model.input_shape=[8]"])
    import lightning.pytorch as pl

    pl.seed_everything(int(cfg.seed), workers=False, verbose=False)
    w0 = float(build_model(cfg.model).unused.weight.abs().max())
    decay = 1 - cfg.optimizer.lr * cfg.optimizer.weight_decay
    assert d["size"] == pytest.approx(w0 * (1 - decay ** (d["step"] + 1)), rel=1e-3)
    assert d["size"] > d["bound"]


def test_clipping_norm_over_the_whole_hybrid_mesh(faulted):
    """HSDP 2 x 2: at step 1 every rank clips by a norm whose squares were all-reduced over the world, each counted
    once per replica: every gradient is the reference's times 1/sqrt(2), named with the norm that did it."""
    eq = faulted("0:1:clip_world", "strategy=fsdp2_hybrid", "strategy.shard_size=2", "world_size=4",
                 "strategy.clip_grad_norm=1e-4", TRACE)
    d = eq["divergence"]
    assert (d["step"], d["kind"], d["cause"]) == (1, "grad", "clip_scale"), d
    assert d["evidence"]["squares_counted"] == pytest.approx(2, rel=1e-3)
    assert d["evidence"]["factor"] == pytest.approx(2 ** -0.5, rel=1e-3)
    g = faulted.summaries[-1]["grad_norm"]  # the gradient-norm check names it too: rank 0, step 1, each square twice
    assert (g["check"], g["reason_codes"], g["first_failed"]["step"]) == ("FAIL", ["grad_norm.differs"], 1), g
    assert g["squares_counted"] == pytest.approx(2, rel=1e-3)


@pytest.mark.parametrize("overrides", [("strategy=fsdp2_full", "world_size=3", *HF_LLAMA),
                                       ("strategy=ddp", "world_size=2", "grad_accum=2")],
                         ids=["llama-fsdp2-n3", "mlp-ddp-n2-ga2"])
def test_a_correct_cell_replayed_locates_nothing(faulted, overrides):
    """A Hugging Face Llama under FSDP2 at N=3 (uneven shards); DDP accumulating two micro-batches a step (the tracer
    sees optimizer steps, the reference each rank's loss as the mean of its micro-batches'): every step within its
    bounds."""
    eq = faulted(None, *overrides, TRACE)
    assert eq["check"] == "PASS"
    assert eq["divergence"] == {"found": False, "steps_compared": STEPS, "why": eq["divergence"]["why"]}


def test_replay_wanted():
    fail = {"check": "FAIL", "reason_codes": ["equivalence.above_bound"]}
    assert replay_wanted(None, fail) and not replay_wanted(False, fail)
    assert not replay_wanted(None, {"check": "PASS"}) and replay_wanted(True, {"check": "PASS"})
    assert not replay_wanted(None, {"check": "FAIL", "reason_codes": ["equivalence.names_differ"]})
    assert not replay_wanted(True, {})  # no equivalence section (not rank 0): nothing to replay against


def test_uniform_scale_and_rounding_patterns():
    g = torch.Generator().manual_seed(0)
    ref = {"a": torch.randn(64, generator=g), "b": torch.randn(8, 8, generator=g)}
    assert uniform_scale({n: 0.5 * t for n, t in ref.items()}, ref, 1e-6) == pytest.approx(0.5)
    assert uniform_scale(ref, ref, 1e-6) is None  # the factor is 1
    assert uniform_scale({"a": 0.5 * ref["a"], "b": 2 * ref["b"]}, ref, 1e-6) is None  # two factors
    rounded = {n: t.to(torch.bfloat16).to(torch.float32) for n, t in ref.items()}
    assert rounding_format(rounded, ref)[0] == "bf16"
    assert rounding_format({n: t.to(torch.float16).float() for n, t in ref.items()}, ref)[0] == "fp16"
    assert rounding_format({n: t + 1 for n, t in ref.items()}, ref)[0] is None


def _states(run: Reference) -> tuple[dict, dict]:
    """``run``'s state as an adapter's ``full_state_dicts`` gives it: by CellModule's names."""
    model = {PREFIX + n: t for n, t in run.parameters().items()}
    optim = {"state": {PREFIX + n: {"exp_avg": m[0], "exp_avg_sq": m[1]} for n, m in run.moments().items()}}
    return model, optim


@pytest.mark.parametrize("at", [None, 1])
def test_watch_locates_an_update_beside_the_reference(at):
    """In one process, a second reference as the strategy: identical, nothing parts; its parameter moved after step
    ``at``, the update parts there, at that tensor."""
    cfg = compose_config(["model=mlp", "model.width=16", "world_size=2", "steps=3"])
    watch, run = Watch(cfg, clip=None, threshold=1e-5), Reference(cfg)
    name = next(iter(run.parameters()))
    for step in range(3):
        run.take_step()
        if step == at:
            with torch.no_grad():
                dict(run.net.named_parameters())[name].add_(1e-3)
        if watch.observe(step, run.rank_losses, *_states(run)):
            break
    d = watch.result()
    if at is None:
        assert d["found"] is False and d["steps_compared"] == 3
    else:
        assert (d["step"], d["tensor"], d["kind"], d["cause"]) == (at, name, "param", "update"), d


def test_references_started_from_one_checkpoint_state_leave_it_as_it_was():
    """The equivalence trains two references from the same state read whole (its floor is their distance): AdamW's
    load keeps a moment or step tensor that needs no cast as it is and steps it in place, so the second had started
    where the first ended (a load_from cell's floor was 2.4e-3 where it is 0: a bound 2,400 times too loose)."""
    from types import SimpleNamespace

    cfg = compose_config(["model=mlp", "model.width=16", "world_size=2", "steps=3"])
    trained = Reference(cfg)
    for _ in range(2):
        trained.take_step()
    model = {PREFIX + n: t.clone() for n, t in trained.parameters().items()}
    state = {PREFIX + n: {k: v.clone() for k, v in trained.opt.state[p].items()}
             for n, p in trained.net.named_parameters()}
    whole = {"model": model, "optim": {"state": state}}
    start = (SimpleNamespace(step=2), whole)
    a, b = Reference(cfg, start=start), Reference(cfg, start=start)
    a.take_step()
    b.take_step()
    assert all(torch.equal(a.parameters()[n], b.parameters()[n]) for n in a.parameters())
    assert all(float(s["step"]) == 2 for s in state.values())  # the state read whole is as it was
    assert all(torch.equal(s["exp_avg"], trained.opt.state[p]["exp_avg"])
               for s, p in zip(state.values(), trained.net.parameters()))
