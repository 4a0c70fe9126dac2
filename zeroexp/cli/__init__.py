"""The command lines (runs in the process a person or a script starts): ``python -m zeroexp`` (:mod:`.run`), the
planner's (:mod:`.plan`) and the calibration's (:mod:`.calibrate`), a sweep's Hydra callbacks (:mod:`.sweep`), the
one Hydra entry helper (:mod:`.hydra_app`), the plain-argument commands' start (:mod:`.plain_args`) and the exit
without teardown (:mod:`.quick_exit`). Nothing imports this
package but the entry points (``zeroexp/__main__.py``, a package's own ``__main__.py``); it imports nothing here on
import."""
