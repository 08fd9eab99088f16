"""Test-only (tests/serving/test_geometry_matrix_cpu.py puts this folder on a CPU server's PYTHONPATH).

The server sized by SGLang's default memory flags takes most of the host's free memory for its KV pool. This
makes its processes the kernel's first choice if the host then runs out of memory, so that the test's server
dies (and the test fails, naming the cause) rather than an unrelated process on a shared runner."""

try:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
except OSError:  # not Linux, or /proc read-only: the server runs unprotected
    pass
