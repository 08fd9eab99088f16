"""`sglang-ernie55 demo`: the README's main job. A tiny random ERNIE-5.5 checkpoint, SGLang's real server on
it (GPU: no flag but the model path; CPU: the few flags a CPU needs), one greedy `/v1/completions` request
and the reference model's greedy tokens beside the answer. Any failure ends in one message with the tail of
the server log and a non-zero exit status; Ctrl-C stops the server and exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..ports import free_port

HELP = "make a tiny ERNIE-5.5 checkpoint, serve it with SGLang (GPU, or CPU) and compare one completion"

PROMPT = "Question: What is 15% of 240?\nAnswer:"

# The CPU server's flags, each with why it is there (shown by --help). Everything else is SGLang's default
# on CPU, resolved by the plugin exactly as on a GPU (ernie55 backend, 256-token pages, SWA ratio 0.1);
# SGLang already turns CUDA graphs off and picks the pytorch sampler on CPU, so no flag says so.
CPU_SERVER_ARGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--device", "cpu"), "no CUDA GPU here (or --cpu): SGLang runs the model with torch on the CPU."),
    (
        ("--dtype", "float32"),
        "fp32 activations, the reference model's precision (`auto` would take the checkpoint's bf16), "
        "so the comparison with the reference is exact instead of within bf16 noise.",
    ),
    (
        ("--kv-cache-dtype", "bfloat16"),
        "the model's default KV cache is fp8_e4m3; a bf16 cache rounds each cached value by one bf16 "
        "cast, which the reference repeats exactly.",
    ),
    (
        ("--max-total-tokens", "8192"),
        "without it SGLang sizes the KV pool from free host memory (tens of millions of tokens: the "
        "scheduler is killed for memory). 8192 is a round size whose SWA part (10%, page-aligned: 768 "
        "tokens) still holds the HCA window (128) plus one 256-token page, as SGLang requires. SGLang admits "
        "a prefix-cache hit only with 4 SWA pages (the server log warns): for more than the demo's one request "
        "add --swa-full-tokens-ratio 0.125 or raise this.",
    ),
    (
        ("--max-running-requests", "4"),
        "per-request state is allocated for every request slot up front; SGLang's default of thousands "
        "of slots costs ~0.8 GB and ~12 s at start-up on CPU, and the demo sends one request.",
    ),
)

STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL: SGLang drains and exits in a few seconds when it obeys
PROGRESS_EVERY_S = 10.0  # a "still waiting" line this often while the server starts
LOG_TAIL_LINES = 20  # server log lines in a failure message (more when a traceback starts earlier)
LOG_TAIL_MAX = 60


def _cpu_flags_help() -> str:
    return "\n".join(
        textwrap.fill(why, 104, initial_indent=f"  {' '.join(flags):28s}  ", subsequent_indent=" " * 32)
        for flags, why in CPU_SERVER_ARGS
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="/tmp/ernie55-tiny-demo", help="checkpoint directory (overwritten)")
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="checkpoint weight format")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    parser.add_argument("--port", type=int, default=0, help="server port (default 0: a free one)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the server to answer (default 900; a cold GPU compiles kernels first)",
    )
    parser.add_argument("--cpu", action="store_true", help="serve on the CPU even if a CUDA GPU is present")
    parser.add_argument(
        "--server-args",
        default="",
        metavar="'ARGS'",
        help="extra flags appended to the server command, one quoted string (e.g. '--page-size 64' to see "
        "the plugin refuse it); the comparison is then shown, not checked",
    )


configure.__doc__ = f"""\
Make a tiny random ERNIE-5.5 checkpoint, serve it with SGLang's real server, ask it one question.

Steps (one progress line each, with elapsed seconds): write the checkpoint, start
`python -m sglang.launch_server` (the code path of `sglang serve`) on 127.0.0.1 and print the exact
command, wait for it (a line every {PROGRESS_EVERY_S:.0f} s), send one `/v1/completions` request with
temperature 0, stop the server, run the same prompt greedily through the pure-PyTorch reference model
(`sglang_ernie55.reference`) and compare token ids.

The weights are random: the answer is random tokens, not "36".

