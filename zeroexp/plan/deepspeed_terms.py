"""DeepSpeed's rows in the planner: the model-state peak term by term beside DeepSpeed's own estimator (the peak
model of DeepSpeed's rows is its family's: :mod:`zeroexp.formulas.families.deepspeed`)."""

from __future__ import annotations

from zeroexp.formulas import LAYOUTS, PlanKnobs, deepspeed_reduce_bucket_numel
from zeroexp.formulas.deepspeed import ipg_buffers
from zeroexp.formulas.peak.deepspeed_terms import (ESTIMATOR_TERMS, TERMS, ds_estimator_bytes, ds_estimator_name,
                                                   ds_term_peak, largest_layer_numel)
from zeroexp.formulas import ModelShape

__all__ = ["ds_stage", "ds_term_record", "ds_term_legend"]


def ds_stage(name: str) -> int | None:
    """The ZeRO stage of row ``name`` where the peak model covers it as DeepSpeed's (its family's flow and
    ``deepspeed_stage``); None otherwise."""
    row = LAYOUTS.get(name)
    return row.deepspeed_stage if row is not None and row.family.flow(row) is not None else None


def ds_term_record(name: str, shape: ModelShape, world_size: int, itemsize: int, offload: str, bucket_cap_bytes: int,
                   largest_layer: int | None, foreach: bool, fp16: bool = False,
                   knobs: PlanKnobs = PlanKnobs()) -> dict | None:
    """The planner's ``ds_peak`` of a DeepSpeed row (None for any other row; a note alone at stage 0, which has no
    term model, and with offload): the model-state peak term by term
    (:func:`zeroexp.formulas.peak.deepspeed_terms.ds_term_peak`, computed, a lower bound: activations and scalars left
    out) beside DeepSpeed's own estimator, which terms both count and which differ. ``largest_layer``: the largest
    module's own parameters (None: from the shape's modules where it has them, else unknown); ``fp16``: the precision
    is fp16 (its overflow check); ``knobs``: the row's settings (``overlap_comm``: the ipg bucket's buffers,
    :func:`zeroexp.formulas.deepspeed.ipg_buffers`)."""
    stage = ds_stage(name)
    if stage is None:
        return None
    if stage not in ESTIMATOR_TERMS:  # stage 0: its peak is the traced model's alone (zeroexp.formulas.peak.ds_stage0)
        return {"note": f"no term model yet for DeepSpeed stage {stage} (covered: stages 1-3)"}
    if offload != "none":
        return {"note": f"no term model yet for offload={offload} (covered: offload none)"}
    if largest_layer is None and shape.exact:
        largest_layer = largest_layer_numel(shape.numels, shape.modules)
    trained = shape.trainable().numel
    peak = ds_term_peak(stage, trained, world_size, itemsize, deepspeed_reduce_bucket_numel(bucket_cap_bytes),
                        largest_layer, foreach, frozen=shape.numel - trained, fp16=fp16,
                        ipg_buffers=ipg_buffers(stage, knobs))
    unknown = stage == 3 and largest_layer is None
    # the estimator assumes 2-byte parameters and gradients: compared in bf16 / fp16, with the largest layer at stage 3
    estimate = None if itemsize != 2 or unknown else ds_estimator_bytes(stage, shape.numel, world_size,
                                                                        largest_layer or 0)
    return {"moment": peak.moment, "phase": peak.phase, "bytes": peak.bytes, "terms": peak.terms,
            "moments": peak.moments,
            "largest_layer": largest_layer, "basis": "computed (zeroexp.formulas.peak.deepspeed_terms): a lower bound, "
            "activations and scalars left out" + ("; the largest layer unknown (largest_layer=): its terms left out"
                                                  if unknown else ""),
            "estimator": {"source": ds_estimator_name(stage), "bytes": estimate, "counted_bytes": peak.counted_bytes,
                          "shared": list(peak.shared), "elsewhere": list(peak.elsewhere), "extra": list(peak.extra),
                          "note": None if estimate is not None else "DeepSpeed's estimator assumes 2-byte parameters "
                          "(bf16 / fp16)" + (" and needs the largest layer" if unknown else "")}}


def ds_term_legend() -> list[str]:
    """What each term of ``ds_peak`` is (:data:`TERMS`), one line each."""
    return [f"{t}: {what}" for t, what in TERMS.items()]
