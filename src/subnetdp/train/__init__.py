"""Training: config schema, the trainer's step, checkpoints, and starting worker processes.

``subnetdp.train.launch`` starts local workers (or defers to torchrun) and sets up the process
group inside each one.
"""
