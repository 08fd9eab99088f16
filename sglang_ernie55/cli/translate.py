"""`sglang-ernie55 translate`: turn a vLLM (+ vLLM-ERNIE plugin) launch command into the SGLang one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

HELP = "translate a `vllm serve` command (vLLM-ERNIE plugin) into `sglang serve`, with a note per changed meaning"

VLLM_DEFAULT_PORT = 8000
SGLANG_DEFAULT_PORT = 30000
ECHO_STEPS = (1, 2, 3)
ECHO_METHODS = ("mtp", "ernie_mtp", "ernie5_mtp", "echo", "eagle", "deepseek_mtp")


class TranslateError(ValueError):
    pass


@dataclasses.dataclass
class Translation:
    argv: list[str] = dataclasses.field(default_factory=list)  # after `sglang serve`
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    router: list[str] | None = None  # a translated PD router command, when the input was one

    def add(self, *argv: object) -> None:
        self.argv += [str(a) for a in argv]

    def has(self, flag: str) -> bool:
        return flag in self.argv

    def value(self, flag: str) -> str | None:
        return self.argv[self.argv.index(flag) + 1] if flag in self.argv else None

    def set(self, flag: str, value: object) -> None:
        if flag in self.argv:
            self.argv[self.argv.index(flag) + 1] = str(value)
        else:
            self.add(flag, value)

    @property
    def command(self) -> str:
        if self.router is not None:
            return shlex.join(self.router)
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*env, "sglang", "serve", *map(shlex.quote, self.argv)])


# vLLM flag -> SGLang flag, same value and same meaning.
SAME = {
    "--served-model-name": "--served-model-name",
    "--host": "--host",
    "--api-key": "--api-key",
    "--tokenizer": "--tokenizer-path",
    "--revision": "--revision",
    "--download-dir": "--download-dir",
    "--dtype": "--dtype",
    "--seed": "--random-seed",
    "--load-format": "--load-format",
    "--chat-template": "--chat-template",
    "--ssl-keyfile": "--ssl-keyfile",
    "--ssl-certfile": "--ssl-certfile",
}
SAME_BOOL = {"--trust-remote-code": "--trust-remote-code"}

# Flags vLLM knows that change nothing SGLang needs told: dropped, with the reason.
DROPPED_BOOL = {
    "--enable-prefix-caching": "SGLang's radix prefix cache is on by default",
    "--disable-log-requests": "SGLang does not log requests unless --log-requests",
    "--enable-log-requests": "use SGLang's --log-requests if you want request logs",
    "--disable-log-stats": "SGLang logs throughput stats at its own interval",
    "--enable-chunked-prefill": "SGLang chunks prefills by default (--chunked-prefill-size)",
    "--enable-auto-tool-choice": "SGLang has no such switch; tool calls follow --tool-call-parser",
}
DROPPED_VALUE = {
    "--uvicorn-log-level": "SGLang: --log-level-http",
    "--block-size": "the model sets --page-size 256 itself (every page holds 2 compressed HCA entries)",
    "--compilation-config": "vLLM's torch.compile settings; SGLang uses CUDA graphs (--cuda-graph-max-bs-decode)",
    "-O": "vLLM's compilation level; SGLang uses CUDA graphs",
    "--max-num-partial-prefills": "vLLM scheduler detail; no SGLang counterpart needed",
}

# Flags of the SGLang command line that a vLLM command cannot contain.
SGLANG_ONLY = (
    "--attn-dp-size",
    "--attn-cp-size",
    "--page-size",
    "--hicache-ratio",
    "--enable-dp-lm-head",
    "--moe-a2a-backend",
    "--tp",
    "--tp-size",
    "--ep",
    "--ep-size",
    "--model-path",
    "--context-length",
    "--max-running-requests",
    "--mem-fraction-static",
)

SHORT = {
    "-tp": "--tensor-parallel-size",
    "-dp": "--data-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-q": "--quantization",
    "-ep": "--enable-expert-parallel",
}
BOOL_FLAGS = {
    "--enable-expert-parallel",
    "--trust-remote-code",
    "--enforce-eager",
    "--no-enable-prefix-caching",
    "--headless",
    *DROPPED_BOOL,
}
MULTINODE = (
    "--data-parallel-size-local",
    "--data-parallel-address",
    "--data-parallel-rpc-port",
    "--data-parallel-start-rank",
    "--headless",
    "--data-parallel-hybrid-lb",
    "--data-parallel-external-lb",
)


def _split(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """A single quoted command is split with shlex; leading NAME=value words are the environment."""
    if len(argv) == 1 and " " in argv[0]:
        argv = shlex.split(argv[0])
    env: dict[str, str] = {}
    while argv and "=" in argv[0] and not argv[0].startswith("-") and argv[0].split("=", 1)[0].isidentifier():
        k, v = argv[0].split("=", 1)
        env[k] = v
        argv = argv[1:]
    return env, argv


def _tokens(args: list[str], t: Translation) -> list[tuple[str, str | None]]:
    """(flag, value) pairs; positionals come as ("", value). Underscores in names read as dashes (vLLM does)."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("-") or a == "-":
            out.append(("", a))
            i += 1
            continue
        name, eq, val = a.partition("=")
        name = SHORT.get(name, name)
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        if eq:
            out.append((name, val))
            i += 1
        elif (
            name in BOOL_FLAGS
            or name.startswith("--no-")
            or i + 1 == len(args)
            or args[i + 1].startswith("--")
        ):
            out.append((name, None))
            i += 1
        else:
            out.append((name, args[i + 1]))
            i += 2
    return out


