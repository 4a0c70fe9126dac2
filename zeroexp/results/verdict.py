"""A check's typed result: its :class:`Verdict`, and each reason as a stable :class:`Code` beside the sentence a user
reads (:class:`Reason`), together a :class:`Check` that writes its own fields of a ``summary.json`` section.

The verdicts are the strings ``summary.json`` has always held (``Verdict`` is a ``str``: ``json.dumps`` writes
``"n/a"``, and ``Verdict.PASS == "PASS"``). A section keeps its own key for the sentences (``reasons``, a list; the
equivalence probe's ``why``, one string); :meth:`Check.fields` writes that key and ``reason_codes`` beside it, one code
per sentence. Control flow reads codes, never sentences (docs/results.md, "Reason codes").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable, Mapping

__all__ = ["Verdict", "Code", "Reason", "Check", "FAILED", "worst"]


class Verdict(str, Enum):
    """What a check found. ``str()`` and f-strings give the value, as the string literals did."""

    PASS = "PASS"  # measured equals the prediction, within the check's rule
    FAIL = "FAIL"  # measured differs from the prediction
    ERROR = "ERROR"  # the check itself raised: nothing was checked
    NA = "n/a"  # not checked here (nothing to hold it to, or not measured): a reason says why
    SKIP = "SKIP"  # measured, but no bound to judge it by (an equivalence without a threshold)

    __str__ = str.__str__
    __hash__ = str.__hash__
    __format__ = str.__format__

    @classmethod
    def of(cls, value: Any) -> Verdict:
        """``value`` read back from ``summary.json``; ``n/a`` for anything that is no verdict."""
        try:
            return cls(value)
        except ValueError:
            return cls.NA

    @classmethod
    def passed_if(cls, ok: bool) -> Verdict:
        """PASS when ``ok``, else FAIL."""
        return cls.PASS if ok else cls.FAIL


#: The verdicts that fail a check.
FAILED = (Verdict.ERROR, Verdict.FAIL)
#: Worst first; any other verdict (``n/a``, ``SKIP``) ranks below ``PASS``.
_ORDER = (Verdict.ERROR, Verdict.FAIL, Verdict.PASS)


def worst(verdicts: Iterable[Verdict | str]) -> Verdict:
    """The worst of ``verdicts``: ERROR, then FAIL, then PASS, then any other (``n/a`` when there is none)."""
    found = [Verdict.of(v) for v in verdicts]
    return next((v for v in _ORDER if v in found), found[0] if found else Verdict.NA)


class Code(str, Enum):
    """Why a check is not PASS (or what a PASS notes): a short dotted name, stable across wordings."""

    # any check
    PROBE_RAISED = "probe.raised"  # the check raised; the text is the exception
    NOT_CHECKED = "not_checked"  # the "measurement" is the planner's own model (a derived dry run): cannot fail
    TOO_FEW_STEPS = "schedule.too_few_steps"  # the probe's window did not fit in `steps`: not measured
    DERIVED = "dry_run.derived"  # a derived dry run's section: built from the groups, nothing measured
    UNRECORDED = "reason.unrecorded"  # read back: a verdict other than PASS with no reason in the file
    UNCODED = "reason.uncoded"  # read back: a reason written before reason codes
    # the state probe
    STATE_FACTOR_DIFFERS = "state.factor_differs"  # a kind's bytes / P differ from the strategy's expected factor
    STATE_PHYSICAL_BELOW_LOGICAL = "state.physical_below_logical"  # storage smaller than the tensors it holds
    # the collectives probe
    COLLECTIVES_UNSTEADY = "collectives.unsteady"  # a rank's profiled steps issued different collectives
    COLLECTIVES_RANKS_DISAGREE = "collectives.ranks_disagree"  # ranks issued different calls or payloads
    COLLECTIVES_GROUPS_DIFFER = "collectives.groups_differ"  # calls per process group differ from the model's
    COLLECTIVES_COUNT_DIFFERS = "collectives.count_differs"  # an op's calls per step differ from the expected
    COLLECTIVES_PAYLOAD_DIFFERS = "collectives.payload_differs"  # an op's payload per step differs from the expected
    COLLECTIVES_NOT_MODELLED = "collectives.not_modelled"  # no expectation for this cell: measured, not checked
    # the equivalence probe
    EQUIVALENCE_NAMES_DIFFER = "equivalence.names_differ"  # trained and reference parameter names differ
    EQUIVALENCE_SHAPE_DIFFERS = "equivalence.shape_differs"  # a parameter's shape differs from the reference's
    EQUIVALENCE_ABOVE_BOUND = "equivalence.above_bound"  # max abs err above the bound (the section's numbers)
    EQUIVALENCE_NO_THRESHOLD = "equivalence.no_threshold"  # no threshold for this precision: SKIP
    EQUIVALENCE_BUFFERS_DIFFER = "equivalence.buffers_differ"  # buffers the reference keeps unchanged differ
    GRAD_NORM_NOT_TAKEN = "grad_norm.not_taken"  # no gradient norm the strategy computed or the probe could take
    GRAD_NORM_DIFFERS = "grad_norm.differs"  # a rank's total gradient norm of a step beyond its bound
    GRAD_NORM_MISSING = "grad_norm.missing"  # a rank has no norm at a step another rank has
    # the checkpoint probe
    CHECKPOINT_RESTORE_DIFFERS = "checkpoint.restore_differs"  # restored parameters differ from the saved
    CHECKPOINT_CONTINUATION_DIFFERS = "checkpoint.continuation_differs"  # the step after a restore differs
    CHECKPOINT_MOVE_DIFFERS = "checkpoint.move_differs"  # a moved tensor differs from the checkpoint's, same dtype
    CHECKPOINT_MOVE_NAMES_DIFFER = "checkpoint.move_names_differ"  # the moved state lost or gained a tensor
    # summary.json["plan"]: state, calls, groups
    PLAN_NO_BYTE_MODEL = "plan.no_byte_model"  # the formulas have no byte model for the row, precision, offload
    PLAN_NO_STATE_MEASURED = "plan.no_state_measured"  # no rank_state.csv: the state probe did not run
    PLAN_STATE_DIFFERS = "plan.state_differs"  # a rank's bytes of a kind differ from the plan
    PLAN_STATE_UNPLANNED = "plan.state_unplanned"  # a measured kind the plan leaves out, not an explained residual
    PLAN_CALLS_DIFFER = "plan.calls_differ"  # an op's measured calls or payload per step differ from the plan
    PLAN_PAYLOAD_NOT_MODELLED = "plan.payload_not_modelled"  # the payload model does not cover the cell
    PLAN_NO_COLLECTIVES_MEASURED = "plan.no_collectives_measured"  # the collectives probe did not run
    PLAN_GROUPS_DIFFER = "plan.groups_differ"  # a planned group element differs from the live one
    PLAN_NO_LIVE_GROUPS = "plan.no_live_groups"  # the adapter reported no live groups
    # summary.json["plan"]["checkpoint"]
    PLAN_CHECKPOINT_DIFFERS = "plan.checkpoint_differs"  # the tensors' bytes a rank wrote differ from the plan
    PLAN_CHECKPOINT_PEAK_DIFFERS = "plan.checkpoint_peak_differs"  # a save or load held other bytes than planned
    PLAN_CHECKPOINT_PEAK_NOT_MODELLED = "plan.checkpoint_peak_not_modelled"  # no save/load peak model for the family
    PLAN_CHECKPOINT_NOT_MODELLED = "plan.checkpoint_not_modelled"  # a checkpoint layout the planner does not model
    PLAN_CHECKPOINT_NOT_MEASURED = "plan.checkpoint_not_measured"  # no save measured: the checkpoint probe did not
    # summary.json["plan"]["memory"]
    MEMORY_NOT_MODELLED = "memory.not_modelled"  # the peak model does not cover the cell
    MEMORY_NO_MEASUREMENT = "memory.no_measurement"  # no per-phase measurement: predicted only
    MEMORY_PHASE_DIFFERS = "memory.phase_differs"  # a phase's bytes above steady outside the prediction's band
    MEMORY_RESERVED_BELOW_PREDICTION = "memory.reserved_below_prediction"  # reserved below the allocator model
    MEMORY_DEVICE_BELOW_PREDICTION = "memory.device_below_prediction"  # nvidia-smi's used below reserved + context
    MEMORY_SIMULATED = "memory.simulated"  # a dry run: the phases are simulated over fake storages, not measured
    # summary.json["plan"]["time"]
    TIME_NO_CALIBRATION = "time.no_calibration"  # no calibration of this machine, backend and world size
    TIME_NO_TIMED_STEPS = "time.no_timed_steps"  # the timing probe did not run
    TIME_MEDIAN_UNSTABLE = "time.median_unstable"  # the median's 95 % CI is wider than the limit: judged by the CI
    TIME_RATIO_OUT_OF_BOUND = "time.ratio_out_of_bound"  # predicted / measured median outside the bound
    TIME_PRECISION_NOT_MODELLED = "time.precision_not_modelled"  # precision or offload the calibration does not time
    TIME_CALIBRATION_CARRIED = "time.calibration_carried"  # calibrated at another backend or N: carried over
    TIME_CALIBRATION_LACKS_TERMS = "time.calibration_lacks_terms"  # an older calibration without framework terms
    TIME_CALIBRATION_BUSY = "time.calibration_busy"  # the calibration ran beside other work
    TIME_CELL_BUSY = "time.cell_busy"  # the cell's timed steps ran beside other work
    TIME_COMPUTE_CARRIED = "time.compute_carried"  # compute calibrated on another model or batch: carried over
    TIME_COMPUTE_BY_OPERATION = "time.compute_by_operation"  # compute costed op by op from the microbenchmarks

    __str__ = str.__str__
    __hash__ = str.__hash__
    __format__ = str.__format__


@dataclass(frozen=True)
class Reason:
    """One reason: its :class:`Code` and the sentence a user reads (``""``: the section's numbers say it, as an
    equivalence FAIL's ``max_abs_err`` and bound)."""

    code: Code
    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.code, Code):
            raise TypeError(f"a reason's code is a Code, not {self.code!r}")

    def prefixed(self, prefix: str) -> Reason:
        """The same reason, its text after ``prefix`` (``rank 1 ``, ``simulated ``)."""
        return Reason(self.code, prefix + self.text)


