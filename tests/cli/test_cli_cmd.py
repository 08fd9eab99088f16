"""`sglang-ernie55 cmd`: the command of a cell, its docker line, multi-node flags, and errors that list cells."""

from __future__ import annotations

import json
import shlex

from sglang_ernie55.args.rules import parallel_layout_refusal
from sglang_ernie55.deploy.cells import load_cells


def test_single_node_command_and_docker_line(cli):
    rc, out, err = cli("cmd", "--hardware", "h200", "--precision", "fp8", "--strategy", "balanced")
    assert rc == 0, err
    lines = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 2
    bare, docker = lines
    assert shlex.split(bare)[:6] == [
        "sglang",
        "serve",
        "--model-path",
        "baidu/ERNIE-5.5-Flash-Base",
        "--tp-size",
        "4",
    ]
    words = shlex.split(docker.replace("~/", "HOME/"))
    assert words[:2] == ["docker", "run"]
    for flag in (["--gpus", "all"], ["--network", "host"], ["--ipc", "host"]):
        i = words.index(flag[0])
        assert words[i : i + 2] == flag
    assert "HOME/.cache/huggingface:/root/.cache/huggingface" in words
    assert docker.endswith(bare)  # the same serve command inside the container
    assert "verified by vendor: no" in out and "not yet" in out  # H200 is the project's own cell


def test_multi_node_fills_node_flags(cli):
    rc, out, err = cli(
        "cmd",
        "--hardware",
        "h100",
        "--precision",
        "bf16",
        "--strategy",
        "high-throughput",
        "--dist-init-addr",
        "10.1.2.3:5000",
    )
    assert rc == 0, err
    cmds = [shlex.split(ln) for ln in out.splitlines() if ln.startswith("sglang serve")]
    assert len(cmds) == 2
    for rank, argv in enumerate(cmds):
        i = argv.index("--nnodes")
        assert argv[i : i + 6] == [
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--dist-init-addr",
            "10.1.2.3:5000",
        ]
        assert argv[argv.index("--tp-size") + 1] == "16"


def test_multi_node_placeholder_warns(cli):
    rc, out, err = cli("cmd", "--hardware", "gb200", "--precision", "bf16", "--node-rank", "1", "--no-docker")
    assert rc == 0
    (line,) = [ln for ln in out.splitlines() if ln.startswith("sglang serve")]
    assert "--node-rank 1 --dist-init-addr NODE0_IP:20000" in line
    assert "NODE0_IP" in err


def test_unknown_combination_lists_what_exists(cli):
    rc, out, err = cli("cmd", "--hardware", "a100", "--precision", "fp4", "--strategy", "fast")
    assert rc == 2 and out == ""
    assert (
        "unknown hardware 'a100'" in err
        and "unknown precision 'fp4'" in err
        and "unknown strategy 'fast'" in err
    )
    assert err.count("\n") >= len(load_cells())  # the table of every cell
    assert "h100     bf16      high-throughput" in err


def test_impossible_node_count_is_an_error(cli):
    rc, out, err = cli("cmd", "--hardware", "h100", "--precision", "bf16", "--nodes", "1")
    assert rc == 2
    assert "runs on 2 node(s) of 8 H100 (16 GPUs), not 1" in err and "Cells that exist" in err
    rc, _, err = cli("cmd", "--hardware", "h100", "--precision", "fp8", "--node-rank", "1")
    assert rc == 2 and "single-node" in err


def test_host_warning_and_port(cli):
    rc, out, err = cli("cmd", "--hardware", "b300", "--host", "0.0.0.0", "--port", "8080", "--no-docker")
    assert rc == 0 and "--host 0.0.0.0 --port 8080" in out and "--api-key" in err
    assert "docker run" not in out


def test_json_output_and_env(cli):
    rc, out, _ = cli(
        "cmd", "--hardware", "b300", "--precision", "bf16", "--strategy", "low-latency", "--json"
    )
    assert rc == 0
    d = json.loads(out)
    assert d["cell"] == "b300-bf16-low-latency" and d["model"] == "baidu/ERNIE-5.5-Flash-Base-BF16"
    argv = d["commands"][0]["argv"]
    i = argv.index("--speculative-num-steps")
    assert argv[i : i + 6] == [
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "3",
    ]
    assert d["vendor_verified"] is True and d["project_verified"] is False


def test_env_goes_into_both_lines():
    cell = next(iter(load_cells().values()))
    import dataclasses

    c = dataclasses.replace(cell, env={"NCCL_DEBUG": "WARN"})
    assert c.shell_command().startswith("NCCL_DEBUG=WARN sglang serve ")
    assert "-e NCCL_DEBUG=WARN" in c.docker_command()


