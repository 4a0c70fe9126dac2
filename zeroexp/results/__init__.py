"""What a cell and a sweep leave on disk, read and written anywhere: the files of a cell directory (:mod:`.files`),
a calibration file (:mod:`.calibration`), the W&B offline reader (:mod:`.wandb_offline`), and the parts of a report
table that the probes and the report share: sections (:mod:`.section`), number formats (:mod:`.format`), the cells in
ladder order (:mod:`.cells`) and their axes (:mod:`.axes`); a check's verdict and coded reasons (:mod:`.verdict`).
It imports nothing here on import."""