With a CUDA GPU: the server gets no flag but the model path, so the plugin picks the model's defaults
by itself (the `ernie55` backend, 256-token pages, SWA ratio 0.1, FP8 KV, the checkpoint's bf16
activations). The reference runs fp32 with unrounded K/V, so the two are printed side by side with
where they differ and why, not checked.

Without a CUDA GPU (or with --cpu): the same server on the CPU, with these flags and no others:
{_cpu_flags_help()}
The reference then rounds the K/V it caches to bf16 as that pool stores them, and the demo checks that
the server's tokens equal the reference's (exit status 1 if not).

Exit status: 0 done, 1 the server died, did not answer within --timeout, the request failed or (CPU)
the answer differs from the reference, 130 interrupted (Ctrl-C). A failure prints one message with the
last lines of the server log and its path (`<--out>.server.log`).

Examples:
  sglang-ernie55 demo
  sglang-ernie55 demo --cpu --max-tokens 8
  sglang-ernie55 demo --server-args '--kv-cache-dtype bfloat16'
"""


class DemoFailed(Exception):
    """A failure the user can act on: `str(self)` is the whole message (no traceback is shown)."""


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, msg: str) -> None:
        print(f"[ernie55-demo {self.elapsed():6.1f}s] {msg}", flush=True)


def _log_lines(path: Path) -> list[str]:
    """The log's lines as a terminal shows them: a progress bar's carriage returns keep only its last state."""
    try:
        text = path.read_bytes().decode(errors="replace")  # bytes: text mode would turn \r into \n
    except OSError:
        return []
    lines = (
        line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")
    )  # not splitlines: it splits at \r
    return [line for line in lines if line.strip()]


_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b.*")


def log_tail(path: Path) -> tuple[str | None, list[str]]:
    """(the last `SomethingError: ...` line or None, the lines worth showing). When the log's last
    traceback ended within LOG_TAIL_MAX lines of its end, it is the failure: shown from its first line
    (a long one as its first line, then its last frames and what follows); else the last LOG_TAIL_LINES."""
    lines = _log_lines(path)
    headline = next((ln.strip() for ln in reversed(lines) if _ERROR_LINE.match(ln.strip())), None)
    start = max(len(lines) - LOG_TAIL_LINES, 0)
    tb = [
        i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln
    ]  # SGLang prefixes some
    if not tb:
        return headline, lines[start:]
    t = tb[-1]
    end = next((i for i in range(t + 1, len(lines)) if not lines[i].startswith(" ")), len(lines) - 1)
    if len(lines) - end > LOG_TAIL_MAX:
        return headline, lines[start:]
    if len(lines) - t <= LOG_TAIL_MAX:
        return headline, lines[min(t, start) :]
    cut = min(start, end - 4)
    return headline, [lines[t], f"  ... ({cut - t - 1} lines left out)", *lines[cut:]]


# Milestones of SGLang's start-up log, in order: the latest one seen names what the server is doing.
_PHASES = (
    ("server_args=", "arguments resolved (the plugin's defaults applied); the scheduler process starts"),
    ("Load weight begin", "loading the weights"),
    ("Load weight end", "sizing and allocating the KV pool"),
    ("KV Cache is allocated", "setting up the scheduler"),
    ("Uvicorn running", "HTTP up, running SGLang's warm-up request"),
    # sglang_ernie55.warmup's log lines: its prompts run before SGLang's own warm-up request
    (
        "ERNIE-5.5: prefill warm-up:",
        "prefill warm-up: compiling the prefill kernels per prompt length (Triton caches them for later starts)",
    ),
    ("ERNIE-5.5: prefill warm-up done", "running SGLang's warm-up request"),
    ("fired up and ready", "ready"),
)


def _phase(path: Path) -> str:
    text = "\n".join(_log_lines(path))
    done = [name for marker, name in _PHASES if marker in text]
    return done[-1] if done else "importing SGLang and torch"


class Server:
    """`python -m sglang.launch_server ...` in its own process group, output to a log file."""

    def __init__(self, cmd: list[str], log_path: Path):
        self.cmd, self.log_path = cmd, log_path
        self._log = open(log_path, "w")
        self._log.write(shlex.join(cmd) + "\n")
        self._log.flush()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def how_it_ended(self) -> str:
        rc = self.proc.poll()
        if rc is None:
            return "is still running"
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            why = " (SGLang kills its own process tree when a subprocess fails; or out of memory)"
            return f"was killed by {name}" + (why if -rc == signal.SIGKILL else "")
        return f"exited with status {rc}"

    def _signal_group(self, sig: int) -> bool:
        """Signal every process left in the server's group; False when none is left (the group is gone:
        the server may already have killed its own tree)."""
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:  # a pid reused by someone else's process: not ours to signal
            return False

    def stop(self, grace: float | None = None) -> str:
        """Stop the server and anything it left in its group: SIGTERM, then SIGKILL after `grace` s
        (default STOP_GRACE_S). Returns what happened, for the progress line."""
        grace = STOP_GRACE_S if grace is None else grace
        # the server process may have exited and left its subprocesses in the group
        what = "stopped" if self.proc.poll() is None else "its leftover processes stopped"
        try:
            if not self._signal_group(signal.SIGTERM):
                self.proc.poll()
                return "already gone"
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.proc.poll()  # reaps the leader, so an empty group reads as gone
                if not self._signal_group(0):
                    return f"{what} (SIGTERM)"
                time.sleep(0.2)
            self._signal_group(signal.SIGKILL)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                return (
                    f"still running {grace:.0f} s after SIGTERM and 10 s after SIGKILL (pid {self.proc.pid})"
                )
            return f"still running {grace:.0f} s after SIGTERM: killed (SIGKILL)"
        finally:
            self._log.close()

    def failure(self, what: str, advice: str) -> DemoFailed:
        """One message: what happened, the log's last error line, its tail, the log path and what to do."""
        if not self._log.closed:
            self._log.flush()
        headline, tail = log_tail(self.log_path)
        parts = [what]
        if headline:
            parts.append(f"  error: {headline}")
        if tail:
            parts.append(f"  last lines of the server log {self.log_path}:")
            parts += [f"    | {ln}" for ln in tail]
        else:
            parts.append(f"  the server log {self.log_path} is empty.")
        parts.append(f"  {advice}")
        parts.append(f"  full server log: {self.log_path}")
        return DemoFailed("\n".join(parts))


