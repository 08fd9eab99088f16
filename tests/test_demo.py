"""`sglang-ernie55 demo` (the README's main job) on CPU: the real SGLang server end to end against the
KV-rounded reference, and every way it can fail (server dies, does not come up in time, the request
fails, Ctrl-C) ending in one message with the server log's tail and an exit status, never a traceback
of the demo's own. Fake servers stand in where only the demo's side is under test.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from sglang_ernie55.cli import demo  # noqa: E402
from sglang_ernie55.cli.main import main  # noqa: E402
from tests.serving import server_harness as sh

PROGRESS = re.compile(r"^\[ernie55-demo +\d+\.\ds\] ")


def run_demo(tmp_path: Path, *args: str, timeout: float = 900) -> tuple[int, str]:
    """The demo as a user runs it (its own process), stdout and stderr together."""
    cmd = [sys.executable, "-m", "sglang_ernie55.cli.main", "demo", "--out", str(tmp_path / "ckpt"), *args]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return p.returncode, p.stdout


def assert_no_demo_traceback(out: str) -> None:
    """Tracebacks may appear only inside the quoted server log ("    | "), and none through the demo."""
    for line in out.splitlines():
        if "Traceback (most recent call last)" in line:
            assert line.startswith("    | "), out
    assert "sglang_ernie55/cli/demo.py" not in out and "sglang_ernie55/cli/main.py" not in out, out


def test_help_explains_every_cpu_flag(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flags, why in demo.CPU_SERVER_ARGS:
        assert " ".join(flags) in text and " ".join(why.split()) in text
    assert "no flag but the model path" in text and "random tokens" in text


def test_server_commands(tmp_path):
    gpu = demo.server_command(tmp_path, 1234, cpu=False, extra=[])
    assert gpu[1:] == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(tmp_path),
        "--host",
        "127.0.0.1",
        "--port",
        "1234",
    ]
    cpu = demo.server_command(tmp_path, 1234, cpu=True, extra=["--page-size", "64"])
    assert cpu[len(gpu) :] == [
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "bfloat16",
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "4",
        "--page-size",
        "64",
    ]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt", dtype="bf16", seed=0)


def test_bf16_rounding_is_the_serving_oracle(tiny_ckpt):
    """The demo's K/V rounding gives the same logits as the serving tests' oracle (kv_rounded_reference,
    bf16), on a sequence long enough for a compressed HCA entry; it changes the logits and is undone."""
    from sglang_ernie55.reference import functional as Fn
    from sglang_ernie55.reference import model as M

    cfg, ref = sh.load_reference(tiny_ckpt, "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (cfg.compress_ratio + 20,), generator=g)
    saved = (M.HCAAttention.project, M.MLADSAAttention.project, Fn.hca_compress)
    plain = ref.forward(ids).logits
    with demo._bf16_kv_rounding():
        ours = ref.forward(ids).logits
    assert (M.HCAAttention.project, M.MLADSAAttention.project, Fn.hca_compress) == saved
    with sh.kv_rounded_reference("bfloat16"):
        oracle = ref.forward(ids).logits
    assert torch.equal(ours, oracle)
    assert not torch.equal(ours, plain)


def test_reference_greedy_guess_only_saves_time(tiny_ckpt):
    """With the server's tokens as a guess (right, or wrong from some position on) the reference's greedy
    tokens are the same as without one."""
    alone = demo.reference_greedy(tiny_ckpt, 4, round_kv_bf16=True)
    ids = alone["ids"]
    assert len(ids) == 4 or ids[-1] == alone["eos"]
    for guess in (ids, ids[:2] + [(t + 1) % 512 for t in ids[2:]]):
        got = demo.reference_greedy(tiny_ckpt, 4, round_kv_bf16=True, guess=guess)
        gaps = got.pop("guess_gaps")
        assert got == alone
        # the reference's own tokens are its top choice; the first changed one trails it
        assert len(gaps) == len(guess) and gaps[:2] == [0.0, 0.0]
        assert gaps[2:] == [0.0] * (len(ids) - 2) if guess == ids else gaps[2] > 0


@pytest.mark.slow
def test_demo_cpu_end_to_end(tmp_path):
    """The real server on CPU answers, and its tokens equal the KV-rounded reference's greedy tokens
    (checked by the demo, and here again with the serving tests' own oracle)."""
    t0 = time.time()
    rc, out = run_demo(tmp_path, "--cpu", "--max-tokens", "8")
    print(out, f"\n(demo: {time.time() - t0:.0f} s)")
    assert rc == 0, out
    assert_no_demo_traceback(out)
    lines = out.splitlines()
    steps = [ln for ln in lines if PROGRESS.match(ln)]
    order = [
        "writing a tiny random bf16 ERNIE-5.5 checkpoint",
        "--cpu was given: serving on the CPU with SGLang's real server",
        "starting the server: ",
        "waiting for the server to answer GET",
        "server ready after",
        "POST http://127.0.0.1:",
        "stopping the server: stopped (SIGTERM)",
        "the reference model (fp32, K/V rounded to bf16",
        "match: the server's 8 tokens equal the reference's greedy tokens (token ids compared exactly",
        "done in",
    ]
    at = [next(i for i, ln in enumerate(steps) if s in ln) for s in order]
    assert at == sorted(at), steps
    start = next(ln for ln in steps if "starting the server: " in ln)
    assert start.endswith(
        "-m sglang.launch_server --model-path "
        + str(tmp_path / "ckpt")
        + " --host 127.0.0.1 --port "
        + start.split("--port ")[1].split()[0]
        + " --device cpu --dtype float32 --kv-cache-dtype bfloat16"
        " --max-total-tokens 8192 --max-running-requests 4"
    )
    elapsed = [float(PROGRESS.match(ln)[0].split()[1][:-2]) for ln in steps]
    assert elapsed == sorted(elapsed)

    notice = next(i for i, ln in enumerate(lines) if "The weights are random" in ln)
    server_line = next(i for i, ln in enumerate(lines) if ln.startswith("  server:"))
    assert notice < server_line
    ids = [ast.literal_eval(m[1]) for m in re.finditer(r"^ +ids (\[[\d, ]*\])", out, re.M)]
    assert len(ids) == 2, out  # the server's, then the reference's
    server_ids, ref_ids = ids
    assert len(server_ids) == 8 and server_ids == ref_ids

    # the serving tests' oracle, teacher-forced over the server's tokens
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "ckpt"
    prompt = PreTrainedTokenizerFast.from_pretrained(str(path))(demo.PROMPT)["input_ids"]
    _, ref = sh.load_reference(path, "cpu")
    with sh.kv_rounded_reference("bfloat16"):
        logits = ref.forward(torch.tensor(prompt + server_ids)).logits[len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == server_ids


@pytest.mark.slow
def test_demo_server_dies(tmp_path):
    """A pool too small for the SWA window kills the scheduler; SGLang then kills its own process tree
    (the group the demo would signal is gone): one message, the error and log tail, exit 1."""
    rc, out = run_demo(tmp_path, "--cpu", "--max-tokens", "2", "--server-args", "--max-total-tokens 1024")
    print(out)
    assert rc == 1, out
    assert_no_demo_traceback(out)
    assert out.count("FAILED: ") == 1
    msg = out[out.index("FAILED: ") :]
    assert "FAILED: the SGLang server " in msg and "before it was ready." in msg
    assert re.search(r"\n  error: ValueError: SWA pool \(\d+ tokens\) cannot hold even one request", msg), msg
    log = str(tmp_path / "ckpt") + ".server.log"
    assert f"last lines of the server log {log}:" in msg and f"full server log: {log}" in msg
    tail = [ln for ln in msg.splitlines() if ln.startswith("    | ")]
    assert 5 <= len(tail) <= demo.LOG_TAIL_MAX
    assert (
        "Traceback (most recent call last):" in tail[0]
    )  # SGLang's "Scheduler hit an exception: Traceback ..."
    assert any("ValueError: SWA pool" in ln for ln in tail)
    # whatever SGLang left running in the group is stopped, or nothing was left
    assert msg.rstrip().splitlines()[-1] in (
        "  full server log: " + log,
        "  the server: its leftover processes stopped (SIGTERM)",
    )
    assert "POST" not in out and "match" not in out


def test_demo_server_not_up_in_time(tmp_path):
    rc, out = run_demo(tmp_path, "--cpu", "--timeout", "3", timeout=300)
    assert rc == 1, out
    assert_no_demo_traceback(out)
    msg = out[out.index("FAILED: ") :]
    assert "the SGLang server did not answer within --timeout 3 s" in msg and "Raise --timeout" in msg
    assert "full server log: " + str(tmp_path / "ckpt") + ".server.log" in msg
    assert msg.rstrip().splitlines()[-1] == "  the server: stopped (SIGTERM)"


FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, signal, sys

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a server that ignores SIGTERM: the demo must SIGKILL it

    class H(http.server.BaseHTTPRequestHandler):
        def send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.send(200, {"data": [{"id": "fake"}]} if self.path == "/v1/models" else {})

        def do_POST(self):
            print("Traceback (most recent call last):\\n  File 'model.py'\\nRuntimeError: fake model failure",
                  file=sys.stderr, flush=True)
            self.send(500, {"object": "error", "message": "Internal server error"})

    print("fake server up", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    monkeypatch.setattr(
        demo, "server_command", lambda ckpt, port, cpu, extra: [sys.executable, str(script), str(port)]
    )
    monkeypatch.setattr(demo, "STOP_GRACE_S", 1.0)
    return script


def test_request_fails_and_server_ignores_sigterm(tmp_path, fake_server, capsys):
    rc = main(["demo", "--cpu", "--out", str(tmp_path / "ckpt"), "--max-tokens", "2"])
    cap = capsys.readouterr()
    assert rc == 1, cap
    msg = cap.err[cap.err.index("FAILED: ") :]
    assert "FAILED: the request POST /v1/completions failed: HTTP 500: " in msg
    assert "Internal server error" in msg
    assert "  error: RuntimeError: fake model failure" in msg
    assert "    | Traceback (most recent call last):" in msg
    assert msg.rstrip().endswith("the server: still running 1 s after SIGTERM: killed (SIGKILL)")
    assert_no_demo_traceback(cap.out + cap.err)


def test_ctrl_c_stops_the_server(tmp_path, fake_server, monkeypatch, capsys):
    started = []
    real_init = demo.Server.__init__

    def init(self, cmd, log_path):
        real_init(self, cmd, log_path)
        started.append(self)

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo.Server, "__init__", init)
    monkeypatch.setattr(demo, "_ask", interrupt)
    rc = main(["demo", "--cpu", "--out", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    assert rc == 130, out
    assert (
        "interrupted (Ctrl-C)" in out
        and "stopping the server: still running 1 s after SIGTERM: killed" in out
    )
    (server,) = started
    assert server.proc.poll() == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.killpg(server.proc.pid, 0)


def test_stop_when_the_group_is_already_gone(tmp_path):
    """The reported crash: the server exited (SGLang killed its own tree) before the demo stopped it."""
    server = demo.Server([sys.executable, "-c", "print('bye')"], tmp_path / "s.log")
    server.proc.wait(30)
    assert server.stop() == "already gone"
    assert server.how_it_ended() == "exited with status 0"
    server = demo.Server(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], tmp_path / "k.log"
    )
    server.proc.wait(30)
    assert server.stop() == "already gone"
    assert server.how_it_ended().startswith("was killed by SIGKILL (SGLang kills its own process tree")


def test_log_tail(tmp_path):
    log = tmp_path / "s.log"
    noise = [f"[2026-12-03 10:00:{i:02d}] line {i}" for i in range(50)]
    log.write_text("\n".join(noise) + "\n")
    assert demo.log_tail(log) == (None, noise[-demo.LOG_TAIL_LINES :])
    tb = ["Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: bad pool"]
    log.write_text("\n".join(noise + tb + noise[:25]) + "\nloading 10%\rloading 100%\n")
    head, tail = demo.log_tail(log)
    assert head == "ValueError: bad pool"
    assert tail[0] == tb[0] and tail[-1] == "loading 100%" and len(tail) == 3 + 25 + 1
    long_tb = [tb[0], *[tb[1]] * 80, tb[2]]
    log.write_text("\n".join(noise + long_tb) + "\n")
    head, tail = demo.log_tail(log)
    assert tail == [tb[0], "  ... (61 lines left out)", *long_tb[-demo.LOG_TAIL_LINES :]]
    log.write_text("\n".join(tb + noise * 2) + "\n")
    assert demo.log_tail(log)[1] == (noise * 2)[-demo.LOG_TAIL_LINES :]


@pytest.mark.parametrize("cpu", [True, False])
def test_compare(tmp_path, capsys, cpu):
    """CPU (strict): equal tokens are a match, any difference a failure naming the first position; GPU: both
    shown, the difference explained, never a failure."""
    import argparse

    d = demo._Demo(argparse.Namespace(out=str(tmp_path), dtype="bf16", server_args=""))
    ref = {"prompt_ids": [1, 5, 6], "ids": [7, 8, 9, 2], "text": "", "eos": 2}
    same = {"ids": [7, 8, 9], "prompt_tokens": 3}  # SGLang left out the EOS it stopped on
    d._compare(same, ref, strict=cpu, cpu=cpu, log_path=tmp_path / "s.log")
    out = capsys.readouterr().out
    assert ("match: the server's 3 tokens equal" in out) if cpu else ("same 3 tokens as the reference" in out)
    other = {"ids": [7, 8, 4, 4], "prompt_tokens": 3}
    if cpu:
        with pytest.raises(demo.DemoFailed, match="MISMATCH: .* from token 2 on"):
            d._compare(other, ref, strict=True, cpu=True, log_path=tmp_path / "s.log")
    else:
        d._compare(other, ref, strict=False, cpu=False, log_path=tmp_path / "s.log")
        out = capsys.readouterr().out
        assert "agree on the first 2 of 4 tokens, then differ. Expected, not a failure" in out
        assert "fp8_e4m3 KV" in out and "sglang-ernie55 demo --cpu" in out
        assert "scored by" not in out  # no gaps given
        for gaps, warned in (([0.0, 0.0, 0.02, 0.3], False), ([0.0, 0.0, 2.5, 0.1], True)):
            d._compare(
                other, {**ref, "guess_gaps": gaps}, strict=False, cpu=False, log_path=tmp_path / "s.log"
            )
            out = capsys.readouterr().out
            assert "its top choice at 2 of 4 positions" in out
            assert ("WARNING: token 2 is 2.50 nats" in out) == warned
            assert f"at most {max(gaps):.3f} nats" in out
    with pytest.raises(demo.DemoFailed, match="read the prompt as 4 tokens"):
        d._compare({"ids": [7], "prompt_tokens": 4}, ref, strict=cpu, cpu=cpu, log_path=tmp_path / "s.log")


def test_progress_names_the_prefill_warm_up(tmp_path):
    """While the plugin's prefill warm-up compiles (tens of seconds on a fresh GPU machine), the progress line
    says so, not 'SGLang's warm-up request'; the markers are the warm-up module's own log lines."""
    import inspect

    from sglang_ernie55 import warmup

    src = inspect.getsource(warmup)
    assert '"ERNIE-5.5: prefill warm-up: %d prompt(s)' in src and '"ERNIE-5.5: prefill warm-up done in' in src
    log = tmp_path / "server.log"
    lines = [
        "[2026-12-07 13:33:40] Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)",
        "[2026-12-07 13:33:43] ERNIE-5.5: prefill warm-up: 1 prompt(s) of 34823 tokens, then 25 of 1 .. 8191 "
        "tokens (compiles the prefill kernels)",
        "[2026-12-07 13:34:19] ERNIE-5.5: prefill warm-up done in 36.0 s",
        "[2026-12-07 13:34:25] The server is fired up and ready to roll!",
    ]
    want = [
        "HTTP up, running SGLang's warm-up request",
        "prefill warm-up: compiling the prefill kernels per prompt length",
        "running SGLang's warm-up request",
        "ready",
    ]
    for i, expect in enumerate(want):
        log.write_text("\n".join(lines[: i + 1]) + "\n")
        assert demo._phase(log).startswith(expect), (i, demo._phase(log))
    # a skipped warm-up leaves the phase where it was
    log.write_text(lines[0] + "\n[x] ERNIE-5.5: prefill warm-up skipped: RuntimeError: no\n")
    assert demo._phase(log).startswith("HTTP up")
