"""What every wing shares: the chip table, the driver-worker protocol, the JAX platforms a process
starts, and the error of user input."""
