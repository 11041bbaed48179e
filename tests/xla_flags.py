"""XLA flags for the tests and for the processes they start."""

# XLA:CPU's code generated quickly rather than well: a cold test run is mostly compiling. LLVM
# without optimisation or its expensive passes, one codegen module instead of several split for
# threads, and XLA:CPU's elemental emitter for fusions rather than its MLIR fusion emitters
# together halve the compile time of the tests' programs. The shardings XLA decides are the same;
# XLA:CPU's own fusion and buffer sizes may differ, and a fused chain may round an ulp apart from
# the same ops run one by one. The benchmarks and `make train` run at XLA's defaults.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_parallel_codegen_split_count=1 --xla_cpu_use_fusion_emitters=false")


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process with `devices` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
