"""The process around the program: several processes under `jax.distributed` (`multiprocess.py`) and glibc's
allocator setting for XLA:CPU's temporaries (`host_memory.py`); run-time failures (`failures.py`) and writers that
leave a whole output or nothing, SIGTERM included (`atomic.py`)."""
