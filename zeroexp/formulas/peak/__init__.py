"""The peak model: what a rank holds above its steady state in each phase of a training step, by category.

- :mod:`~zeroexp.formulas.peak.phases`: the traced step's segments and each phase's peak, per gradient flow and over
  FSDP1's units; :mod:`~zeroexp.formulas.peak.fsdp2`: over FSDP2's;
- :mod:`~zeroexp.formulas.peak.precision`: what mixed precision holds in which dtype;
- :mod:`~zeroexp.formulas.peak.accumulation`: over the micro-batches of ``grad_accum``;
- :mod:`~zeroexp.formulas.peak.checkpointing`: what a checkpointed forward keeps and a unit's recompute adds;
- :mod:`~zeroexp.formulas.peak.adamw`: AdamW's temporaries; :mod:`~zeroexp.formulas.peak.allocator`: the caching
  allocator's blocks and segments;
- :mod:`~zeroexp.formulas.peak.deepspeed`, :mod:`~zeroexp.formulas.peak.deepspeed_terms`: DeepSpeed's stages 1-3;
  :mod:`~zeroexp.formulas.peak.ds_stage0`: its stage 0.

Which of these a row uses is its family's (:mod:`zeroexp.formulas.families`).
"""
