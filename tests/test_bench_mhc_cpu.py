"""benchmarks/bench_mhc.py on a machine without a GPU: its help, and a refusal that names what it needs."""

from __future__ import annotations

import pytest

from benchmarks import bench_mhc


def test_help_and_refusal_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        bench_mhc.main(["--help"])
    assert e.value.code == 0 and "SGLANG_ERNIE55_MHC_MIX" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench_mhc.main(["--tokens", "256"])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_configs_start_with_the_shipped_one():
    assert bench_mhc.CONFIGS[0] == bench_mhc.MH.MIX_CONFIG and len(set(bench_mhc.CONFIGS)) == len(
        bench_mhc.CONFIGS
    )


def test_post_configs_start_with_the_shipped_one():
    P = bench_mhc.POST_CONFIGS
    assert P[0] == bench_mhc.MH.POST_MIX_CONFIG and len(set(P)) == len(P)