def reasons(code: Code, texts: Iterable[str]) -> list[Reason]:
    """One :class:`Reason` of ``code`` per text."""
    return [Reason(code, t) for t in texts]


@dataclass(frozen=True)
class Check:
    """A check's verdict and its reasons (why it is not PASS; a PASS may note some). A verdict other than PASS with no
    reason is refused: a verdict never hides."""

    verdict: Verdict
    reasons: tuple[Reason, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))
        object.__setattr__(self, "reasons", tuple(self.reasons))
        if self.verdict is not Verdict.PASS and not self.reasons:
            raise ValueError(f"a {self.verdict} check needs a reason")
        if not all(isinstance(r, Reason) for r in self.reasons):
            raise TypeError("a check's reasons are Reason values")

    @classmethod
    def failed_if(cls, reasons: Iterable[Reason], otherwise: Verdict = Verdict.PASS) -> Check:
        """FAIL with ``reasons`` when there are any, else ``otherwise`` (PASS)."""
        found = tuple(reasons)
        return cls(Verdict.FAIL if found else otherwise, found)

    @classmethod
    def worst_of(cls, parts: Iterable[Check]) -> Check:
        """A summary of ``parts``: their worst verdict (:func:`worst`) with the reasons of the parts that have it."""
        parts = list(parts)
        verdict = worst(c.verdict for c in parts)
        return cls(verdict, () if verdict is Verdict.PASS else
                   tuple(r for c in parts if c.verdict is verdict for r in c.reasons))

    @classmethod
    def raised(cls, e: BaseException) -> Check:
        """ERROR: the check raised ``e``."""
        return cls(Verdict.ERROR, (Reason(Code.PROBE_RAISED, f"{type(e).__name__}: {e}"),))

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.reasons]

    @property
    def codes(self) -> list[Code]:
        return [r.code for r in self.reasons]

    @property
    def failed(self) -> bool:
        return self.verdict in FAILED

    def fields(self, key: str = "reasons") -> dict[str, Any]:
        """The section's verdict fields: ``check``, the sentences under ``key`` (``reasons``: a list; ``why`` or
        ``reason``: the first, a string, written only where a reason has one) and ``reason_codes``."""
        out: dict[str, Any] = {"check": self.verdict}
        if key == "reasons":
            out[key] = self.texts
        elif self.reasons and self.reasons[0].text:
            out[key] = self.reasons[0].text
        out["reason_codes"] = [c.value for c in self.codes]
        return out

    @classmethod
    def read(cls, section: Mapping[str, Any]) -> Check:
        """A check written by :meth:`fields` read back from ``summary.json`` (one written before reason codes: each
        reason ``reason.uncoded``; a verdict other than PASS without a reason: ``reason.unrecorded``)."""
        verdict = Verdict.of(section.get("check"))
        texts: list[str] = []
        for key in ("reasons", "reason", "why"):
            value = section.get(key)
            if isinstance(value, (list, tuple)) and value:
                texts = [str(v) for v in value]
                break
            if isinstance(value, str) and value:
                texts = [value]
                break
        codes = [_code(c) for c in section.get("reason_codes") or ()]
        found = [Reason(codes[i] if i < len(codes) else Code.UNCODED, t) for i, t in enumerate(texts)]
        found += [Reason(c, "") for c in codes[len(texts):]]
        if verdict is not Verdict.PASS and not found:
            found = [Reason(Code.UNRECORDED, "no reason recorded")]
        return cls(verdict, tuple(found))


def _code(value: Any) -> Code:
    try:
        return Code(value)
    except ValueError:
        return Code.UNCODED