def _is_base(model: str) -> bool:
    return "base" in model.lower()


def _speculative(raw: str, t: Translation) -> None:
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        t.errors.append(f"--speculative-config {raw!r}: not JSON ({e})")
        return
    method = str(cfg.get("method", "")).lower()
    k = cfg.get("num_speculative_tokens")
    if "dspark" in method:
        t.errors.append(
            "--speculative-config method dspark: DSpark exists only for the unreleased post-trained model, "
            "not for ERNIE-5.5-Flash-Base (use ECHO: method mtp)"
        )
        return
    if method not in ECHO_METHODS:
        t.errors.append(
            f"--speculative-config method {method!r}: no SGLang equivalent for ERNIE-5.5 (ECHO is method mtp)"
        )
        return
    if k not in ECHO_STEPS:
        t.errors.append(f"--speculative-config num_speculative_tokens {k!r}: ECHO runs 1, 2 or 3 steps")
        return
    if cfg.get("draft_tensor_parallel_size") not in (None, 1) or cfg.get("model"):
        t.notes.append(
            "--speculative-config: draft model / draft TP ignored: ECHO lives in the checkpoint and runs at the target's TP"
        )
    t.add(*echo_server_flags(k))
    t.notes.append(
        f"--speculative-config {{method: {method}, num_speculative_tokens: {k}}} -> ECHO with "
        f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}: vLLM counts "
        f"draft tokens, SGLang counts steps; its draft-token count includes the verified token (steps + 1). "
        f"Copying {k} into --speculative-num-draft-tokens would silently draft one token less. Chain drafts only (topk 1)."
    )


def echo_server_flags(steps: int) -> tuple[str, ...]:
    """SGLang's flags for ECHO as a chain of `steps` draft tokens: EAGLE, top-k 1, and steps + 1 draft tokens
    (SGLang's draft-token count includes the verified token)."""
    return (
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(steps + 1),
    )


