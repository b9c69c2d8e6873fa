"""Issue 31: an integration whose framework is missing is refused in one line that says what
to install."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize(("module", "framework", "extra"), [
    ("subnetdp.integrations.lightning", "lightning.pytorch", "subnetdp[lightning]"),
    ("subnetdp.integrations.hf_trainer", "transformers", "subnetdp[hf]"),
])
def test_missing_framework_is_one_line(monkeypatch: pytest.MonkeyPatch, module: str,
                                       framework: str, extra: str) -> None:
    monkeypatch.setitem(sys.modules, framework, None)  # import of it raises ImportError
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as err:
        importlib.import_module(module)
    assert f"pip install '{extra}'" in str(err.value) and "\n" not in str(err.value)
    assert err.value.__suppress_context__  # no chained traceback of the framework's import


def test_transformers_before_5_3_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41, item 12: before 5.3 the Trainer clipped inline, by one rank's norm (SDPTrainer
    could not give it the full model's): refused at import, in one line naming the range."""
    import transformers

    monkeypatch.delattr(transformers.Trainer, "_clip_grad_norm")
    monkeypatch.delitem(sys.modules, "subnetdp.integrations.hf_trainer", raising=False)
    with pytest.raises(ImportError) as err:
        importlib.import_module("subnetdp.integrations.hf_trainer")
    assert "needs transformers>=5.3 (tested: 5.3 to 5.25)" in str(err.value)
    assert "\n" not in str(err.value)
