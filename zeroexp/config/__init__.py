"""A cell's configuration, composed and checked before launch (runs in the launching process): the schemas and
validation (:mod:`.schemas`), a cell's identity (:mod:`.cell`), the model check (:mod:`.model_check`), the resources
check (:mod:`.resources`), the ``init`` axis (:mod:`.init_mode`) and which steps each probe owns (:mod:`.schedule`).
It imports nothing here on import."""