def _kv_transfer(raw: str, t: Translation) -> None:
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        t.errors.append(f"--kv-transfer-config {raw!r}: not JSON ({e})")
        return
    conn = str(cfg.get("kv_connector", ""))
    role = str(cfg.get("kv_role", ""))
    extra = cfg.get("kv_connector_extra_config") or {}
    if "Offload" in conn:
        t.add("--enable-hierarchical-cache", "--hicache-ratio", 2)
        size = next((v for k, v in extra.items() if "bytes" in k or "size" in k), None)
        t.notes.append(
            f"--kv-transfer-config {conn} -> --enable-hierarchical-cache --hicache-ratio 2: vLLM sizes the CPU "
            f"pool in bytes per rank{f' ({size})' if size is not None else ''}, SGLang as a ratio of the GPU KV pool "
            "(2 = twice the GPU pool in host RAM; --hicache-size is not supported for this model). Size it with "
            "`sglang-ernie55 plan` (KV pool per GPU x ratio = host bytes per GPU)."
        )
    elif "Mooncake" in conn:
        modes = {"kv_producer": "prefill", "kv_consumer": "decode"}
        if role not in modes:
            t.errors.append(
                f"--kv-transfer-config {conn} kv_role {role!r}: SGLang PD needs a prefill (kv_producer) or decode (kv_consumer) server"
            )
            return
        t.add("--disaggregation-mode", modes[role], "--disaggregation-transfer-backend", "mooncake")
        t.notes.append(
            f"--kv-transfer-config {conn} ({role}) -> --disaggregation-mode {modes[role]} "
            "--disaggregation-transfer-backend mooncake (install mooncake-transfer-engine-cuda13). Route with SGLang's "
            "router (`python -m sglang_router.launch_router --pd-disaggregation --prefill URL --decode URL`), not "
            "vllm-router. Under PD a request with n > 1 hangs (its sub-requests share one bootstrap room): this plugin "
            "rejects n > 1. The `model` field must equal the served name, or the request fails mid-stream."
        )
    else:
        t.errors.append(f"--kv-transfer-config connector {conn!r}: no SGLang equivalent known")


def translate_router(args: list[str]) -> Translation:
    """`vllm-router ...` (a fork of SGLang's router) -> `python -m sglang_router.launch_router ...`."""
    t = Translation()
    out = ["python", "-m", "sglang_router.launch_router"]
    rest = list(args)
    if "--pd-disaggregation" not in rest:
        out.append("--pd-disaggregation")
    out += rest
    t.router = out
    t.notes.append(
        "vllm-router -> SGLang's router (pip install sglang-router): same --prefill URL [BOOTSTRAP_PORT] / "
        "--decode URL form; point the URLs at the SGLang servers (port 30000 unless --port) and use each prefill "
        "server's --disaggregation-bootstrap-port. Requests with n > 1 are rejected under PD."
    )
    return t


