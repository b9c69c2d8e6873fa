"""Checkpoints: the file layout (``files``), one rank's exact save and restore
(``checkpointer``), resharding into another world (``reshard``) and run-folder ownership
(``rundir``)."""
