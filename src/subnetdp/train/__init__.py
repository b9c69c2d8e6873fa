"""Training: config schema, the trainer's step, one run end to end, checkpoints and the resume
policy, and starting worker processes.

``subnetdp.train.run.run_training`` trains one run from a ``TrainConfig`` (the CLI, the demo,
the study and the benchmarks call it); ``subnetdp.distributed.launch`` starts local workers (or
defers to torchrun) and sets up the process group inside each one; ``checkpoint`` saves and
restores a rank's share exactly, ``resume`` decides where a run starts and what it may change.
"""
