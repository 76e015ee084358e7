import pytest

torch = pytest.importorskip("torch", reason="the Python tests need torch (tools/install-deps.sh --python)")
