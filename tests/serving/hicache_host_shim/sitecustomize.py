"""Test-only (tests/serving/test_hicache_cpu.py puts this folder on the CPU server's PYTHONPATH).

SGLang 0.5.23 leaves 10 GiB of host memory to everything else before it sizes a HiCache host pool
(`pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES`, read when a pool is built) and refuses any pool on a host
with less free, as a shared test runner often has; the test server's host pools take a few MiB, so 1 GiB is
left instead. Nothing else changes."""

from ernie55_shim_lib import patch_after_import


def _lower_reserve(module):
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = 1 << 30


patch_after_import({"sglang.srt.mem_cache.pool_host.base": _lower_reserve})
