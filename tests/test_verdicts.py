"""A check's typed result (zeroexp.results.verdict): the verdicts keep summary.json's strings, a Check writes its
section's fields with a code beside each sentence and reads them back, a verdict other than PASS never comes without a
reason, and every code is declared once."""

from __future__ import annotations

import json

import pytest

from zeroexp.results.verdict import FAILED, Check, Code, Reason, Verdict, worst


def test_verdicts_are_the_strings_summary_json_holds():
    assert [v.value for v in Verdict] == ["PASS", "FAIL", "ERROR", "n/a", "SKIP"]
    for v in Verdict:
        assert json.dumps({"check": v}) == json.dumps({"check": v.value})  # the file's bytes are the literal's
        assert json.loads(json.dumps(v)) == v and Verdict(json.loads(json.dumps(v))) is v
        assert v == v.value and str(v) == f"{v}" == v.value and {v.value: 1}[v] == 1
    assert Verdict.of("unstable") is Verdict.NA and Verdict.of(None) is Verdict.NA
    assert Verdict.passed_if(True) is Verdict.PASS and Verdict.passed_if(False) is Verdict.FAIL
    assert FAILED == (Verdict.ERROR, Verdict.FAIL)
    assert worst(["n/a", Verdict.PASS, "FAIL"]) is Verdict.FAIL and worst([]) is Verdict.NA
    assert worst(["SKIP", "n/a"]) is Verdict.SKIP  # below PASS: the first found


def test_codes_are_unique_and_dotted():
    values = [c.value for c in Code]
    assert len(values) == len(set(values))
    assert all(v == v.lower() and " " not in v for v in values)
    assert json.dumps(Code.TOO_FEW_STEPS) == '"schedule.too_few_steps"'


def test_a_verdict_never_hides():
    """FAIL, ERROR, n/a and SKIP without a reason are refused; PASS may note reasons; a reason's code is a Code."""
    for v in (Verdict.FAIL, Verdict.ERROR, Verdict.NA, Verdict.SKIP):
        with pytest.raises(ValueError, match="needs a reason"):
            Check(v)
    assert Check(Verdict.PASS).reasons == ()
    with pytest.raises(TypeError):
        Reason("state.factor_differs", "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Check(Verdict.FAIL, ("a sentence",))  # type: ignore[arg-type]


def test_fields_write_each_sections_own_key_and_codes_beside():
    why = Reason(Code.STATE_FACTOR_DIFFERS, "optim: measured factor 4, expected 2")
    check = Check.failed_if([why])
    assert check.fields() == {"check": "FAIL", "reasons": [why.text], "reason_codes": ["state.factor_differs"]}
    assert list(check.fields()) == ["check", "reasons", "reason_codes"]
    assert Check.failed_if([]).fields() == {"check": "PASS", "reasons": [], "reason_codes": []}
    with pytest.raises(ValueError):
        Check.failed_if([], Verdict.NA)  # nothing failed, nothing said: no n/a without its reason
    assert check.fields("why") == {"check": "FAIL", "why": why.text, "reason_codes": ["state.factor_differs"]}
    numbers = Check(Verdict.FAIL, (Reason(Code.EQUIVALENCE_ABOVE_BOUND, ""),))  # the section's numbers say it
    assert numbers.fields("why") == {"check": "FAIL", "reason_codes": ["equivalence.above_bound"]}
    raised = Check.raised(KeyError("backward"))
    assert raised.fields() == {"check": "ERROR", "reasons": ["KeyError: 'backward'"], "reason_codes": ["probe.raised"]}
    text = json.dumps(check.fields())
    assert Check.read(json.loads(text)) == check  # round trip: the same verdict, codes and sentences


def test_read_back_older_files_and_bare_verdicts():
    """A section written before reason codes reads each reason as reason.uncoded; a verdict other than PASS with no
    reason as reason.unrecorded; a text key beside codes."""
    old = Check.read({"check": "FAIL", "reasons": ["a", "b"]})
    assert old.verdict is Verdict.FAIL and old.codes == [Code.UNCODED, Code.UNCODED] and old.texts == ["a", "b"]
    assert Check.read({"check": "n/a", "reasons": []}).codes == [Code.UNRECORDED]
    assert Check.read({"check": "PASS"}).reasons == ()
    skipped = Check.read({"check": "n/a", "reason": "too few steps: 2", "reasons": ["too few steps: 2"],
                          "reason_codes": ["schedule.too_few_steps"]})
    assert skipped.codes == [Code.TOO_FEW_STEPS]
    assert Check.read({"check": "FAIL", "why": "x", "reason_codes": ["no.such_code"]}).codes == [Code.UNCODED]
    assert Reason(Code.PLAN_STATE_DIFFERS, "param").prefixed("rank 1 ") == Reason(Code.PLAN_STATE_DIFFERS,
                                                                                  "rank 1 param")
