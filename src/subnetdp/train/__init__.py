"""Training: config schema, the trainer's step, one run end to end, the resume policy and the
elastic shrink.

``subnetdp.train.run.run_training`` trains one run from a ``TrainConfig`` (the CLI, the demo,
the study and the benchmarks call it); ``subnetdp.distributed`` starts the workers and sets up
their process group; ``subnetdp.checkpoint`` saves and restores a rank's share exactly;
``resume`` decides where a run starts and what it may change.
"""
