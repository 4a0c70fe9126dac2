"""The plan against the measurement, per cell: the expectations from the one model (:mod:`.expect`), the plan
section of ``summary.json`` (:mod:`.cell`), the peak model against the memory probe (:mod:`.memory`, :mod:`.judge`,
:mod:`.gloo`), the step time against the timed steps (:mod:`.step_time`)."""
