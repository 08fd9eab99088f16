"""`sglang-ernie55 demo`: the README's main job, end to end on whatever machine this is."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HELP = "make a tiny ERNIE-5.5 checkpoint, serve it with SGLang and answer a completion (CPU: the part that can run)"

PROMPT = "Question: What is 15% of 240?\nAnswer:"


def configure(parser: argparse.ArgumentParser) -> None:
    """Make a tiny random ERNIE-5.5 checkpoint and serve it with SGLang.

    On a machine with a CUDA GPU: writes the checkpoint, starts `python -m sglang.launch_server`
    (the code path of `sglang serve`) on 127.0.0.1 with no flags but the model path (the plugin picks
    the `ernie55` backend, 256-token pages, SWA ratio 0.1 and FP8 KV by itself), sends one
    `/v1/completions` request with temperature 0, prints the answer next to the reference model's
    greedy tokens, and stops the server.

    On a machine without a GPU, SGLang cannot serve: the command says so, then does what can run:
    writes the checkpoint, resolves the server arguments SGLang would use for it (`--device cpu`) and
    prints the values the plugin chose, and runs the same prompt through the pure-PyTorch reference.

    The weights are random: the answer is random tokens, not "36".
    """
    parser.add_argument("--out", default="/tmp/ernie55-tiny-demo", help="checkpoint directory (overwritten)")
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="checkpoint weight format")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument("--port", type=int, default=0, help="server port (0 = a free one)")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds to wait for the server to start"
    )
    parser.add_argument("--cpu", action="store_true", help="do the CPU part even if a GPU is present")


def _say(msg: str) -> None:
    print(f"[ernie55-demo] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _reference_answer(ckpt: Path, max_tokens: int) -> tuple[list[int], str]:
    import torch
    from transformers import AutoTokenizer

    from ..checkpoint.loader import load_checkpoint
    from ..reference.model import build_reference

    config, state = load_checkpoint(ckpt)
    model = build_reference(config, seed=None)
    model.load_state_dict(state, strict=True)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    ids = torch.tensor(tok(PROMPT)["input_ids"])
    out = model.generate_greedy(ids, max_tokens, eos_id=config.eos_token_id)
    return out, tok.decode(out)


def _serve_and_ask(ckpt: Path, args: argparse.Namespace) -> int:
    port = args.port or _free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(ckpt), "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    _say("starting: " + " ".join(cmd))
    log = open(Path(args.out).with_suffix(".server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + args.timeout
        while True:
            if proc.poll() is not None:
                _say(f"the server exited with {proc.returncode}; its log: {log.name}")
                return 1
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() > deadline:
                _say(f"the server did not come up in {args.timeout:.0f} s; its log: {log.name}")
                return 1
            time.sleep(2)
        models = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=10).read())
        name = models["data"][0]["id"]
        body = {"model": name, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0}
        _say(f"POST /v1/completions {json.dumps(body)}")
        reply = _post(base + "/v1/completions", body)
        text = reply["choices"][0]["text"]
        _say(f"server answered: {text!r}")
        ref_ids, ref_text = _reference_answer(ckpt, args.max_tokens)
        _say(f"reference greedy: {ref_text!r}")
        _say("match" if text == ref_text else "differs from the reference (see docs/serving-design.md)")
        return 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _cpu_part(ckpt: Path, args: argparse.Namespace) -> int:
    from ..args import resolve_server_args

    sa = resolve_server_args(["--model-path", str(ckpt), "--device", "cpu"])
    resolved = sa.resolved_dict() if hasattr(sa, "resolved_dict") else vars(sa)
    keys = ("attention_backend", "page_size", "swa_full_tokens_ratio", "kv_cache_dtype")
    _say("server arguments SGLang resolves for this checkpoint (plugin defaults): "
         + ", ".join(f"{k}={resolved.get(k)!r}" for k in keys))  # fmt: skip
    ids, text = _reference_answer(ckpt, args.max_tokens)
    _say(f"reference model, greedy, prompt {PROMPT!r}: {text!r} (token ids {ids})")
    _say("CPU part done. On a GPU machine the same command serves the checkpoint with SGLang.")
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoint.tiny import make_checkpoint

    ckpt = Path(args.out)
    _say(f"writing a tiny random {args.dtype} checkpoint to {ckpt}")
    make_checkpoint(ckpt, preset="tiny", dtype=args.dtype, seed=args.seed, force=True)
    if torch.cuda.is_available() and not args.cpu:
        return _serve_and_ask(ckpt, args)
    reason = "--cpu was given" if args.cpu else "No CUDA GPU on this machine"
    _say(f"{reason}: SGLang cannot serve here, so no server is started. Doing the part that runs on CPU.")
    return _cpu_part(ckpt, args)
