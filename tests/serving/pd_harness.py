"""A prefill server and a decode server of SGLang's PD disaggregation on one machine, Mooncake over TCP on loopback
(tests/serving/test_pd_cpu.py), and SGLang's router in front of them.

`PDPair.generate` sends a request the way SGLang's PD router does, the same `/generate` body with
`bootstrap_host`, `bootstrap_port` (the prefill server's `--disaggregation-bootstrap-port`) and a fresh
`bootstrap_room` to both servers at once; the prefill server answers after its prefill, the decode server with the
generated tokens: what the decode server answers is then seen directly. `Router` starts SGLang's own router
(`python -m sglang_router.launch_router --pd-disaggregation`, the `pd` extra) over a pair.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from sglang_ernie55.ports import free_port
from tests.serving import server_harness as sh

SHIM = Path(__file__).parent / "pd_cpu_shim"
ECHO_SHIM = Path(__file__).parent / "pd_echo_shim"  # pd_cpu_shim + tests/echo/cpu_spec_shim
# Mooncake's transfer engine over TCP (no RDMA device here): SGLang reads MOONCAKE_PROTOCOL for the transport,
# and MC_FORCE_TCP=1 makes it pass no RDMA device name
MOONCAKE_TCP = {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"}


def mooncake_missing() -> str | None:
    """Why Mooncake's transfer engine cannot run here, or None."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        import torch

        if torch.cuda.is_available():
            how = (
                "on this CUDA machine install Mooncake's CUDA build (`pip install "
                "mooncake-transfer-engine-cuda13`; the `pd` extra's non-CUDA build cannot move GPU memory)"
            )
        else:
            how = (
                "on a machine without CUDA install this project's `pd` extra (`pip install -e '.[pd]'`: "
                "mooncake-transfer-engine-non-cuda)"
            )
        return (
            f"Mooncake's transfer engine does not import ({e}); {how}, and the RDMA verbs library it links "
            "(`apt-get install libibverbs1`)"
        )
    return None


ROUTER_VERSION = "0.3.2"  # the `pd` extra's pin (pyproject.toml)


def router_missing() -> str | None:
    """Why SGLang's router cannot run here, or None."""
    try:
        import sglang_router  # noqa: F401
    except ImportError as e:
        return (
            f"SGLang's router does not import ({e}); install it with `pip install sglang-router=={ROUTER_VERSION}` "
            "(or this project's `pd` extra: `pip install -e '.[pd]'`)"
        )
    return None