def test_list_and_help(cli):
    rc, out, _ = cli("cmd", "--list")
    assert rc == 0 and len(out.strip().splitlines()) == len(load_cells()) + 1
    rc, out, _ = cli("cmd", "--help")
    assert rc == 0 and "Multi-node cells" in out and "--dist-init-addr" in out


def test_attention_dp_recipes_print_as_they_are(cli):
    """Attention DP builds at attention TP 1 and above (docs/serving-design.md section 8), so its recipes are
    printed as they are, with no refusal note: H200 BF16 at attention TP 1, H100 BF16 at attention TP 8 (two
    nodes, one command each)."""
    rc, out, err = cli("cmd", "--hardware", "h200", "--precision", "bf16", "--strategy", "high-throughput")
    assert rc == 0, err
    assert "NOT YET SUPPORTED" not in out and "refused" not in out + err
    bare, docker = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    argv = shlex.split(bare)
    assert argv[argv.index("--tp-size") + 1] == "8" and argv[argv.index("--attn-dp-size") + 1] == "8"
    assert docker.endswith(bare)
    for strategy in ("balanced", "high-throughput"):
        rc, out, err = cli(
            "cmd", "--hardware", "h100", "--precision", "bf16", "--strategy", strategy, "--no-docker"
        )
        assert rc == 0 and "NOT YET SUPPORTED" not in out and "refused" not in out + err, (strategy, out)
        for argv in [shlex.split(ln) for ln in out.splitlines() if ln.startswith("sglang serve")]:
            assert argv[argv.index("--tp-size") + 1] == "16" and argv[argv.index("--attn-dp-size") + 1] == "2"


def test_refused_recipes_print_the_layout_that_runs(cli, dp_with_ep):
    """A recipe the model refuses (attention DP with EP): the printed block says why in comment lines, and its
    commands are the nearest layout that runs (the same flags without --attn-dp-size); a copied or piped block
    keeps the explanation."""
    rc, out, err = cli("cmd", "--hardware", "h200", "--precision", "fp8", "--strategy", "high-throughput")
    assert rc == 0, err
    notes = [ln for ln in out.splitlines() if ln.startswith("#")]
    assert any(
        "NOT YET SUPPORTED" in ln and "expert parallelism (--ep 8)" in ln and "--attn-dp-size 4" in ln
        for ln in notes
    )
    assert any("nearest layout that runs" in ln and "(attention TP 8" in ln for ln in notes)
    assert any("recipe (refused by this version)" in ln and "--attn-dp-size 4" in ln for ln in notes)
    bare, docker = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    argv = shlex.split(bare)
    assert "--attn-dp-size" not in argv and argv[argv.index("--tp-size") + 1] == "8"
    assert argv[argv.index("--ep-size") + 1] == "8"
    assert docker.endswith(bare) and "nearest layout" in err
    rc, out, _ = cli(
        "cmd", "--hardware", "h200", "--precision", "fp8", "--strategy", "high-throughput", "--json"
    )
    d = json.loads(out)
    assert rc == 0 and d["layout_supported"] is False
    assert (
        "--attn-dp-size" not in d["commands"][0]["argv"]
        and "--attn-dp-size" in d["recipe_commands"][0]["argv"]
    )


def test_cells_without_a_layout_that_runs_print_no_command(cli, no_layout_runs):
    argv = ("cmd", "--hardware", "h100", "--precision", "bf16", "--strategy", "high-throughput")
    rc, out, err = cli(*argv)
    assert rc == 1 and all(ln.startswith("#") for ln in out.splitlines() if ln)
    assert "attention TP 8" in out and "No layout of this cell runs" in out and "no command printed" in err
    rc, out, _ = cli(*argv, "--json")
    assert rc == 1 and json.loads(out)["commands"] == []


def test_every_printed_command_runs_in_this_version(cli):
    """No cell prints a layout the model refuses (`parallel_layout_refusal`, what the model checks when it is
    built), and the attention TP of each divides the HCA output groups."""
    for cell in load_cells().values():
        rc, out, _ = cli(
            "cmd",
            "--hardware",
            cell.hardware,
            "--precision",
            cell.precision,
            "--strategy",
            cell.strategy,
            "--no-docker",
        )
        commands = [shlex.split(ln) for ln in out.splitlines() if ln.startswith("sglang serve")]
        runnable = cell.runnable()
        assert (rc == 0 and commands) if runnable else (rc == 1 and not commands), cell.name
        for argv in commands:
            # every printed command is a layout the model builds
            def value(flag, d=1, argv=argv):
                return int(argv[argv.index(flag) + 1]) if flag in argv else d

            tp, dp = value("--tp-size"), value("--attn-dp-size")
            spec = "--speculative-algorithm" in argv
            assert parallel_layout_refusal(tp, dp, value("--attn-cp-size"), speculative=spec) is None, argv
            assert 8 % (tp // dp) == 0, cell.name
        assert (cell.unimplemented_layout() is None) == (cell.layout_refusal() is None), cell.name
