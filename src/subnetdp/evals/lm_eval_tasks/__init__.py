"""subnetdp's downstream tasks as lm-eval task configs: one ``NAME.yaml`` per task (lm-eval
task ``subnetdp_NAME``), each reading its validation split from local data
(``utils.load``). ``lm_eval --include_path`` on this folder scores them with plain lm-eval,
offline; ``subnetdp eval --tasks`` and ``train --eval-tasks`` use them the same way."""
