"""Fake CPU devices before JAX starts: every test sees 8 devices unless it starts its own processes."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
# One persistent compilation cache for the whole session, the processes tests start included: the
# many runs of the same tiny configs compile their programs once. Results do not depend on it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "jax-compilation-cache")
)
