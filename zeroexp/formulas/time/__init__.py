"""The step-time model: a collective's time and the compute rates (:mod:`~zeroexp.formulas.time.rates`), a step's
time from its groups, where each collective overlaps compute (:mod:`~zeroexp.formulas.time.overlap`), and the
framework's own per-step work (:mod:`~zeroexp.formulas.time.framework`)."""