def _http(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, str]:
    """(HTTP status, body text); status 0 when nothing answered (connection refused / reset / timeout)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, ""


def server_command(ckpt: Path, port: int, cpu: bool, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(ckpt)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if cpu:
        for flags, _why in CPU_SERVER_ARGS:
            cmd += flags
    return cmd + extra


def _wait_ready(server: Server, base: str, timeout: float, clock: _Clock) -> None:
    """Until /health_generate answers 200 (after SGLang's own warm-up generation), the server dies, or
    `timeout` s pass; a progress line every PROGRESS_EVERY_S."""
    clock.say(f"waiting for the server to answer GET {base}/health_generate (up to {timeout:.0f} s)")
    next_note = server.started + PROGRESS_EVERY_S
    while True:
        if not server.alive():
            raise server.failure(
                f"the SGLang server {server.how_it_ended()} {time.monotonic() - server.started:.0f} s after it "
                "started, before it was ready.",
                "The command above is exactly what ran: run it yourself to watch the error live.",
            )
        status, _ = _http("GET", base + "/health_generate", timeout=10)
        if status == 200:
            clock.say(f"server ready after {time.monotonic() - server.started:.1f} s")
            return
        now = time.monotonic()
        if now - server.started > timeout:
            raise server.failure(
                f"the SGLang server did not answer within --timeout {timeout:g} s (it is still running; "
                "stopped now).",
                "Raise --timeout if the log shows it still making progress (a cold GPU compiles kernels on "
                "the first start); otherwise the log's last lines show where it stuck.",
            )
        if now >= next_note:
            clock.say(f"  still starting, {now - server.started:.0f} s: {_phase(server.log_path)}")
            next_note += PROGRESS_EVERY_S
        time.sleep(1.0)


def _ask(server: Server, base: str, max_tokens: int, clock: _Clock) -> dict:
    status, text = _http("GET", base + "/v1/models")
    try:
        name = json.loads(text)["data"][0]["id"] if status == 200 else None
    except (ValueError, KeyError, IndexError):
        name = None
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    if name:
        body = {"model": name, **body}
    clock.say(f"POST {base}/v1/completions {json.dumps(body)}")
    t = time.monotonic()
    status, text = _http("POST", base + "/v1/completions", body, timeout=600)
    if status == 200:
        try:
            choice = json.loads(text)["choices"][0]
            out = {
                "text": choice["text"],
                "ids": list(choice["token_ids"]),
                "finish": choice["finish_reason"],
                "prompt_tokens": (json.loads(text).get("usage") or {}).get("prompt_tokens"),
            }
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise server.failure(
                f"the server answered /v1/completions with a body the demo cannot read ({e!r}): {text[:300]}",
                "Check that the server is SGLang 0.5.23 (sglang-ernie55 preflight).",
            ) from None
        out["seconds"] = time.monotonic() - t
        return out
    if status == 0 and not server.alive():
        raise server.failure(
            f"the SGLang server {server.how_it_ended()} while answering the request.",
            "The command above is exactly what ran: run it yourself and send the request to watch it fail.",
        )
    got = f"HTTP {status}: {text.strip()[:500]}" if status else "no answer (connection failed or timed out)"
    raise server.failure(
        f"the request POST /v1/completions failed: {got}",
        "The server log below shows the server's side of it.",
    )


def _bf16_kv_rounding():
    """The reference with the tensors a `--kv-cache-dtype bfloat16` pool stores (HCA window K/V and
    compressed entries; MLA latent, rope key and indexer key) rounded to bf16 as the pool stores them,
    queries and state fp32: what the CPU server computes with `--dtype float32`. The same rounding as the
    serving tests' oracle (tests/serving/server_harness.py kv_rounded_reference, checked equal in
    tests/test_demo.py)."""
    import contextlib

    import torch

    from ..reference import functional as Fn
    from ..reference import model as M

    rnd = lambda t: t.to(torch.bfloat16).float()

    @contextlib.contextmanager
    def ctx():
        saved = (M.HCAAttention.project, M.MLADSAAttention.project, Fn.hca_compress)
        hca_project, mla_project, compress = saved

        def hca(self_, x, pos):
            q, kv, c, s = hca_project(self_, x, pos)
            return q, rnd(kv), c, s

        def mla(self_, x, pos):
            q_nope, q_pe, latent, k_pe, q_idx, k_idx, w_idx = mla_project(self_, x, pos)
            return q_nope, q_pe, rnd(latent), rnd(k_pe), q_idx, rnd(k_idx), w_idx

        M.HCAAttention.project, M.MLADSAAttention.project = hca, mla
        Fn.hca_compress = lambda *a, **k: rnd(compress(*a, **k))
        try:
            yield
        finally:
            M.HCAAttention.project, M.MLADSAAttention.project, Fn.hca_compress = saved

    return ctx()


# nats by which the reference's choice may lead a GPU server's token (rounding of bf16 activations, fp8 KV,
# FP8 inputs) before the demo warns
SUSPECT_GAP = 1.0


def reference_greedy(ckpt: Path, max_tokens: int, round_kv_bf16: bool, guess: list[int] = ()) -> dict:
    """The reference model's greedy continuation of PROMPT (fp32), stopping after EOS:
    {"prompt_ids", "ids", "text", "eos"}. Whole-sequence forwards, so the K/V rounding reaches every cached
    tensor (the compressed HCA entries included). `guess` (the server's tokens) only saves time: one
    forward over prompt + guess gives the greedy token at every position, which is the reference's own
    continuation up to and including the first position where it disagrees; from there on it continues
    alone, one forward per token. With a guess, "guess_gaps" holds, for each guessed token, how many nats
    the reference's top choice leads it by at that position, given the guess's own prefix (0: its top choice)."""
    import contextlib

    import torch
    from transformers import PreTrainedTokenizerFast

    from ..checkpoint.loader import load_checkpoint
    from ..reference.model import build_reference

    config, state = load_checkpoint(ckpt, dtype=torch.float32)
    model = build_reference(config, seed=None)
    model.load_state_dict(state, strict=True)
    model = model.float().eval()
    tok = PreTrainedTokenizerFast.from_pretrained(str(ckpt))  # the tokenizer SGLang loads from the same files
    prompt_ids = list(tok(PROMPT)["input_ids"])
    eos, n = config.eos_token_id, len(prompt_ids)
    guess = list(guess)[:max_tokens]
    out: list[int] = []
    gaps: list[float] = []
    with _bf16_kv_rounding() if round_kv_bf16 else contextlib.nullcontext(), torch.no_grad():
        if guess:
            logits = model.forward(torch.tensor(prompt_ids + guess)).logits[n - 1 : n - 1 + len(guess)]
            lp = torch.log_softmax(logits.float(), -1)
            gaps = (lp.max(-1).values - lp[torch.arange(len(guess)), torch.tensor(guess)]).tolist()
            for want, got in zip(guess, logits.argmax(-1).tolist()):
                out.append(got)
                if got != want or got == eos:
                    break
        while len(out) < max_tokens and (not out or out[-1] != eos):
            out.append(int(torch.argmax(model.forward(torch.tensor(prompt_ids + out)).logits[-1])))
    ref = {"prompt_ids": prompt_ids, "ids": out, "text": tok.decode(out), "eos": eos}
    return {**ref, "guess_gaps": gaps} if guess else ref


def _strip_eos(ids: list[int], eos: int | None) -> list[int]:
    """SGLang may or may not list the EOS token it stopped on; compare what comes before it."""
    return ids[:-1] if ids and eos is not None and ids[-1] == eos else ids


class _Demo:
    def __init__(self, args: argparse.Namespace):
        self.args, self.clock, self.server = args, _Clock(), None

    def run(self) -> int:
        import torch

        from ..checkpoint.tiny import make_checkpoint

        args, say = self.args, self.clock.say
        extra = shlex.split(args.server_args)
        has_gpu = torch.cuda.is_available()
        cpu = args.cpu or not has_gpu
        ckpt = Path(args.out)
        say(f"writing a tiny random {args.dtype} ERNIE-5.5 checkpoint to {ckpt}")
        make_checkpoint(ckpt, preset="tiny", dtype=args.dtype, seed=args.seed, force=True)
        if cpu:
            why = "--cpu was given" if args.cpu else "no CUDA GPU on this machine"
            say(
                f"{why}: serving on the CPU with SGLang's real server (--help says why each CPU flag is there)"
            )
        else:
            say("CUDA GPU found: the server gets no flag but the model path (the plugin picks the defaults)")
        port = args.port or free_port()
        cmd = server_command(ckpt, port, cpu, extra)
        log_path = Path(str(ckpt) + ".server.log")
        say(f"starting the server: {shlex.join(cmd)}")
        say(f"server log: {log_path}")
        self.server = Server(cmd, log_path)
        base = f"http://127.0.0.1:{port}"
        _wait_ready(self.server, base, args.timeout, self.clock)
        for line in _log_lines(log_path):
            if "ERNIE-5.5 KV pool:" in line or "ernie55 attention backend:" in line:
                say("  server log: " + re.sub(r"^\[[^\]]*\] ", "", line))
        reply = _ask(self.server, base, args.max_tokens, self.clock)
        say(f"stopping the server: {self.server.stop()}")
        self.server = None

        strict = cpu and args.dtype == "bf16" and not extra
        say(
            "the reference model (fp32, "
            + ("K/V rounded to bf16 as the server's pool stores them" if strict else "unrounded K/V")
            + "): greedy tokens of the same prompt"
        )
        ref = reference_greedy(ckpt, args.max_tokens, round_kv_bf16=strict, guess=reply["ids"])
        print(
            "\nThe weights are random, so the answer below is random tokens, not an answer to the question.\n"
            f"  prompt:     {PROMPT!r} ({len(ref['prompt_ids'])} tokens)\n"
            f"  server:     {reply['text']!r}\n"
            f"              ids {reply['ids']} (finish: {reply['finish']}, {reply['seconds']:.1f} s)\n"
            f"  reference:  {ref['text']!r}\n"
            f"              ids {ref['ids']}\n",
            flush=True,
        )
        self._compare(reply, ref, strict, cpu, log_path)
        say(f"done in {self.clock.elapsed():.1f} s")
        return 0

    def _compare(self, reply: dict, ref: dict, strict: bool, cpu: bool, log_path: Path) -> None:
        say = self.clock.say
        if reply["prompt_tokens"] not in (None, len(ref["prompt_ids"])):
            raise DemoFailed(
                f"the server read the prompt as {reply['prompt_tokens']} tokens, the reference's tokenizer as "
                f"{len(ref['prompt_ids'])} ({self.args.out}/tokenizer.json): the answers cannot be compared."
            )
        a, b = _strip_eos(reply["ids"], ref["eos"]), _strip_eos(ref["ids"], ref["eos"])
        n = len(reply["ids"])
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if strict:
            how = (
                "token ids compared exactly: server --dtype float32 --kv-cache-dtype bfloat16, reference fp32 "
                "with the K/V it caches rounded to bf16"
            )
            if a != b:
                raise DemoFailed(
                    f"MISMATCH: the CPU server's tokens differ from the reference's from token {first_diff} on "
                    f"({how}). They are tested to be equal, so this is a bug: please report it with the "
                    f"server log {log_path}."
                )
            say(f"match: the server's {n} tokens equal the reference's greedy tokens ({how})")
        elif a == b:
            say(f"same {n} tokens as the reference, though not checked strictly: {self._why_loose(cpu)}")
        else:
            say(
                f"the server and the reference agree on the first {first_diff} of {n} tokens, then differ. "
                f"Expected, not a failure: {self._why_loose(cpu)}"
            )
            self._score(ref.get("guess_gaps") or [])

    def _score(self, gaps: list[float]) -> None:
        """The server's tokens scored by the reference on the server's own prefix: greedy continuations part
        at the first near-tie, but each token should still be the reference's choice or a near-tie."""
        if not gaps:
            return
        say = self.clock.say
        top = sum(g == 0.0 for g in gaps)
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        say(
            f"scored by the reference on the server's own tokens: its top choice at {top} of {len(gaps)} "
            f"positions; elsewhere its choice leads by at most {gaps[worst]:.3f} nats (token {worst})"
        )
        if gaps[worst] > SUSPECT_GAP:
            say(
                f"WARNING: token {worst} is {gaps[worst]:.2f} nats below the reference's choice, more than the "
                f"rounding explains on this tiny model (at most {SUSPECT_GAP} nats expected): please report it "
                "with the server log"
            )

    def _why_loose(self, cpu: bool) -> str:
        args = self.args
        if not cpu:
            why = (
                "the GPU server runs the model's defaults (fp8_e4m3 KV, the checkpoint's bf16 activations), the "
                "reference fp32 with unrounded K/V; with random weights the top two logits are often close, "
                "so rounding flips greedy choices"
            )
            if args.dtype != "bf16":
                why += "; an FP8 checkpoint's Linears also quantise their inputs to FP8 in the server"
        elif args.dtype != "bf16":
            why = (
                "an FP8 checkpoint's Linears quantise their inputs to FP8 in the server, not in the reference"
            )
        else:
            why = f"--server-args {args.server_args!r} changes the server the reference stands for"
        return why + ". For an exact comparison: sglang-ernie55 demo --cpu"

    def stop_server(self) -> None:
        if self.server is not None:
            self.clock.say(f"stopping the server: {self.server.stop()}")
            self.server = None


def run(args: argparse.Namespace) -> int:
    demo = _Demo(args)
    try:
        return demo.run()
    except DemoFailed as e:
        msg = str(e)
        if demo.server is not None:  # the message holds the log as it was; stop the server, then say so
            msg += f"\n  the server: {demo.server.stop()}"
            demo.server = None
        print(f"[ernie55-demo {demo.clock.elapsed():6.1f}s] FAILED: {msg}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan the server
        try:
            demo.clock.say("interrupted (Ctrl-C)")
            demo.stop_server()
        finally:
            signal.signal(signal.SIGINT, previous)
        return 130
    finally:
        demo.stop_server()
