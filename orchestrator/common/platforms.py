"""Which JAX platforms a process starts, and XLA's CUDA compiler loaded only when a target needs it.

Left to choose, JAX starts every installed accelerator plugin at its first use, and without their
hardware they fail loudly: the CUDA plugin checks its CUDA libraries and looks for a driver, libtpu
looks for the hosts of its slice. A process whose devices are the CPU's (it compiles for a target,
whose devices are compile-only, or its machine has no accelerator) starts the CPU alone and skips
the discovery of accelerator plugins; compiling for a GPU target registers the CUDA plugin then
(`register_cuda_compiler`), and libtpu is loaded by JAX's TPU topology itself.
"""

from __future__ import annotations

import os
import sys
import tempfile


def has_accelerator() -> bool:
    """Whether a TPU chip or an NVIDIA GPU is attached, looked up as JAX does before it starts those
    backends (TPU PCI ids, NVIDIA device files). On a TPU VM JAX itself then picks `tpu,cpu`."""
    from jax._src import hardware_utils

    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0 or hardware_utils.has_visible_nvidia_gpu()


def start_jax(*, compile_only: bool = False) -> None:
    """Sets this process's JAX platforms before any backend starts.

    Unless JAX_PLATFORMS says otherwise, a process that only compiles for a target (`compile_only`;
    this machine's accelerators stay untouched) or runs on a machine without accelerators uses the
    CPU alone. A process on the CPU alone skips JAX's discovery of accelerator plugins.
    """
    import jax
    from jax._src import xla_bridge

    platforms = os.environ.get("JAX_PLATFORMS")
    if platforms is None and (compile_only or not has_accelerator()):
        platforms = "cpu"
        jax.config.update("jax_platforms", platforms)
    if platforms == "cpu":
        with xla_bridge._plugin_lock:
            xla_bridge._plugins_registered = True


def register_cuda_compiler() -> None:
    """Registers XLA's CUDA plugin with JAX where JAX has not (`start_jax` skipped its discovery),
    as JAX's discovery would.

    What the plugin prints while it loads (no CUDA driver, no CUDA kernels package: both expected on
    a machine that only compiles) is shown only when the plugin fails to register."""
    from jax._src import xla_bridge

    if "cuda" in xla_bridge._topology_factories:
        return
    from jax_plugins import xla_cuda12

    with tempfile.TemporaryFile("w+") as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            xla_cuda12.initialize()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if "cuda" not in xla_bridge._topology_factories:
                captured.seek(0)
                sys.stderr.write(captured.read())
