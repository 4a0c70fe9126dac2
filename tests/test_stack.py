"""A stack of identical blocks traced at two, three and four blocks (``zeroexp.plan.stack``): the derived trace
equals the trace of the whole model, field by field and in the order of its units, on zeroexp's GPT (every wrap,
autocast and the module cast), its LoRA fine-tune, the Linear stack, and stacks of foreign blocks (PyTorch's own
TransformerEncoderLayer and test Transformer's block, the corpus's shared, unused and frozen layers); a declared stack
whose blocks differ is traced whole."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from zeroexp.models import import_class
from zeroexp.models.gpt import Block
from zeroexp.plan import row_peak
from zeroexp.plan.activations import trace_activations
import zeroexp.plan.forked as forked
import zeroexp.plan.stack as stack
from zeroexp.plan.stack import DERIVED_ABOVE, at_depth, deepen, derived_trace, stack_of

#: The derivation's threshold in this module's tests: the rule is the same at any depth above the shallow steps'
#: (STEP_DEPTHS, then two blocks more), and a whole trace of 9 blocks costs less than one of DERIVED_ABOVE + 1.
TESTED_ABOVE = 8
DEEP = TESTED_ABOVE + 1  # the shallowest stack derived here


@pytest.fixture(autouse=True)
def _derive_above_eight(monkeypatch):
    """Stacks deeper than TESTED_ABOVE derived (the product's threshold, DERIVED_ABOVE, only saves time)."""
    monkeypatch.setattr(stack, "DERIVED_ABOVE", TESTED_ABOVE)

GPT = {"_target_": "zeroexp.models.gpt.GPT", "vocab_size": 64, "seq_len": 16, "n_layer": DEEP, "n_head": 2,
       "n_embd": 32, "bias": True, "tie_weights": True, "input_shape": [16], "dtype": "long", "low": 0, "high": 64,
       "loss": "next_token"}
LORA = {**GPT, "_target_": "zeroexp.models.lora.lora_gpt", "n_layer": DEEP, "lora_rank": 2, "lora_alpha": 4.0}
MLP = {"_target_": "zeroexp.models.LinearStack", "width": 16, "depth": DEEP, "input_shape": [16], "dtype": "float32",
       "loss": "mean_square"}
DTENSOR = "torch.testing._internal.distributed._tensor.common_dtensor"
TT = importlib.util.find_spec("expecttest") is not None


class Stacked(nn.Sequential):
    """``depth`` blocks of ``block`` (an import path), each built alike from ``kwargs``: a declared stack of
    modules nobody here wrote."""

    repeated_blocks = ("depth", "")

    def __init__(self, block: str, depth: int, **kwargs: object) -> None:
        factory = import_class(block, base=None)
        super().__init__(*(factory(**kwargs) for _ in range(depth)))


class FrozenThird(nn.Sequential):
    """Declared a stack, but its third Linear is frozen: what that block saves differs from the second's."""

    repeated_blocks = ("depth", "")

    def __init__(self, width: int, depth: int) -> None:
        super().__init__(*(nn.Linear(width, width) for _ in range(depth)))
        if depth > 2:
            self[2].requires_grad_(False)


def _stacked(block: str, shape: list[int], **kwargs: object) -> dict:
    return {"_target_": f"{__name__}.Stacked", "block": block, "depth": DEEP, "input_shape": shape, "dtype": "float32",
            "loss": "mean_square", **kwargs}


ENCODER = _stacked("torch.nn.TransformerEncoderLayer", [6, 16], d_model=16, nhead=2, dim_feedforward=32, dropout=0.0,
                   batch_first=True)
CASES = {
    "gpt": (GPT, [Block]),
    "gpt_linear_units": (GPT, [nn.Linear]),
    "lora_gpt": (LORA, [Block]),
    "lora_gpt_lora_units": (LORA, ["zeroexp.models.lora.LoRALinear"]),
    "linear_stack": (MLP, [nn.Linear]),
    "encoder_layers": (ENCODER, [nn.TransformerEncoderLayer]),
    "encoder_linear_units": (ENCODER, [nn.Linear]),
    "applied_twice": (_stacked("corpus.applied_twice", [8], width=8), [nn.Linear]),
    "unused_branch": (_stacked("corpus.unused_branch", [8], width=8), ["corpus.UnusedBranch"]),
    "frozen_first": (_stacked("corpus.frozen_mlp", [8], width=8), [nn.Linear]),
    "frozen_first_blocks": (_stacked("corpus.frozen_mlp", [8], width=8), [nn.Sequential]),
}
if TT:
    CASES["test_transformer_block"] = (
        _stacked(f"{DTENSOR}.TransformerBlock", [8, 16], args={"_target_": f"{DTENSOR}.ModelArgs", "dim": 16,
                                                                "n_heads": 2, "dropout_p": 0.0, "max_seq_len": 8}),
        [f"{DTENSOR}.TransformerBlock"])
if importlib.util.find_spec("transformers") is not None:  # model=hf: its decoder layers declared a stack
    for arch in ("llama",):
        CASES[f"hf_{arch}"] = (
            {"_target_": "zeroexp.models.hf.causal_lm", "arch": arch, "num_hidden_layers": DEEP, "hidden_size": 16,
             "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32,
             "num_local_experts": 2 if arch == "mixtral" else None, "input_shape": [8], "dtype": "long",
             "high": 32, "loss": "next_token"},
            [f"transformers.models.{arch}.modeling_{arch}.{arch.capitalize()}DecoderLayer"])
WAYS = {"fp32": {}, "autocast": {"dtype": torch.bfloat16}, "cast": {"module_dtype": torch.bfloat16}}


def _same(a, b) -> bool:
    return (a == b and list(a.unit_bytes.items()) == list(b.unit_bytes.items())
            and list(a.unit_input_bytes.items()) == list(b.unit_input_bytes.items()))


@pytest.mark.parametrize("k, name", list(enumerate(CASES)))
def test_a_derived_trace_is_the_whole_models_trace(k, name):
    """The forward's trace derived from two, three and four blocks equals the whole model's, in one of the three ways
    a strategy computes per case in turn (every way meets four models or more), and one deeper in fp32."""
    cfg, wrap = CASES[name]
    wrap = [import_class(w) if isinstance(w, str) else w for w in wrap]
    argument, container, depth = stack_of(cfg)
    for way, batch in ((("fp32", 3), ("autocast", 1), ("cast", 2))[k % len(WAYS)],):
        derived = row_peak.forward_trace(cfg, batch, wrap, **WAYS[way])
        whole = trace_activations(cfg, batch, wrap, **WAYS[way])
        assert _same(derived, whole), (name, way)
        # derived, not traced: the shallow traces are remembered, and they check
        shallow = [row_peak.forward_trace(at_depth(cfg, argument, d), batch, wrap, **WAYS[way]) for d in (2, 3, 4)]
        assert derived_trace(*shallow, depth, container) is not None
    deeper = {**cfg, argument: depth + 3}
    assert _same(row_peak.forward_trace(deeper, 2, wrap), trace_activations(deeper, 2, wrap)), name


def test_the_grown_records_are_the_second_blocks_renamed():
    two, three, four = (trace_activations(at_depth(GPT, "n_layer", d), 2, [nn.Linear]) for d in (2, 3, 4))
    grown = derived_trace(two, three, four, 6, "h")
    assert [u for u in grown.unit_bytes if u.startswith("h.5.")] == [u.replace("h.1.", "h.5.", 1)
                                                                      for u in two.unit_bytes if u.startswith("h.1.")]
    assert list(grown.unit_bytes)[-2:] == ["lm_head", "root"]  # what follows the stack stays after it
    # each further block: its Linear units' records, and what it saves outside them (norms, attention) in the root
    per_block = sum(v for u, v in two.unit_bytes.items() if u.startswith("h.1."))
    assert three.unit_bytes["root"] > two.unit_bytes["root"]
    assert grown.total_bytes - two.total_bytes == 4 * (per_block + three.unit_bytes["root"] - two.unit_bytes["root"])


def test_a_declared_stack_whose_blocks_differ_is_traced_whole():
    cfg = {"_target_": f"{__name__}.FrozenThird", "width": 8, "depth": DEEP, "input_shape": [8], "dtype": "float32",
           "loss": "mean_square"}
    two, three, four, whole = (trace_activations({**cfg, "depth": d}, 2, [nn.Linear]) for d in (2, 3, 4, DEEP))
    assert derived_trace(two, three, four, DEEP, "") is None
    assert not _same(deepen(two, three, DEEP, ""), whole)  # repeating the second block would have been wrong
    assert _same(row_peak.forward_trace(cfg, 2, [nn.Linear]), whole)


def test_only_a_declared_stack_given_its_depth_is_derived(monkeypatch):
    assert max(stack.STEP_DEPTHS) < TESTED_ABOVE < DERIVED_ABOVE
    with monkeypatch.context() as product:
        product.setattr(stack, "DERIVED_ABOVE", DERIVED_ABOVE)  # the product's threshold
        assert stack_of({**GPT, "n_layer": DERIVED_ABOVE}) is None
        assert stack_of({**GPT, "n_layer": DERIVED_ABOVE + 1}) == ("n_layer", "h", DERIVED_ABOVE + 1)
    assert stack_of(GPT) == ("n_layer", "h", DEEP) and stack_of(LORA) == ("n_layer", "h", DEEP)
    assert stack_of(MLP) == ("depth", "", DEEP)
    assert stack_of({**GPT, "n_layer": TESTED_ABOVE}) is None  # shallow enough: traced whole, cheaper
    assert stack_of({**GPT, "n_layer": str(DEEP)}) is None
    assert stack_of({k: v for k, v in GPT.items() if k != "n_layer"}) is None
    assert stack_of({"_target_": "corpus.frozen_mlp", "depth": DEEP}) is None  # no declaration: traced whole
    assert stack_of({"_target_": "torch.nn.TransformerEncoderLayer", "d_model": 8}) is None
    # no unit under the stack: nothing to repeat, traced whole
    two, three, four = (trace_activations(at_depth(GPT, "n_layer", d), 1, []) for d in (2, 3, 4))
    assert derived_trace(two, three, four, 5, "h") is None


def _meta(cfg: dict) -> nn.Module:
    from zeroexp.models import build_model

    with torch.device("meta"):
        return build_model(cfg)


@pytest.mark.parametrize("name", list(CASES))
def test_a_derived_shape_is_the_whole_models_shape(name):
    """The planner's shape (``zeroexp.plan.shape.shape_of``): the gradient-ready order, each unit's forward calls,
    backward reach and next unit's reach derived from the steps at three and four blocks equal the whole step's."""
    from zeroexp.plan.shape import _units, derived_units, shape_of

    cfg, wrap = CASES[name]
    wrap = tuple(import_class(w) if isinstance(w, str) else w for w in wrap)
    argument = stack_of(cfg)[0]
    deep = {**cfg, argument: DEEP + 2}
    net = _meta(deep)
    assert derived_units(net, deep, wrap, _units(net, wrap)[2]) is not None, name  # derived, not traced
    derived, whole = shape_of(net, wrap, model_cfg=deep), shape_of(net, wrap, model_cfg=deep, derive=False)
    assert derived == whole and whole.ready, name


def test_a_declared_stack_whose_steps_differ_is_traced_whole():
    from zeroexp.plan.shape import _units, derived_units, shape_of

    cfg = {"_target_": f"{__name__}.FrozenThird", "width": 8, "depth": DEEP, "input_shape": [8], "dtype": "float32",
           "loss": "mean_square"}
    net = _meta(cfg)
    assert derived_units(net, cfg, (nn.Linear,), _units(net, (nn.Linear,))[2]) is None
    assert shape_of(net, [nn.Linear], model_cfg=cfg) == shape_of(net, [nn.Linear], model_cfg=cfg, derive=False)


@pytest.mark.parametrize("name", list(CASES))
def test_derived_flops_are_the_whole_steps(name):
    """A step's counted FLOPs (``zeroexp.plan.flops.step_flops``), with and without checkpointing: F(2) + (L - 2) x
    (F(3) - F(2)) from the shallow steps equals the whole step's count."""
    from zeroexp.plan.flops import step_flops

    cfg, wrap = CASES[name]
    wrap = tuple(import_class(w) if isinstance(w, str) else w for w in wrap)
    argument = stack_of(cfg)[0]
    deep = {**cfg, argument: DEEP + 2}
    for checkpointing, batch in ((False, 1), (True, 3)):
        two, three = (step_flops(at_depth(cfg, argument, d), batch, wrap, checkpointing) for d in (2, 3))
        derived = step_flops(deep, batch, wrap, checkpointing)
        assert derived == two + DEEP * (three - two) > 0  # affine in the depth
        assert derived == step_flops(deep, batch, wrap, checkpointing, derive=False), (name, checkpointing)


#: The step's variants (``zeroexp.plan.steptrace.trace_step``'s keywords), one per case in turn: every strategy row's
#: way of tracing meets several models.
STEPS = [{"root_unit": True, "checkpointing": True}, {"own_params_units": True, "grads_in_place": True},
         {"dtype": torch.bfloat16, "root_unit": True}, {"module_dtype": torch.bfloat16, "own_params_units": True},
         {"grads_in_place": True}, {}]


@pytest.mark.parametrize("k, name", list(enumerate(CASES)))
def test_a_derived_step_is_the_whole_models_step(k, name, monkeypatch):
    """The planner's traced step (``zeroexp.plan.steptrace.trace_step_of``): derived from the steps at five, six and
    seven blocks, every segment (its peak and end bytes by category) and unit (its parameters' indices) equals the
    whole step's, at the shallowest depth derived."""
    import zeroexp.plan.steptrace as steptrace
    from zeroexp.plan.stack import STEP_DEPTHS, derived_step
    from zeroexp.plan.steptrace import trace_step, trace_step_of

    cfg, wrap = CASES[name]
    wrap = [import_class(w) if isinstance(w, str) else w for w in wrap]
    argument, container, depth = stack_of(cfg)
    kwargs = STEPS[k % len(STEPS)]
    shallow = {d: trace_step(at_depth(cfg, argument, d), 2, wrap, **kwargs) for d in STEP_DEPTHS}
    assert derived_step(*shallow.values(), depth, container) is not None, (name, kwargs)  # derived, not traced whole
    whole = trace_step(cfg, 2, wrap, **kwargs)
    # trace_step_of traces the same three shallow steps again (a trace is a function of its arguments): it is handed
    # the ones above instead of tracing them twice (a third of this test's time), and it asks for no other
    asked = []
    units = ((kwargs.get("own_params_units", False), kwargs.get("root_unit", False)),)
    rest = {k: v for k, v in kwargs.items() if k not in ("own_params_units", "root_unit")}

    def traced_above(model_cfg, batch_size, wrap_=(), **kw):
        asked.append(model_cfg[argument])
        assert (model_cfg, batch_size, list(wrap_), kw) == (at_depth(cfg, argument, asked[-1]), 2, wrap,
                                                            {**rest, "units": units})
        return (shallow[asked[-1]],)

    monkeypatch.setattr(steptrace, "trace_steps", traced_above)
    monkeypatch.setattr(forked, "usable_cores", lambda: 1)  # the spy counts calls here (tests/test_forked.py: forks)
    derived = trace_step_of(cfg, 2, wrap, **kwargs)
    assert asked == list(STEP_DEPTHS), (name, kwargs)  # derived from the shallow steps, the whole step never traced
    assert derived == whole, (name, kwargs)


class Pair(nn.Module):
    """A unit called with two inputs that require grad: its backward end holds the first one's gradient."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) * y


class PairStack(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp, self.pair = nn.Linear(width, width), Pair(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.pair(h, h.relu())


@pytest.mark.parametrize("name, kwargs", [("gpt", {"module_dtype": torch.bfloat16, "checkpointing": True}),
                                          ("gpt_linear_units", {"grads_in_place": True}),
                                          ("hf_llama", {"dtype": torch.bfloat16, "block": 512}),
                                          ("pair", {}), ("pair", {"grads_in_place": True})])
def test_segmentations_traced_in_one_run_are_each_traced_alone(name, kwargs):
    """``trace_steps``: the steps of several segmentations from one run equal each one traced in a run of its own,
    every segment, category and unit, each counted in its own block size (one tracker per size around the run); a
    unit of two inputs that require grad (whose hook holds a gradient) gets each its own run."""
    from zeroexp.plan.steptrace import trace_step, trace_steps

    if name == "pair":
        cfg, wrap = {"_target_": f"{__name__}.PairStack", "width": 8, "input_shape": [8], "dtype": "float32",
                     "loss": "mean_square"}, [Pair]
    elif name in CASES:
        cfg, wrap = CASES[name]
        cfg = at_depth(cfg, stack_of(cfg)[0], 3)
    else:
        pytest.skip(f"{name}: not installed")
    wrap = [import_class(w) if isinstance(w, str) else w for w in wrap]
    units = ((False, False), (True, False, 1), (False, True, 512))
    alone = tuple(trace_step(cfg, 2, wrap, own_params_units=u[0], root_unit=u[1],
                             **{**kwargs, **({"block": u[2]} if len(u) > 2 else {})}) for u in units)
    assert trace_steps(cfg, 2, wrap, units=units, **kwargs) == alone


def test_a_declared_stack_whose_steps_differ_is_stepped_whole():
    from zeroexp.plan.stack import STEP_DEPTHS, deepen_step, derived_step
    from zeroexp.plan.steptrace import trace_step, trace_step_of

    cfg = {"_target_": f"{__name__}.FrozenThird", "width": 8, "depth": DEEP, "input_shape": [8], "dtype": "float32",
           "loss": "mean_square"}
    shallow, deeper, check, whole = (trace_step({**cfg, "depth": d}, 2, [nn.Linear]) for d in (*STEP_DEPTHS, DEEP))
    assert derived_step(shallow, deeper, check, DEEP, "") is None
    assert deepen_step(shallow, deeper, DEEP, "") != whole  # growing the blocks between the edges would be wrong
    assert trace_step_of(cfg, 2, [nn.Linear]) == whole
