"""Launch a real SGLang server (`python -m sglang.launch_server`, the code path of `sglang serve`) on a
checkpoint, send concurrent /v1/completions, and score the answers against the reference model.

Scoring is teacher-forced: the reference runs prompt + server tokens in one full-sequence forward, so
each generated position is compared on the same prefix (no divergence cascade).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch

from sglang_ernie55.ports import free_port

PROMPT_LENGTHS = (1, 19, 127, 128, 129, 255, 256, 257, 383, 513, 1000, 2100)


def mem_fraction(default: str) -> str:
    """`--mem-fraction-static` for a test server: SERVING_MEM_FRACTION overrides the test's default (the
    device scripts run several servers on one GPU at once and split its memory)."""
    return os.environ.get("SERVING_MEM_FRACTION", default)


def cpu_flags(**flags) -> list[str]:
    """The demo's CPU server flags (`cli.demo.CPU_SERVER_ARGS`, what a user's CPU server runs) with `flags` set
    or added: `max_total_tokens=1024` -> `--max-total-tokens 1024`, `disable_cuda_graph=True` -> the bare flag."""
    from sglang_ernie55.cli.demo import CPU_SERVER_ARGS

    args = {name: value for (name, value), _why in CPU_SERVER_ARGS}
    args.update({"--" + k.replace("_", "-"): v for k, v in flags.items()})
    out: list[str] = []
    for name, value in args.items():
        out += [name] if value is True else [name, str(value)]
    return out


def make_prompts(vocab: int, bos: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Random token prompts, BOS first; plus one that shares a 512-token (2-page) prefix with another."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        ids[0] = bos
        out.append(ids)
    base = next(p for p in out if len(p) >= 1000)
    out.append(base[:512] + torch.randint(3, vocab, (150,), generator=g).tolist())
    return out


def reap_group(pgid: int, timeout: float = 30) -> None:
    """SIGKILL every process left in process group `pgid` and wait until none is (zombies aside)."""
    t0 = time.time()
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        if time.time() - t0 > timeout:
            raise RuntimeError(f"processes of group {pgid} survive SIGKILL for {timeout}s")
        time.sleep(0.2)
        if not _group_alive(pgid):
            return


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process of group `pgid` remains (/proc; True where /proc is absent)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after the command: state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class Server:
    def __init__(
        self,
        model_path: str,
        *args: str,
        log_name: str = "server",
        device_args=(),
        timeout: float = 600,
        env: dict | None = None,
        cli: bool = False,
        ready_path: str = "/health_generate",
        port: int | None = None,
    ):
        """env: extra environment variables of the server process (e.g. SGLANG_ERNIE55_ATTN_IMPL); cli: start it
        as the user types it, `sglang serve` (where that launcher is on PATH); ready_path: the endpoint whose 200
        means ready (a PD server generates only with its peer: `/health`); port: the HTTP port (default: a free
        one; a restarted server takes its predecessor's, where a router knows it)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir = Path(os.environ.get("SERVING_LOG_DIR") or tempfile.mkdtemp())
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{log_name}.log"
        launcher = (
            ["sglang", "serve"]
            if cli and shutil.which("sglang")
            else [sys.executable, "-m", "sglang.launch_server"]
        )
        cmd = [
            *launcher,
            "--model-path",
            str(model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *device_args,
            *args,
        ]
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        self._log.write("".join(f"{k}={v} " for k, v in (env or {}).items()) + " ".join(cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                self._reap()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                r = requests.get(self.url + "/v1/models", timeout=5)
                if r.status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() - t0 > timeout:
                self.stop()
                raise TimeoutError(f"server not up after {timeout}s:\n{self.tail()}")
            time.sleep(2)
        self.model = r.json()["data"][0]["id"]
        # /v1/models answers before the warm-up request finishes; wait for the first real generation
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:  # the warm-up request crashed it
                self._reap()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(self.url + ready_path, timeout=60).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        self.startup_s = time.time() - t0

    def attention_impls(self) -> dict[str, str]:
        """What the `ernie55` backend logged it runs each layer kind on ({'hca': 'triton', ...})."""
        text = self.log_path.read_text(errors="replace")
        return {
            m[1]: m[2] for m in re.finditer(r"ernie55 attention backend: (\w+) layers run on (\w+)", text)
        }

    def layer_impl(self) -> str | None:
        """The model's logged SGLANG_ERNIE55_LAYER_IMPL (per-layer compute outside attention), None if absent."""
        text = self.log_path.read_text(errors="replace")
        m = re.search(r"ernie55 layer compute: SGLANG_ERNIE55_LAYER_IMPL=(\w+)", text)
        return m[1] if m else None

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL to the server's process group (HTTP server, scheduler, detokenizer): a machine that dies, no
        shutdown path runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self._reap()
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server's own process group (started above)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._reap()
        self._log.close()

    def _reap(self) -> None:
        """SIGKILL whatever of the server's process group outlived its launcher (a scheduler or DP rank after the
        launcher exited or was killed): left running, it would hold cores and memory through every later test."""
        reap_group(self.proc.pid)

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = dict(
            model=self.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=1,
            return_token_ids=True,
            ignore_eos=True,
        )
        r = requests.post(self.url + "/v1/completions", json=body, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions {r.status_code}: {r.text[:500]}\n{self.tail()}")
        ch = r.json()["choices"][0]
        return {"tokens": ch["token_ids"], "logprobs": ch["logprobs"]["token_logprobs"]}

    def generate_and_abort(
        self, prompt: list[int], max_tokens: int, rid: str, abort_when, timeout: float = 300
    ):
        """A native /generate request (greedy), aborted through /abort_request as soon as `abort_when(log
        text)` holds (polled); returns its JSON answer (finish_reason `abort` when the abort landed
        mid-generation)."""
        body = dict(
            input_ids=prompt,
            rid=rid,
            sampling_params=dict(max_new_tokens=max_tokens, temperature=0, ignore_eos=True),
        )
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(requests.post, self.url + "/generate", json=body, timeout=600)
            t0 = time.time()
            while not fut.done() and time.time() - t0 < timeout:
                self._log.flush()
                if abort_when(self.log_path.read_text(errors="replace")):
                    break
                time.sleep(0.2)
            requests.post(self.url + "/abort_request", json={"rid": rid}, timeout=60)
            r = fut.result()
        return r.json()

    def complete_all(self, prompts: list[list[int]], max_tokens: int, workers: int = 16) -> list[dict]:
        with ThreadPoolExecutor(workers) as ex:
            return list(ex.map(lambda p: self.complete(p, max_tokens), prompts))


@dataclass
class Score:
    n_prompts: int = 0
    positions: int = 0
    top1: int = 0
    first_token: int = 0
    near_top1: int = 0  # server token within `eps` of the reference max logprob (near-ties)
    worst_gap: float = 0.0  # max over positions of (reference max logprob - logprob of the server's token)
    max_lp_err: float = 0.0
    mean_lp_err: float = 0.0
    mismatches: list = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"prompts {self.n_prompts}, positions {self.positions}: top-1 {self.top1}/{self.positions} "
            f"({self.top1 / max(self.positions, 1):.4f}), first token {self.first_token}/{self.n_prompts}, "
            f"near-top-1 {self.near_top1}/{self.positions}, worst top-1 gap {self.worst_gap:.4f}, "
            f"logprob |err| max {self.max_lp_err:.4f} "
            f"mean {self.mean_lp_err:.4f}"
        )


@torch.no_grad()
def score(ref, prompts, outs, device, eps: float = 0.05) -> Score:
    s = Score()
    errs = []
    for p, o in zip(prompts, outs):
        toks = o["tokens"]
        seq = torch.tensor(p + toks, device=device)
        logits = ref.forward(seq).logits[len(p) - 1 : len(p) - 1 + len(toks)].float()
        lp = torch.log_softmax(logits, -1)
        t = torch.tensor(toks, device=device)
        ref_top = lp.argmax(-1)
        chosen = lp.gather(1, t[:, None])[:, 0]
        s.n_prompts += 1
        s.positions += len(toks)
        agree = ref_top == t
        s.top1 += int(agree.sum())
        s.first_token += int(agree[0])
        gaps = lp.max(-1).values - chosen
        s.near_top1 += int((gaps <= eps).sum())
        s.worst_gap = max(s.worst_gap, float(gaps.max()))
        err = (torch.tensor(o["logprobs"], device=device) - chosen).abs()
        errs.append(err)
        if not bool(agree.all()):
            i = int((~agree).nonzero()[0])
            s.mismatches.append(
                {
                    "prompt_len": len(p),
                    "pos": i,
                    "server": toks[i],
                    "ref": int(ref_top[i]),
                    "gap": float(lp[i].max() - chosen[i]),
                }
            )
    e = torch.cat(errs)
    s.max_lp_err, s.mean_lp_err = float(e.max()), float(e.mean())
    return s


def _device_safe_visible_mask(q_pos, kv_pos, n_cmp: int, window: int, ratio: int):
    """reference.functional.hca_visible_mask with its compressed-index arange on q_pos's device (the
    reference builds it on the CPU, which fails for CUDA inputs); same values."""
    d = q_pos[:, None] - kv_pos[None, :]
    j = torch.arange(n_cmp, device=q_pos.device)
    return (d >= 0) & (d < window), j[None, :] < ((q_pos + 1) // ratio)[:, None]


def load_reference(path, device):
    from sglang_ernie55.checkpoint.loader import load_checkpoint
    from sglang_ernie55.reference import functional as Fn
    from sglang_ernie55.reference.model import build_reference

    if device != "cpu":
        Fn.hca_visible_mask = _device_safe_visible_mask

    cfg, sd = load_checkpoint(path, dtype=torch.float32)
    ref = build_reference(cfg, seed=None)
    ref.load_state_dict(sd)
    return cfg, ref.float().to(device).eval()


def write_report(name: str, data) -> None:
    d = os.environ.get("SERVING_LOG_DIR")
    if d:
        with open(Path(d) / "serving-results.jsonl", "a") as f:
            f.write(json.dumps({"test": name, **data}) + "\n")


def kv_codec(kv_dtype: str, cfg):
    """Functions that round tensors exactly as the serving pool stores them (write + read back through the
    pool's byte layout, `reference.kernels_ref`): {"hca": [n, head_dim], "mla": ([n, r], [n, dr]),
    "idx": [n, index_head_dim]} -> fp32. bf16 KV rounds every value to bf16; fp8_e4m3 KV goes through the
    fp8 layouts (HCA: SGLang's V4 layout, MLA: FlashMLA's V3.2, indexer: IDX_FP8) with their scales."""
    from sglang_ernie55.kernels import torch_twin as kref
    from sglang_ernie55.kernels.layout import hca_geometry, idx_geometry, mla_geometry

    def through(geom, x):
        n = x.shape[0]
        pool = geom.alloc(-(-max(n, 1) // geom.page_size), device=x.device)
        slots = torch.arange(n, device=x.device)
        kref.pool_store(pool, geom, slots, x.float().contiguous())
        return kref.pool_gather(pool, geom, slots)

    c = cfg
    g_hca = hca_geometry(kv_dtype, c.head_dim, c.qk_rope_head_dim, 256)
    g_mla = mla_geometry(kv_dtype, c.kv_lora_rank, c.qk_rope_head_dim, 256)
    g_idx = idx_geometry(kv_dtype, c.index_head_dim, 256)

    def mla(latent, k_pe):
        y = through(
            g_mla, torch.cat([latent.reshape(-1, latent.shape[-1]), k_pe.reshape(-1, k_pe.shape[-1])], -1)
        )
        return y[:, : latent.shape[-1]].view(latent.shape), y[:, latent.shape[-1] :].view(k_pe.shape)

    return {
        "hca": lambda x: through(g_hca, x.reshape(-1, x.shape[-1])).view(x.shape),
        "mla": mla,
        "idx": lambda x: through(g_idx, x.reshape(-1, x.shape[-1])).view(x.shape),
    }


class kv_rounded_reference:
    """Context manager: the reference with exactly the tensors the serving pool stores rounded as the pool
    stores them (HCA window kv and compressed entries; MLA latent, k_pe and indexer keys), queries and
    state in fp32. `kv_dtype` "bfloat16" (plain bf16 rounding) or "fp8_e4m3" (the fp8 byte layouts, `cfg`
    needed for their widths).

    This is the oracle for a KV dtype: the serving cache holds these values, and with index_topk < sequence
    length a rounding-level change of a key can flip a near-tie in the DSA top-k.

    `queries=True` (the backend's kernel path) also rounds to bf16 the query-side tensors the kernels read
    in bf16: the HCA query, the MLA rope query and the indexer query (whose rounding decides DSA top-k
    near-ties). The kernels' other roundings (the absorbed MLA query q_nope W_uk, which the reference's
    expanded form does not have; bf16 MMA operands on the GPU) stay as tolerance."""

    def __init__(self, kv_dtype: str = "bfloat16", cfg=None, queries: bool = False):
        if kv_dtype not in ("bfloat16", "fp8_e4m3"):
            raise ValueError(f"kv_dtype must be bfloat16 or fp8_e4m3, got {kv_dtype!r}")
        if kv_dtype == "fp8_e4m3" and cfg is None:
            raise ValueError("fp8_e4m3 rounding needs the model config (layout widths)")
        self.kv_dtype, self.cfg, self.queries = kv_dtype, cfg, queries

    def __enter__(self):
        from sglang_ernie55.reference import functional as Fn
        from sglang_ernie55.reference import model as M

        if self.kv_dtype == "bfloat16":
            rnd = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
            codec = {"hca": rnd, "idx": rnd, "mla": lambda a, b: (rnd(a), rnd(b))}
        else:
            codec = kv_codec(self.kv_dtype, self.cfg)
        rq = (lambda t: t.to(torch.bfloat16).float()) if self.queries else (lambda t: t)  # noqa: E731
        self._saved = (M.HCAAttention.project, M.MLADSAAttention.project, Fn.hca_compress)
        hca_project, mla_project, compress = self._saved

        def hca(self_, x, pos):
            q, kv, c, s = hca_project(self_, x, pos)
            return rq(q), codec["hca"](kv), c, s

        def mla(self_, x, pos):
            q_nope, q_pe, latent, k_pe, q_idx, k_idx, w_idx = mla_project(self_, x, pos)
            latent, k_pe = codec["mla"](latent, k_pe)
            return q_nope, rq(q_pe), latent, k_pe, rq(q_idx), codec["idx"](k_idx), w_idx

        M.HCAAttention.project, M.MLADSAAttention.project = hca, mla
        Fn.hca_compress = lambda *a, **k: codec["hca"](compress(*a, **k))
        return self

    def __exit__(self, *exc):
        from sglang_ernie55.reference import functional as Fn
        from sglang_ernie55.reference import model as M

        M.HCAAttention.project, M.MLADSAAttention.project, Fn.hca_compress = self._saved
        return False


FP8_GROUP = 128


def fp8_act_quant(x: torch.Tensor) -> torch.Tensor:
    """What SGLang's FP8 block Linear does to its input before the GEMM (per_token_group_quant_fp8, JIT
    kernel `per_token_group_quant.cuh`: groups of 128 along the last dim, amax floored at 1e-10, e4m3
    value = saturate(x * (448 / amax)), dequant scale = amax * (1/448)), returned dequantised in fp32."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // FP8_GROUP, FP8_GROUP)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-10)
    q = (g * (448.0 / amax)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * (amax * (1.0 / 448.0))).reshape(shape)


def fp8_served_linears(ref, cfg) -> dict[str, object]:
    """The reference's Linear modules that the SGLang model serves with SGLang's FP8 block method (and so
    with dynamic per-token-group FP8 activations), by the model's own policy (layers/linear.py
    `fp8_block_ok`, TP 1) and its explicit exceptions: grouped `wo_a` and absorbed `kv_b_proj`
    (dequantised on load), `weights_proj`, routers, `lm_head` and `echo.*` (never FP8), routed experts
    unless FusedMoE takes them in FP8 (both widths multiples of 128). Checked against the SGLang model's
    quant methods by tests/serving/test_fp8_oracle_cpu.py."""
    import torch.nn as nn

    from sglang_ernie55.layers.linear import fp8_block_ok

    never = ("wo_a", "kv_b_proj", "weights_proj", "lm_head")
    experts_fp8 = cfg.moe_intermediate_size % FP8_GROUP == 0 and cfg.moe_latent_size % FP8_GROUP == 0
    out = {}
    for name, m in ref.named_modules():
        if not isinstance(m, nn.Linear) or name.startswith("echo.") or ".routers." in name:
            continue
        if name.rsplit(".", 1)[-1] in never or (".experts." in name and not experts_fp8):
            continue
        if fp8_block_ok(m.in_features, m.out_features):
            out[name] = m
    return out


class fp8_activation_reference:
    """Context manager: the reference with every FP8-served Linear's input quantised as SGLang quantises it
    (`fp8_act_quant`); weights are the checkpoint's dequantised FP8 weights already (the loader). This is
    the oracle for an FP8 checkpoint: same math, rounded where the server rounds."""

    def __init__(self, ref, cfg):
        self.ids = {id(m) for m in fp8_served_linears(ref, cfg).values()}

    def __enter__(self):
        import torch.nn.functional as F

        from sglang_ernie55.reference import model as M

        ids = self.ids
        self._saved = (M.lin, M.SwiGLU.forward)
        lin, swiglu_fwd = self._saved

        def q_lin(x, layer):
            return lin(fp8_act_quant(x) if id(layer) in ids else x, layer)

        def q_swiglu(self_, x):
            g, u, d = self_.gate_proj, self_.up_proj, self_.down_proj
            if not ({id(g), id(u), id(d)} & ids):
                return swiglu_fwd(self_, x)
            h = F.silu(q_lin(x, g)) * q_lin(x, u)
            return q_lin(h, d)

        M.lin, M.SwiGLU.forward = q_lin, q_swiglu
        return self

    def __exit__(self, *exc):
        from sglang_ernie55.reference import model as M

        M.lin, M.SwiGLU.forward = self._saved
        return False


@torch.no_grad()
def fp8_noise_floor(ref, cfg, prompts, outs, device, act_dtype: torch.dtype = torch.float16) -> dict:
    """How far the FP8 oracle moves under the server's own activation rounding: the oracle (fp8 KV codec,
    FP8 activation quantisation, bf16 queries) against the same oracle whose FP8-served Linear inputs are first
    rounded to fp16 (what `--dtype float16` does to them before SGLang quantises them), teacher-forced over the
    server's sequences. FP8 quantisation steps are 6% apart, so a rounding-level change of an input moves some
    codes by a whole step, and the random tiny model amplifies that: this is the agreement an exact server
    could reach against the fp32 oracle. Returns top1 (fraction of positions where both argmaxes agree),
    first_token (same, position 0 only) and mean_lp (mean |logprob difference| of the server's tokens)."""
    global fp8_act_quant

    def tops():
        out = []
        with kv_rounded_reference("fp8_e4m3", cfg, queries=True), fp8_activation_reference(ref, cfg):
            for p, o in zip(prompts, outs):
                toks = o["tokens"]
                lg = ref.forward(torch.tensor(p + toks, device=device)).logits[
                    len(p) - 1 : len(p) - 1 + len(toks)
                ]
                out.append(torch.log_softmax(lg.float(), -1))
        return out

    base = tops()
    exact = fp8_act_quant
    fp8_act_quant = lambda x: exact(x.to(act_dtype).float())  # noqa: E731
    try:
        pert = tops()
    finally:
        fp8_act_quant = exact
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)) for a, b in zip(base, pert)]).float()
    first = sum(int(a[0].argmax() == b[0].argmax()) for a, b in zip(base, pert)) / len(base)
    lp = torch.cat(
        [
            (a - b).gather(1, torch.tensor(o["tokens"], device=device)[:, None])[:, 0].abs()
            for a, b, o in zip(base, pert, outs)
        ]
    )
    return {"top1": float(agree.mean()), "first_token": first, "mean_lp": float(lp.mean())}