class PDPair:
    """A prefill and a decode server over one checkpoint, started together; `prefill_flags` / `decode_flags` and
    `decode_env` go to one role only."""

    def __init__(
        self,
        model_path,
        *flags: str,
        env: dict,
        log_name: str = "pd",
        prefill_flags=(),
        decode_flags=(),
        decode_env: dict | None = None,
        timeout: float = 900,
    ):
        self.bootstrap_port = free_port()
        self.model_path, self.flags, self.env, self.log_name, self.timeout = (
            model_path,
            flags,
            {**MOONCAKE_TCP, **env},
            log_name,
            timeout,
        )
        self.prefill_flags = prefill_flags
        self.prefill = self.decode = None
        self.prefill_port = free_port()  # kept by a restarted prefill server: a router knows its URL
        with ThreadPoolExecutor(2) as ex:
            p = ex.submit(self.start_prefill)
            d = ex.submit(
                sh.Server,
                model_path,
                *flags,
                *decode_flags,
                "--disaggregation-mode",
                "decode",
                "--disaggregation-transfer-backend",
                "mooncake",
                "--disaggregation-bootstrap-port",
                str(free_port()),
                log_name=f"{log_name}-decode",
                env={**self.env, **(decode_env or {})},
                timeout=timeout,
                ready_path="/health",
            )
            errors = []
            for name, f in (("prefill", p), ("decode", d)):
                try:
                    setattr(self, name, f.result())
                except Exception as e:  # stop the other one before raising
                    errors.append(f"{name}: {e}")
        if errors:
            self.stop()
            raise RuntimeError("\n".join(errors))
        self.startup_s = max(self.prefill.startup_s, self.decode.startup_s)

    def start_prefill(self) -> sh.Server:
        """A prefill server on this pair's bootstrap and HTTP ports (again after `kill_prefill` or a stop; a
        restarted one logs to its own file, `<log_name>-prefill-2.log`, ...)."""
        self.prefill_starts = getattr(self, "prefill_starts", 0) + 1
        n = self.prefill_starts
        self.prefill = sh.Server(
            self.model_path,
            *self.flags,
            *self.prefill_flags,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-transfer-backend",
            "mooncake",
            "--disaggregation-bootstrap-port",
            str(self.bootstrap_port),
            log_name=f"{self.log_name}-prefill" + (f"-{n}" if n > 1 else ""),
            env=self.env,
            timeout=self.timeout,
            ready_path="/health",
            port=self.prefill_port,
        )
        return self.prefill

    def kill_prefill(self) -> float:
        """SIGKILL the prefill server (its whole process group); returns the time of the kill."""
        t = time.time()
        self.prefill.kill()
        return t

    def stop(self) -> None:
        for s in (self.prefill, self.decode):
            if s is not None:
                s.stop()

    def body(self, prompt: list[int], max_new_tokens: int, room: int | None = None) -> dict:
        return dict(
            input_ids=prompt,
            sampling_params=dict(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True),
            return_logprob=True,
            bootstrap_host="127.0.0.1",
            bootstrap_port=self.bootstrap_port,
            bootstrap_room=random.randrange(2**62) if room is None else room,
        )

    def generate(self, prompt: list[int], max_new_tokens: int, meta: bool = False) -> dict:
        """One greedy request through both servers: the decode server's tokens and their logprobs (and its
        meta_info with `meta`)."""
        body = self.body(prompt, max_new_tokens)
        with ThreadPoolExecutor(2) as ex:
            futures = [
                ex.submit(requests.post, s.url + "/generate", json=body, timeout=900)
                for s in (self.prefill, self.decode)
            ]
            answers = [f.result() for f in futures]
        for name, r in zip(("prefill", "decode"), answers):
            if r.status_code != 200:
                server = self.prefill if name == "prefill" else self.decode
                raise RuntimeError(f"{name} /generate {r.status_code}: {r.text[:500]}\n{server.tail()}")
        out = answers[1].json()
        result = {
            "tokens": out["output_ids"],
            "logprobs": [lp for lp, _tok, _text in out["meta_info"]["output_token_logprobs"]],
        }
        if meta:
            result["meta"] = out["meta_info"]
        return result

    def generate_all(self, prompts: list[list[int]], max_new_tokens: int, workers: int = 8) -> list[dict]:
        with ThreadPoolExecutor(workers) as ex:
            return list(ex.map(lambda p: self.generate(p, max_new_tokens), prompts))


def loads(url: str) -> dict:
    """SGLang's load report of a server (/v1/loads)."""
    return requests.get(url + "/v1/loads", timeout=60).json()["loads"][0]


def wait_until(pred, timeout: float, what: str, poll: float = 1.0):
    t0 = time.time()
    while True:
        v = pred()
        if v:
            return v
        if time.time() - t0 > timeout:
            raise TimeoutError(f"{what} not within {timeout}s")
        time.sleep(poll)


class Router:
    """SGLang's router in PD mode over a pair (`python -m sglang_router.launch_router --pd-disaggregation --prefill
    URL BOOTSTRAP_PORT --decode URL`), on loopback; `flags` are added to its command line."""

    def __init__(self, pair: PDPair, *flags: str, log_name: str = "pd-router", timeout: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = pair.decode.log_path.with_name(f"{log_name}.log")
        self.cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--pd-disaggregation",
            "--prefill",
            pair.prefill.url,
            str(pair.bootstrap_port),
            "--decode",
            pair.decode.url,
            "--worker-startup-check-interval",
            "1",
            *flags,
        ]
        self._log = open(self.log_path, "w")
        self._log.write(" ".join(self.cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.tail()}")
            try:  # /health answers before the workers are registered; /readiness once they are
                if requests.get(self.url + "/readiness", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() - t0 > timeout:
                self.stop()
                raise TimeoutError(f"router not up after {timeout}s:\n{self.tail()}")
            time.sleep(0.5)
        self.startup_s = time.time() - t0

    def tail(self, n: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(re.sub(r"\x1b\[[0-9;]*m", "", line) for line in text.splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()
