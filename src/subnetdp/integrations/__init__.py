"""SDP from the frameworks people already train with (docs/integrations.md).

- ``subnetdp.integrations.lightning``: ``SDPStrategy``, a Lightning 2.x strategy
  (``Trainer(strategy="sdp")``); needs ``pip install 'subnetdp[lightning]'``.
- ``subnetdp.integrations.hf_trainer``: ``SDPTrainer``, a Hugging Face ``Trainer`` that trains
  with SDP under ``torchrun``; needs ``pip install 'subnetdp[hf]'``.

Nothing here is imported by ``import subnetdp``: each module imports its framework.
"""