def translate(argv: list[str]) -> Translation:
    """Translate a vLLM launch command (list of words, or one quoted string) into SGLang's."""
    env, args = _split(list(argv))
    t = Translation()
    if args[:1] == ["vllm-router"]:
        return translate_router(args[1:])
    if args[:2] == ["vllm", "serve"]:
        args = args[2:]
    elif args[:3] in (
        ["python", "-m", "vllm.entrypoints.openai.api_server"],
        ["python3", "-m", "vllm.entrypoints.openai.api_server"],
    ):
        args = args[3:]
    elif args[:1] == ["sglang"] or args[:3] == ["python", "-m", "sglang.launch_server"]:
        raise TranslateError("this is already an SGLang command")
    else:
        raise TranslateError(f"expected `vllm serve MODEL ...`, got {shlex.join(args[:3])!r}")

    for k, v in env.items():
        if k == "VLLM_PLUGINS":
            t.notes.append(
                f"{k}={v}: dropped. SGLang loads this plugin through its `sglang.srt.plugins` entry point `ernie55`; "
                "if you set SGLANG_PLUGINS to restrict plugins, it must include ernie55"
            )
        elif k == "VLLM_USE_MODELSCOPE":
            t.env["SGLANG_USE_MODELSCOPE"] = v
            t.notes.append(f"{k}={v} -> SGLANG_USE_MODELSCOPE={v}")
        elif k.startswith("VLLM_"):
            t.errors.append(f"environment {k}={v}: a vLLM setting with no SGLang equivalent known")
        else:
            t.env[k] = v

    model = None
    tp, dp, pp, ep_flag = 1, 1, 1, False
    kv_dtype = None
    port = None
    seen_parsers = []
    for flag, val in _tokens(args, t):
        if flag == "":
            if model is None:
                model = val
            else:
                t.errors.append(f"unexpected argument {val!r}")
        elif flag == "--model":
            model = val
        elif flag == "--port":
            port = val
        elif flag == "--tensor-parallel-size":
            tp = int(val)
        elif flag == "--data-parallel-size":
            dp = int(val)
        elif flag == "--pipeline-parallel-size":
            pp = int(val)
        elif flag == "--enable-expert-parallel":
            ep_flag = True
        elif flag == "--max-model-len":
            t.add("--context-length", val)
            t.notes.append(f"--max-model-len {val} -> --context-length {val}")
        elif flag == "--max-num-seqs":
            t.add("--max-running-requests", val)
            t.notes.append(f"--max-num-seqs {val} -> --max-running-requests {val}")
        elif flag == "--max-num-batched-tokens":
            t.add("--chunked-prefill-size", val)
            t.notes.append(
                f"--max-num-batched-tokens {val} -> --chunked-prefill-size {val}: SGLang's limit is per prefill "
                "chunk, not per engine step (decode tokens are not counted in it)"
            )
        elif flag == "--kv-cache-dtype":
            kv_dtype = val
        elif flag in ("--reasoning-parser", "--tool-call-parser"):
            seen_parsers.append((flag, val))
        elif flag == "--speculative-config":
            _speculative(val or "", t)
        elif flag == "--kv-transfer-config":
            _kv_transfer(val or "", t)
        elif flag == "--moe-backend":
            if val == "humming":
                t.notes.append(
                    "--moe-backend humming: dropped. A vLLM-only MoE kernel (Blackwell FP8; vLLM itself drops it on "
                    "Hopper); SGLang picks its MoE runner by itself (--moe-runner-backend). Not SGLang's "
                    "`--quantization humming`, which is a different thing."
                )
            else:
                t.errors.append(
                    f"--moe-backend {val}: vLLM's MoE kernel choice has no SGLang equivalent; remove it"
                )
        elif flag == "--all2all-backend":
            if val and val.startswith("deepep"):
                mode = "low_latency" if "low_latency" in val else "normal"
                t.add("--moe-a2a-backend", "deepep", "--deepep-mode", mode)
                t.notes.append(
                    f"--all2all-backend {val} -> --moe-a2a-backend deepep --deepep-mode {mode} (needs --ep-size >= 4)"
                )
            else:
                t.notes.append(f"--all2all-backend {val}: dropped; SGLang's default MoE all-to-all applies")
        elif flag == "--gpu-memory-utilization":
            t.notes.append(
                f"--gpu-memory-utilization {val}: dropped. vLLM's fraction covers weights + KV + activations; "
                "SGLang's --mem-fraction-static covers weights + KV pool only and is chosen per GPU by SGLang. "
                "Copying the number would change the KV pool; set --mem-fraction-static only deliberately."
            )
        elif flag == "--quantization":
            t.notes.append(
                f"--quantization {val}: dropped; the checkpoint's quantization_config decides (FP8 128x128 blocks)"
            )
        elif flag == "--enforce-eager":
            t.add("--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled")
            t.notes.append(
                "--enforce-eager -> --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled"
            )
        elif flag == "--no-enable-prefix-caching":
            t.add("--disable-radix-cache")
            t.notes.append("--no-enable-prefix-caching -> --disable-radix-cache")
        elif flag in SAME:
            t.add(SAME[flag], val)
        elif flag in SAME_BOOL:
            t.add(SAME_BOOL[flag])
        elif flag in DROPPED_BOOL or flag in DROPPED_VALUE:
            why = DROPPED_BOOL.get(flag) or DROPPED_VALUE[flag]
            t.notes.append(f"{flag}{' ' + val if val else ''}: dropped ({why})")
        elif flag in MULTINODE:
            t.errors.append(
                f"{flag}: vLLM's multi-node data-parallel launch has no one-to-one SGLang form; SGLang runs one "
                "command per node with --nnodes/--node-rank/--dist-init-addr (see `sglang-ernie55 cmd`)"
            )
        elif flag in SGLANG_ONLY:
            t.errors.append(f"{flag}: an SGLang flag, not a vLLM one; the input must be a vLLM command")
        else:
            t.errors.append(
                f"{flag}{' ' + val if val else ''}: no SGLang equivalent known; remove it or translate it by hand"
            )

    if not model:
        t.errors.append("no model: `vllm serve MODEL ...`")
        model = "MODEL"
    t.argv = ["--model-path", model, *_parallel(tp, dp, pp, ep_flag, t), *t.argv]

    # KV dtype: vLLM's names, and its default (auto = the model dtype, BF16).
    kv_map = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "auto": "bfloat16", "bfloat16": "bfloat16"}
    if kv_dtype is None:
        t.notes.append(
            "no --kv-cache-dtype: vLLM stored the KV cache in BF16 (auto); SGLang defaults this model to fp8_e4m3. "
            "Add --kv-cache-dtype bfloat16 to keep BF16 KV."
        )
    elif kv_dtype in kv_map:
        t.add("--kv-cache-dtype", kv_map[kv_dtype])
        if kv_map[kv_dtype] != kv_dtype:
            t.notes.append(
                f"--kv-cache-dtype {kv_dtype} -> {kv_map[kv_dtype]}: SGLang's names; this model takes fp8_e4m3 or "
                "bfloat16 only (vLLM's `fp8` is illegal here)"
            )
    else:
        t.errors.append(f"--kv-cache-dtype {kv_dtype}: ERNIE-5.5 serves fp8_e4m3 or bfloat16 KV only")

    for flag, val in seen_parsers:
        if _is_base(model):
            t.notes.append(
                f"{flag} {val}: dropped. The Base model has no reasoning or tool-call training; SGLang's `ernie55` "
                "parsers exist for the post-trained model only (this plugin refuses them on Base unless "
                "SGLANG_ERNIE55_ALLOW_PARSERS=1). Base serves /v1/completions."
            )
        elif val in ("ernie5", "ernie55", "ernie45"):
            t.add(flag, "ernie55")
            t.notes.append(f"{flag} {val} -> {flag} ernie55 (the SGLang parser's name)")
        else:
            t.errors.append(f"{flag} {val}: no SGLang parser of that name for ERNIE-5.5 (ernie55)")

    if port is None:
        t.notes.append(
            f"port: vLLM listened on {VLLM_DEFAULT_PORT} by default, SGLang on {SGLANG_DEFAULT_PORT}: "
            f"point clients at :{SGLANG_DEFAULT_PORT}, or add --port {VLLM_DEFAULT_PORT}"
        )
    else:
        t.add("--port", port)
    from ..args.rules import parallel_layout_refusal

    layout = {f: int(t.value(f) or 1) for f in ("--tp-size", "--attn-dp-size", "--ep-size")}
    why = parallel_layout_refusal(
        layout["--tp-size"],
        layout["--attn-dp-size"],
        ep=layout["--ep-size"],
        a2a_backend=t.value("--moe-a2a-backend") or "none",
        speculative=t.has("--speculative-algorithm"),
    )
    if why:
        t.errors.append(
            f"the translated command is one this version of sglang-ernie55 refuses when it loads the model: {why}"
        )
    if t.value("--host") in ("0.0.0.0", "::") and not t.has("--api-key"):
        t.notes.append(
            "--host 0.0.0.0 without --api-key: an unauthenticated API on the network; add --api-key or bind 127.0.0.1"
        )
    return t


