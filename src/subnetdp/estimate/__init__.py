"""Estimates without a run: one rank's spec and model (``spec``), memory on the fake-tensor
path (``memory``), bytes on the wire (``comm``), the largest model for a budget (``budget``)
and plans for workers of different sizes (``hetero``)."""
