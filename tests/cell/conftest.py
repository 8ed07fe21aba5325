"""The cell agent's tests run against the proxy harness of tests/proxy (real proxy, real NATS)."""

from tests.proxy.conftest import model_dir, proxy, renderer  # noqa: F401  (fixtures)