def _parallel(tp: int, dp: int, pp: int, ep: bool, t: Translation) -> list[str]:
    """vLLM's DP x TP (x EP) onto SGLang's tp / attn-dp-size / ep-size."""
    from ..args.rules import parallel_layout_refusal  # the rules import torch; `translate` alone does not

    out: list[str] = []
    world = tp * dp
    if world > 1:
        out += ["--tp-size", str(world)]
    if dp > 1:
        out += ["--attn-dp-size", str(dp)]
        t.notes.append(
            f"--tensor-parallel-size {tp} --data-parallel-size {dp} -> --tp-size {world} --attn-dp-size {dp}: in vLLM, "
            f"DP {dp} x TP {tp} are {world} GPUs with MoE spread over all of them; SGLang's --tp-size counts all "
            f"{world} GPUs and --attn-dp-size {dp} splits attention into {dp} data-parallel groups of attention TP {tp}"
        )
    elif tp > 1:
        t.notes.append(f"--tensor-parallel-size {tp} -> --tp-size {tp}")
    if ep and world > 1:
        out += ["--ep-size", str(world)]
        t.notes.append(
            f"--enable-expert-parallel -> --ep-size {world}: SGLang takes the EP width, not a switch; experts split "
            f"over all {world} GPUs through SGLang's standard dispatch"
            + (
                " (this version does not run DeepEP yet)"
                if parallel_layout_refusal(world, ep=world, a2a_backend="deepep")
                else " (add --moe-a2a-backend deepep for DeepEP, which needs --ep-size >= 4)"
            )
        )
    attn_tp = tp
    if 8 % attn_tp:
        t.errors.append(
            f"attention TP {attn_tp}: the TP-related sizes must divide 8 (the HCA output groups); use TP 1, 2, 4 or 8 "
            "per data-parallel group (16 GPUs: --tp-size 16 --attn-dp-size 2)"
        )
    if pp > 1:
        out += ["--pp-size", str(pp), "--moe-a2a-backend", "none"]
        t.notes.append(
            f"--pipeline-parallel-size {pp} -> --pp-size {pp} --moe-a2a-backend none (no DeepEP under PP)"
        )
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    """Translate a vLLM launch command for ERNIE-5.5-Flash (vLLM + the vLLM-ERNIE plugin) into `sglang serve`.

    Give the vLLM command after `--` (words, or one quoted string). Prints the SGLang command, then one
    `#` note for every flag whose meaning changes on the way: ECHO steps vs draft tokens, KV dtype
    names, parsers (Base: none), `--moe-backend humming` (dropped), DP / EP semantics, KV offload bytes
    vs the HiCache ratio, the port (8000 -> 30000), and PD (MooncakeConnector + vllm-router -> SGLang's
    Mooncake PD and router). A flag with no SGLang equivalent is an error: nothing is printed on
    stdout and the exit status is 2, so a wrong translation cannot be copied by accident.

    Examples:
      sglang-ernie55 translate -- vllm serve baidu/ERNIE-5.5-Flash-Base --tensor-parallel-size 4 \\
          --max-model-len 131072 --kv-cache-dtype fp8 \\
          --speculative-config '{"method":"mtp","num_speculative_tokens":2}'
      sglang-ernie55 translate -- "vllm serve baidu/ERNIE-5.5-Flash-Base -tp 4 -dp 2 --enable-expert-parallel"
      sglang-ernie55 translate -- vllm-router --pd-disaggregation --prefill http://p:8000 --decode http://d:8000
    """
    parser.add_argument("vllm", nargs=argparse.REMAINDER, help="the vLLM command, after --")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    words = [w for w in args.vllm if w != "--"] if args.vllm[:1] == ["--"] else list(args.vllm)
    if not words:
        print(
            "error: give the vLLM command after --: sglang-ernie55 translate -- vllm serve MODEL ...",
            file=sys.stderr,
        )
        return 2
    try:
        t = translate(words)
    except TranslateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {
                    "command": None if t.errors else t.command,
                    "argv": t.argv,
                    "env": t.env,
                    "notes": t.notes,
                    "errors": t.errors,
                },
                indent=2,
            )
        )
        return 2 if t.errors else 0
    if t.errors:
        for e in t.errors:
            print(f"error: {e}", file=sys.stderr)
        for n in t.notes:
            print(f"note: {n}", file=sys.stderr)
        return 2
    print(t.command)
    for n in t.notes:
        print(f"# {n}")
    return 0
