"""XLA flags for the tests and for the processes they start."""

# XLA:CPU's generated code built by LLVM without optimisation: a cold test run is mostly compiling,
# and this compiles markedly faster. What XLA decides (HLO passes, shardings, buffer assignment, so
# memory_analysis and cost_analysis) is the same; the benchmarks and `make train` run at the
# default level.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process with `devices` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
