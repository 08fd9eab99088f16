"""Hardware cells (configs/cells/*.toml): every cell's command goes through SGLang's real argument parser
(strictly: no abbreviations, so a misspelled or truncated flag fails), then through SGLang's full
resolution with this plugin's rules (`sglang_ernie55.args.resolve_server_args`, on CPU, with a
config-only tiny checkpoint), then through the memory planner at full size.

What each cell's tests check:
- strict parse: every flag exists in `sglang serve` under exactly that name, its value passes the flag's
  type and choices, and the parsed field equals the cell's value;
- resolution: SGLang's resolution pipeline plus the ERNIE-5.5 rules accept the command (attention TP
  divides the 8 output groups, ECHO shape, KV dtype, DeepEP width, long-context limits) and resolve the
  model's own defaults (backend ernie55, page 256, SWA ratio 0.1, FP8 KV). The tiny checkpoint has
  full-size attention geometry (8 output groups), so the TP rules are the real ones; GPU counts are not
  checked by SGLang on CPU (the planner and the layout test below do that);
- planner: the cell fits its GPUs at full size, and its GPU count is the planner's minimum.
"""

from __future__ import annotations

import argparse
import math

import pytest

from sglang_ernie55.configuration import Ernie55Config
from sglang_ernie55.deploy import cells as C
from sglang_ernie55.deploy.memory import Layout, minimum_gpus, plan

CELLS = C.load_cells()
FULL = Ernie55Config()
ECHO = {
    "speculative-algorithm": "EAGLE",
    "speculative-num-steps": 2,
    "speculative-eagle-topk": 1,
    "speculative-num-draft-tokens": 3,
}
ids = list(CELLS)


@pytest.fixture(scope="module")
def strict_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", allow_abbrev=False, exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def strict_parse(parser: argparse.ArgumentParser, argv: list[str]):
    from sglang.srt.server_args import ServerArgs

    ns, unknown = parser.parse_known_args(argv)
    assert not unknown, f"flags SGLang does not know: {unknown}"
    return ns, ServerArgs.from_cli_args(ns)


def dest_of(parser: argparse.ArgumentParser, flag: str) -> str:
    return parser._option_string_actions[f"--{flag}"].dest


# ------------------------------------------------------------------------------------------ the set
def test_every_combination_has_exactly_one_cell():
    want = {f"{h}-{p}-{s}" for h in C.GPUS for p in C.PRECISIONS for s in C.STRATEGIES}
    assert set(CELLS) == want


@pytest.mark.parametrize("name", ids)
def test_cell_uses_the_planners_minimum_gpus(name):
    cell = CELLS[name]
    n, _ = minimum_gpus(FULL, cell.gpu, cell.precision)
    assert cell.num_gpus == n
    assert cell.nodes == math.ceil(n / cell.gpu.gpus_per_node)
    tp, pp, dp = cell.int_flag("tp-size"), cell.int_flag("pp-size"), cell.int_flag("dp-size")
    assert tp * pp * dp == cell.num_gpus, "tp x pp x dp must use every GPU of the cell"


def test_vendor_verified_cells_follow_servings_table():
    vendor_pairs = {(c.hardware, c.precision) for c in CELLS.values() if c.vendor_verified}
    assert vendor_pairs == {
        ("b300", "fp8"),
        ("gb300", "fp8"),
        ("b300", "bf16"),
        ("b200", "fp8"),
        ("gb200", "fp8"),
        ("h100", "fp8"),
    }
    assert not any(c.vendor_verified for c in CELLS.values() if c.hardware == "h200"), (
        "H200 is not in the vendor's table"
    )
    for c in CELLS.values():
        assert c.vendor_note, c.name
        assert not c.project_verified or c.project_date, c.name


