"""Fake CPU devices before JAX starts: every test sees 8 devices unless it starts its own processes."""

import os

import pytest
from xla_flags import FAST_COMPILE, xla_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags = f"{flags} {xla_flags(8)}".strip()
elif FAST_COMPILE not in flags:
    flags = f"{flags} {FAST_COMPILE}"
os.environ["XLA_FLAGS"] = flags
# One persistent compilation cache for the whole session, the processes tests start included: the
# many runs of the same tiny configs compile their programs once. Every program is cached, however
# short its compile (JAX's default skips those under 1 s): tests build their steps afresh and the
# two pytest workers run the same tiny configs, so most compiles are repeats. Results do not
# depend on it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "jax-compilation-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


# A worker's resident memory above which it drops JAX's program caches after a test file.
_RELEASE_ABOVE = 3 * 2**30


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """A pytest worker runs hundreds of test files in one process and keeps every program it has
    compiled: once it holds more than `_RELEASE_ABOVE`, JAX's caches of traced and compiled programs
    are dropped after each file so that their executables are freed (the persistent cache keeps the
    compiles). Dropping them after every file instead costs the reloads of programs later files share."""
    yield
    resident = _resident_bytes()
    if resident is not None and resident < _RELEASE_ABOVE:
        return
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
