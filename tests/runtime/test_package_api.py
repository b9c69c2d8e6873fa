"""The package's public names (issue 28 item 2): ``subnetdp.parallelize`` stays the function
whichever is imported first, the function or its module ``subnetdp/parallelize.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Each runs in a fresh interpreter: what matters is which import comes first.
ORDERS = {
    "function first": """
import types
from subnetdp import parallelize
import subnetdp
assert isinstance(parallelize, types.FunctionType), parallelize
assert subnetdp.parallelize is parallelize, subnetdp.parallelize
import subnetdp.parallelize
from subnetdp import parallelize as again
assert again is parallelize and subnetdp.parallelize is parallelize, again
""",
    "module first": """
import types
import subnetdp.parallelize
from subnetdp.parallelize import storage_dtype
import subnetdp.train.build  # the library's own import of the module
from subnetdp import parallelize
assert isinstance(parallelize, types.FunctionType), parallelize
assert subnetdp.parallelize is parallelize is sys.modules["subnetdp.parallelize"].parallelize
""",
}


@pytest.mark.parametrize("order", ORDERS)
def test_parallelize_is_the_function(order: str) -> None:
    code = "import sys\n" + ORDERS[order]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