@pytest.mark.parametrize("name", ids)
def test_strategy_shape(name):
    cell = CELLS[name]
    f = cell.flags
    tp, attn_dp = cell.int_flag("tp-size"), cell.int_flag("attn-dp-size")
    assert (tp // attn_dp) in (1, 2, 4, 8), "attention TP must divide the 8 HCA output groups"
    if cell.strategy == "low-latency":
        assert {k: f[k] for k in ECHO} == ECHO, "ECHO 2 steps: topk 1, draft tokens = steps + 1"
    else:
        assert "speculative-algorithm" not in f
    if cell.strategy == "high-throughput":
        if (cell.hardware, cell.precision) == ("h100", "bf16"):
            # the deployment guides' exception: 2x8 H100 keep attention TP at 8
            assert (tp, attn_dp) == (16, 2), "H100 BF16 high throughput is --tp 16 --attn-dp-size 2"
        else:
            assert attn_dp == tp, "high throughput = attention DP over every GPU"
    if cell.strategy == "long-context":
        assert f["context-length"] == 1048576
        assert f["max-running-requests"] <= 8 and f["cuda-graph-max-bs-decode"] <= f["max-running-requests"]
    else:
        assert f["context-length"] == 131072


@pytest.mark.parametrize("name", ids)
def test_attention_tp_divides_the_models_heads(name):
    """Each attention-TP rank owns whole heads, whole HCA output groups and whole indexer heads."""
    cell = CELLS[name]
    tp, dp, cp = cell.int_flag("tp-size"), cell.int_flag("attn-dp-size"), cell.int_flag("attn-cp-size")
    assert tp % (dp * cp) == 0, (tp, dp, cp)
    attn_tp = tp // (dp * cp)
    for field in ("num_attention_heads", "o_groups", "index_n_heads"):
        assert getattr(FULL, field) % attn_tp == 0, (field, getattr(FULL, field), attn_tp)


# ------------------------------------------------------------------------------------------ SGLang's parser
@pytest.mark.parametrize("name", ids)
def test_cell_parses_strictly_with_sglangs_parser(strict_parser, name):
    cell = CELLS[name]
    for rank in range(cell.nodes):
        argv = cell.serve_argv(node_rank=rank, dist_init_addr="10.0.0.1:20000", host="127.0.0.1", port=30000)
        ns, sa = strict_parse(strict_parser, argv)
        for flag, value in cell.flags.items():
            got = getattr(ns, dest_of(strict_parser, flag))
            assert got == value or str(got) == str(value), (flag, got, value)
        assert (sa.nnodes, sa.node_rank) == (cell.nodes, rank)


@pytest.mark.parametrize(
    "bad", [{"tp": 4}, {"attn-dp-sise": 4}, {"cuda-graph-backend-decode": "fast"}, {"kv-cache-dtype": "fp16"}]
)
def test_strict_parse_catches_misspellings(strict_parser, bad):
    """The check above can fail: an abbreviation, a typo or an illegal choice does not get through."""
    cell = CELLS["h200-fp8-balanced"]
    argv = ["--model-path", "x"] + [a for k, v in bad.items() for a in (f"--{k}", str(v))]
    with pytest.raises((AssertionError, argparse.ArgumentError, SystemExit)):
        strict_parse(strict_parser, argv + cell.flag_argv())


# ------------------------------------------------------------------------------------------ resolution
@pytest.mark.parametrize("name", ids)
def test_cell_resolves_with_the_plugin_rules(tiny_ckpt, name):
    from sglang_ernie55.args import resolve_server_args

    cell = CELLS[name]
    d = resolve_server_args(cell.serve_argv(model_path=tiny_ckpt), device="cpu").resolved_dict()
    assert (d["attention_backend"], d["page_size"], d["swa_full_tokens_ratio"], d["kv_cache_dtype"]) == (
        "ernie55",
        256,
        0.1,
        "fp8_e4m3",
    )
    assert d["tp_size"] == cell.int_flag("tp-size") and d["attn_dp_size"] == cell.int_flag("attn-dp-size")
    assert d["context_length"] == cell.flags["context-length"]
    if cell.strategy == "low-latency":
        assert (
            d["speculative_algorithm"],
            d["speculative_num_steps"],
            d["speculative_eagle_topk"],
            d["speculative_num_draft_tokens"],
        ) == ("EAGLE", 2, 1, 3)
    else:
        assert d["speculative_algorithm"] in (None, "NONE")


def test_resolution_rejects_an_illegal_cell(tiny_ckpt):
    """The resolution check can fail: attention TP 16 does not divide the 8 output groups."""
    from sglang_ernie55.args import Ernie55ArgumentError, resolve_server_args

    with pytest.raises(Ernie55ArgumentError):
        resolve_server_args(["--model-path", tiny_ckpt, "--tp-size", "16"], device="cpu")


# ------------------------------------------------------------------------------------------ planner
@pytest.mark.parametrize("name", ids)
def test_cell_fits_at_full_size(name):
    cell = CELLS[name]
    p = plan(FULL, Layout.from_cell(cell))
    assert p.fits, p.reasons
    if cell.strategy == "long-context":
        assert p.max_concurrency_at(1048576) >= cell.flags["max-running-requests"]


# ------------------------------------------------------------------------------------------ schema
GOOD = """
[cell]
hardware = "h200"
precision = "fp8"
strategy = "balanced"
nodes = 1
gpus_per_node = 4
summary = "s"
[verified]
vendor = false
project = false
[flags]
tp-size = 4
[env]
"""


@pytest.mark.parametrize(
    "edit, match",
    [
        (('hardware = "h200"', 'hardware = "h300"'), "hardware"),
        (("tp-size = 4", "--tp-size = 4"), "without dashes"),
        (("tp-size = 4", "port = 8000"), "come from `cmd`"),
        (("project = false", 'project = true\nproject_date = "soon"'), "YYYY-MM-DD"),
        (("gpus_per_node = 4", "gpus_per_node = 16"), "gpus_per_node"),
        (("[env]", "[envs]"), "unknown tables"),
        (("tp-size = 4", "tp-size = [4]"), "string, integer or boolean"),
    ],
)
def test_schema_errors(edit, match):
    C._parse("h200-fp8-balanced", GOOD)  # the control parses
    with pytest.raises(C.CellError, match=match):
        C._parse("h200-fp8-balanced", GOOD.replace(*edit))


def test_file_name_must_match_the_cell():
    with pytest.raises(C.CellError, match="must be named h200-fp8-balanced.toml"):
        C._parse("h200-fp8-fast", GOOD)


def test_gpu_from_device_name():
    assert C.gpu_from_device_name("NVIDIA GB200").key == "gb200"
    assert C.gpu_from_device_name("NVIDIA B200").key == "b200"
    assert C.gpu_from_device_name("NVIDIA H100 80GB HBM3").key == "h100"
    assert C.gpu_from_device_name("NVIDIA H200").key == "h200"
    assert C.gpu_from_device_name("NVIDIA A100-SXM4-80GB") is None
