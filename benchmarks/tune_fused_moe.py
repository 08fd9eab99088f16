"""Tune SGLang's fused-MoE Triton kernel configs for ERNIE-5.5-Flash's routed experts on this GPU.

ERNIE-5.5's latent MoE runs SGLang's `fused_experts` (Triton runner) on latent rows: E = n_routed_experts
experts, hidden K = moe_latent_size, intermediate N = moe_intermediate_size / MoE-TP per rank, top-k =
num_experts_per_tok (`Ernie55Config`'s full-size defaults). The shapes tuned: the one-GPU server (TP 1) in FP8
block-128 and BF16, then the per-rank shapes of this GPU's hardware cells (sglang_ernie55/cells/*.toml).

For each shape and batch size M, a search space pruned by the rows each routed expert receives at that M
(BLOCK_SIZE_M), by shared memory and by the FP8 block (BLOCK_SIZE_K divides 128) is timed with SGLang's own
`fused_experts` under SGLang's own `override_config` (what SGLang's tuner times), each candidate in a CUDA
graph of 10 calls with different random routing (weights are not left in L2 between calls), median of the
replays; then GROUP_SIZE_M is refined on the two best configs at M >= 256 while time is left. The baseline
is what SGLang 0.5.23 picks by itself (a file of its own folder, or its heuristic default); it is a
candidate too. Each winner's output is compared with the baseline config's before it is kept, and at the end
the baseline and the winner are timed again one after the other with nothing else running (the tables'
numbers; the faster is kept). Triton compiles run ahead in worker processes (`--workers`, compile only: the
kernel launch is turned into Triton's warmup, into Triton's on-disk cache) while the main process times.

With `--kernel linear` the same search tunes SGLang's Triton block-FP8 GEMM (`w8a8_block_fp8_matmul_triton`,
what serves the block-FP8 Linears where DeepGEMM does not load) for the one-GPU server's Linear weights [N, K]:
the candidates add SGLang's SM90 split-K and swap-AB variants at small M, each call reads its own copy of the
weight (past the L2 cache), and the files go to sglang_ernie55/kernels/fp8_linear_configs/ under SGLang's names.

    python3 benchmarks/tune_fused_moe.py tune --out $OUT [--budget-s 420] [--kernel linear] [--shapes 0,1]
                                                                                # GPU; one command, <= budget
    python3 benchmarks/tune_fused_moe.py install PATH/tune_fused_moe.json    # here: writes the package's files
    python3 benchmarks/tune_fused_moe.py plan [--device-name "NVIDIA H200"] [--kernel linear]
                                                                                # anywhere: shapes, files, sizes

`tune` writes three plainly named files into --out (SGLang's file names hold '=', ',', ' ' and brackets):
tune_fused_moe.json (every shape, M, time and config; what `install` reads), moe_configs.tar (the files of
the complete shapes in SGLang's names under triton_<version>/) and tune_fused_moe.log (progress and the
tables); for `--kernel linear` tune_fp8_linear.json, fp8_linear_configs.tar and tune_fp8_linear.log. A
shape whose M list did not finish in the budget is marked incomplete and not installed.
`install` writes sglang_ernie55/kernels/moe_configs/ (or fp8_linear_configs/, as the bundle says)
triton_<version>/<SGLang's file name>.json, merged with a file already there unless `--replace`, and checks
each file with that folder's `check_file` (an invalid one is left as it was).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import tarfile
import time
from concurrent import futures
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
GRAPH_CALLS = 10  # calls per captured graph, each with its own routing
TARGET_REPLAY_S = 0.05  # time spent replaying one candidate (at least 3 replays)
SMEM_BYTES = 200 * 1024  # H100 / H200 allow 227 KiB per block; the rest for the epilogue's layout conversion
REFINE_GROUPS = (16, 32, 64)
REFINE_MIN_M = 256
MAX_COMPILE_WAIT_S = 180  # waiting longer for a worker's job: compile it here instead
REL_TOL = 2e-2  # winner vs baseline output: same math, another accumulation order
FP8_BLOCK = [128, 128]
BUNDLE, TARBALL, LOG = "tune_fused_moe.json", "moe_configs.tar", "tune_fused_moe.log"
_T0 = time.perf_counter()


def log(msg: str) -> None:
    line = f"[{time.perf_counter() - _T0:7.1f}s] {msg}"
    print(line, flush=True)
    if _LOG_FILE is not None:
        _LOG_FILE.write(line + "\n")
        _LOG_FILE.flush()


_LOG_FILE = None


# ------------------------------------------------------------------------------------------- shapes
@dataclass
class Shape:
    """One FusedMoE weight shape per rank: w13 [E, 2N, K], w2 [E, K, N]."""

    precision: str  # "fp8" (block-128 w8a8) or "bf16"
    E: int
    N: int
    K: int
    topk: int
    tp: int
    ep: int
    used_by: list[str] = field(default_factory=list)

    @property
    def dtype(self) -> str | None:
        return "fp8_w8a8" if self.precision == "fp8" else None  # SGLang's config dtype string

    @property
    def block_shape(self) -> list[int] | None:
        return FP8_BLOCK if self.precision == "fp8" else None

    @property
    def label(self) -> str:
        return f"{self.precision} E={self.E} N={self.N} (TP {self.tp}" + (
            f", EP {self.ep})" if self.ep > 1 else ")"
        )

    @property
    def describe(self) -> str:
        return f"{self.label} top-{self.topk} K={self.K}"

    def file_name(self, device_name: str) -> str:
        """SGLang's own file name for this shape on `device_name` (its `get_config_file_name`)."""
        from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as fmc

        bn, bk = self.block_shape or (0, 0)
        with mock.patch.object(fmc, "get_device_name", lambda: device_name):
            return fmc.get_config_file_name(self.E, self.N, self.dtype, [bn, bk])

    def weight_bytes(self) -> int:
        return self.E * 3 * self.N * self.K * (1 if self.precision == "fp8" else 2)


def model_shapes(device_name: str) -> list[Shape]:
    """The one-GPU server's shapes (FP8 and BF16 at TP 1), then the per-rank shapes of the hardware cells of
    this GPU model (MoE-TP = tp / ep over E / ep experts), each once."""
    from sglang_ernie55.configuration import Ernie55Config
    from sglang_ernie55.deploy.cells import gpu_from_device_name, load_cells

    cfg = Ernie55Config()
    E, K, inter, topk = (
        cfg.n_routed_experts,
        cfg.moe_latent_size,
        cfg.moe_intermediate_size,
        cfg.num_experts_per_tok,
    )
    out: dict[tuple, Shape] = {}

    def add(precision: str, tp: int, ep: int, who: str) -> None:
        moe_tp = tp // ep
        n = inter // moe_tp
        if precision == "fp8" and n % FP8_BLOCK[0]:
            log(
                f"skip {who}: a per-rank expert width of {n} is not whole 128-blocks (SGLang's FP8 MoE refuses it)"
            )
            return
        key = (precision, E // ep, n)
        out.setdefault(key, Shape(precision, E // ep, n, K, topk, tp, ep)).used_by.append(who)

    add("fp8", 1, 1, "one-GPU server")
    add("bf16", 1, 1, "one-GPU server")
    gpu = gpu_from_device_name(device_name)
    cells = [c for c in load_cells().values() if gpu is not None and c.hardware == gpu.key]
    for c in sorted(cells, key=lambda c: (c.precision != "fp8", c.name)):
        add(
            c.precision,
            c.int_flag("tp-size", c.int_flag("tp", 1)),
            c.int_flag("ep-size", c.int_flag("ep", 1)),
            c.name,
        )
    return list(out.values())


# ------------------------------------------------------------------------------------------- search space
def rows_per_expert(shape: Shape, M: int) -> float:
    """Expected rows per active expert under uniform routing of M tokens x top-k over E experts."""
    active = shape.E * (1 - (1 - 1 / shape.E) ** (M * shape.topk))
    return M * shape.topk / max(active, 1.0)


def smem(bm: int, bn: int, bk: int, elt: int, stages: int) -> int:
    return (bm * bk + bn * bk) * elt * stages


def cfg_key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def candidates(shape: Shape, M: int) -> list[dict]:
    """Stage-1 configs for one M (GROUP_SIZE_M = 1): BLOCK_SIZE_M up to twice the expected rows per expert
    (the rest of a tile is padding), 8 warps only for tiles of >= 8192 outputs, shared memory within bounds."""
    r = rows_per_expert(shape, M)
    cap = min(128, max(16, 2 * 2 ** math.ceil(math.log2(max(r, 1.0)))))
    fp8 = shape.precision == "fp8"
    elt = 1 if fp8 else 2
    k_min = min(shape.K, shape.N)  # the reduction widths of the two GEMMs
    out = []
    for bm in (16, 32, 64, 128):
        if bm > cap or (bm == 16 and r >= 32):
            continue
        bns = (32, 64, 128, 256) if bm == 16 else (64, 128, 256)
        if fp8:
            bks = (64, 128) if bm == 16 else (128,)
        else:
            bks = (64, 128, 256) if bm == 16 else (64, 128)
        for bn in bns:
            for bk in bks:
                if bk > k_min or (fp8 and FP8_BLOCK[1] % bk):
                    continue
                for w in (4, 8) if bm * bn >= 8192 else (4,):
                    for s in (3, 4, 5) if bm <= 32 else (2, 3, 4):
                        if smem(bm, bn, bk, elt, s) > SMEM_BYTES:
                            continue
                        out.append(
                            dict(
                                BLOCK_SIZE_M=bm,
                                BLOCK_SIZE_N=bn,
                                BLOCK_SIZE_K=bk,
                                GROUP_SIZE_M=1,
                                num_warps=w,
                                num_stages=s,
                            )
                        )
    return out


# ------------------------------------------------------------------------------------------- SGLang context
def init_sglang() -> None:
    """World-1 process group, SGLang's runtime context and model-parallel groups (`fused_experts` reads the
    exec config and the TP group), as the project's in-process harness builds them."""
    import torch
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    from sglang_ernie55.ports import free_port

    port = free_port(server=False)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    if torch.cuda.is_available():  # `plan` builds the model on the meta device anywhere
        torch.cuda.set_device(0)
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if not model_parallel_is_initialized():
        reset_context()
        publish(
            ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1),
            role="test",
            ranks=SpawnRanks(world_rank=0),
        )
        if parallel_state._WORLD is not None:
            get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")


class Problem:
    """Random weights (fp8 block-scaled or bf16), input rows and GRAPH_CALLS routings per M for one shape;
    `call(cfg, M, r)` runs SGLang's fused_experts with routing r under `override_config(cfg)`."""

    def __init__(self, shape: Shape, batch_sizes, meta_weights: bool = False, seed: int = 0):
        import torch
        from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

        self.shape = shape
        dev = "cuda"
        g = torch.Generator(device=dev).manual_seed(seed)
        E, N, K = shape.E, shape.N, shape.K
        fp8 = shape.precision == "fp8"
        if meta_weights:  # compile only: the weights' data is never read, only their shape / strides / dtype
            wdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
            self.w1 = torch.empty(E, 2 * N, K, dtype=wdt, device="meta")
            self.w2 = torch.empty(E, K, N, dtype=wdt, device="meta")
        else:
            self.w1 = self._rand((E, 2 * N, K), K, fp8, g)
            self.w2 = self._rand((E, K, N), N, fp8, g)
        self.w1_scale = self.w2_scale = None
        if fp8:
            bn, bk = FP8_BLOCK
            self.w1_scale = torch.rand(E, -(-2 * N // bn), -(-K // bk), device=dev, generator=g) + 0.5
            self.w2_scale = torch.rand(E, -(-K // bn), -(-N // bk), device=dev, generator=g) + 0.5
        self.x = torch.randn(max(batch_sizes), K, device=dev, dtype=torch.bfloat16, generator=g)
        self.g = g
        self.routing: dict = {}
        self.runner = MoeRunnerConfig(num_experts=E, num_local_experts=E, top_k=shape.topk, inplace=False)
        self.logits = torch.empty(0, device=dev)

    @staticmethod
    def _rand(size, fan_in, fp8, g):
        import torch

        w = torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=g)
        if not fp8:
            return w.mul_(1 / math.sqrt(fan_in))
        return w.mul_(64 / math.sqrt(fan_in)).to(torch.float8_e4m3fn)  # fp8 range, block scales ~1

    def route(self, M: int):
        """GRAPH_CALLS random routings of M tokens: distinct top-k expert ids per token, weights summing to 1."""
        import torch

        if M not in self.routing:
            E, k, dev = self.shape.E, self.shape.topk, self.x.device
            if M > self.x.shape[0]:
                self.x = torch.randn(M, self.shape.K, device=dev, dtype=torch.bfloat16, generator=self.g)
            ids = torch.rand(GRAPH_CALLS, M, E, device=dev, generator=self.g).topk(k, dim=-1).indices
            w = torch.rand(GRAPH_CALLS, M, k, device=dev, generator=self.g)
            self.routing[M] = (ids.to(torch.int32).contiguous(), (w / w.sum(-1, keepdim=True)).contiguous())
        return self.routing[M]

    def call(self, cfg, M: int, r: int = 0):
        from sglang.srt.layers.moe.moe_runner.triton_utils import override_config
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        ids, w = self.route(M)
        topk = StandardTopKOutput(topk_weights=w[r], topk_ids=ids[r], router_logits=self.logits)
        with override_config(cfg):
            return fused_experts(
                self.x[:M],
                self.w1,
                self.w2,
                topk,
                self.runner,
                use_fp8_w8a8=self.shape.precision == "fp8",
                w1_scale=self.w1_scale,
                w2_scale=self.w2_scale,
                block_shape=self.shape.block_shape,
            )

    def free(self) -> None:
        self.w1 = self.w2 = self.w1_scale = self.w2_scale = None


def sglang_pick(shape: Shape, M: int) -> tuple[dict, str]:
    """The config SGLang 0.5.23 uses for this shape and M on its own (its `try_get_optimal_moe_config` with
    its own `get_moe_configs`, whatever a plugin hooked), and where it comes from."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as fmc

    own = fmc.get_moe_configs
    while not hasattr(own, "cache_info") and hasattr(own, "__wrapped__"):
        own = own.__wrapped__  # a HookRegistry wrapper around SGLang's lru_cache'd function
    bn, bk = shape.block_shape or (0, 0)
    with mock.patch.object(fmc, "get_moe_configs", own):
        from_file = own(shape.E, shape.N, shape.dtype, bn, bk) is not None
        cfg = fmc.try_get_optimal_moe_config(
            (shape.E, 2 * shape.N, shape.K),
            (shape.E, shape.K, shape.N),
            shape.topk,
            shape.dtype,
            M,
            block_shape=shape.block_shape,
        )
    return dict(cfg), ("SGLang file" if from_file else "SGLang default")


# ------------------------------------------------------------------------------------------- block-FP8 Linears
@dataclass
class LinearShape:
    """One block-FP8 Linear weight [N, K] (128 x 128 blocks) of the one-GPU server, as SGLang's Triton GEMM
    (`w8a8_block_fp8_matmul_triton`) sees it: merged Linears are one weight."""

    N: int
    K: int
    tp: int = 1
    used_by: list[str] = field(default_factory=list)
    precision: str = "fp8"

    @property
    def label(self) -> str:
        return f"fp8 linear N={self.N} K={self.K} (TP {self.tp})"

    @property
    def describe(self) -> str:
        return self.label

    def file_name(self, device_name: str) -> str:
        from sglang_ernie55.kernels import fp8_linear_configs

        return fp8_linear_configs.file_name(self.N, self.K, device_name, tuple(FP8_BLOCK))

    def weight_bytes(self) -> int:
        return self.N * self.K


def linear_shapes(device_name: str) -> list[LinearShape]:
    """The block-FP8 Linears of the one-GPU server, each (N, K) once, largest weight bytes per decode step of the
    43-layer model first: the full-width model of four layers (dense FFN, MLA-DSA, HCA, MoE: every kind the
    43-layer model has, at its widths) built on the meta device with SGLang's Fp8Config, each Linear SGLang's
    Fp8LinearMethod serves, weighed by how many of the full model's layers hold it. Hardware cells shard these
    over TP; their per-rank shapes are not tuned here."""
    import torch
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    from sglang_ernie55.checkpoint.tiny import preset_config
    from sglang_ernie55.configuration import Ernie55Config
    from sglang_ernie55.models.ernie55 import Ernie5_5_MoeForCausalLM

    init_sglang()
    cfg, full = preset_config("full-width", 4), Ernie55Config()

    def role(layer: int, path: str) -> tuple[str, int]:
        """("attention <kind>" | "FFN <dense/moe>", layers of the full model holding it)."""
        if path.startswith("self_attn."):
            kind = cfg.layer_types[layer]
            return f"{kind} attention", sum(k == kind for k in full.layer_types)
        moe = cfg.is_moe_layer(layer)
        n = sum(full.is_moe_layer(i) == moe for i in range(full.num_hidden_layers))
        return ("MoE" if moe else "dense") + " FFN", n

    qc = Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=FP8_BLOCK
    )
    with torch.device("meta"):
        model = Ernie5_5_MoeForCausalLM(cfg, qc)
    out: dict[tuple, LinearShape] = {}
    layers: dict[tuple, int] = {}
    for name, mod in model.named_modules():
        if not isinstance(getattr(mod, "quant_method", None), Fp8LinearMethod):
            continue
        N, K = mod.weight.shape
        parts = name.split(".", 3)  # model, layers, <i>, <path>
        where, n = role(int(parts[2]), parts[3])
        who = f"{where} {parts[3]}"
        shape = out.setdefault((N, K), LinearShape(N, K))
        if who not in shape.used_by:
            shape.used_by.append(who)
            layers[(N, K)] = layers.get((N, K), 0) + n
    del model
    return sorted(out.values(), key=lambda s: -s.weight_bytes() * layers[(s.N, s.K)])


def linear_candidates(shape: LinearShape, M: int) -> list[dict]:
    """Stage-1 configs for one M (GROUP_SIZE_M = 1; refined later): row tiles up to the next power of two of M
    (16 at least), column tiles 32-128 (and 256 from M 1024, Hopper's large-GEMM tile), K tiles of one
    quantisation block; at M <= 64 also SGLang's SM90 kernel with K split 2-16 ways (each split at least two K
    tiles) and with A and B swapped, which is how a GEMM of a few rows fills the GPU; shared memory within
    bounds."""
    cap = max(16, min(128, 2 ** math.ceil(math.log2(max(M, 1)))))
    bk = FP8_BLOCK[1]
    k_tiles = -(-shape.K // bk)
    variants: list[dict] = [{}]
    if M <= 64:
        splits = [s for s in (2, 4, 8, 16) if k_tiles // s >= 2]
        variants += [{"SPLIT_K": s} for s in splits]
        variants += [{"SWAP_AB": True, "SPLIT_K": s} for s in [1, *splits]]
    out = []
    for bm in (16, 32, 64, 128):
        if bm > cap:
            continue
        for bn in (32, 64, 128, 256) if M >= 1024 and bm >= 64 else (32, 64, 128):
            for w in (4, 8) if bm * bn >= 8192 else (4,):
                for st in (3, 4, 5) if bm <= 32 else (2, 3, 4):
                    if smem(bm, bn, bk, 1, st) > SMEM_BYTES:
                        continue
                    for v in variants:
                        cfg = dict(
                            BLOCK_SIZE_M=bm,
                            BLOCK_SIZE_N=bn,
                            BLOCK_SIZE_K=bk,
                            GROUP_SIZE_M=1,
                            num_warps=w,
                            num_stages=st,
                        )
                        cfg.update({k: x for k, x in v.items() if not (k == "SPLIT_K" and x == 1)})
                        out.append(cfg)
    return out


class LinearProblem:
    """Random FP8 activations with their per-token-group scales and enough copies of a random block-FP8 weight
    that a graph of GRAPH_CALLS calls reads past the L2 cache; `call(cfg, M, r)` runs SGLang's Triton
    block-FP8 GEMM on copy r with its config lookup answering `cfg` (SGLang's tuner does the same)."""

    L2_PAST = 256 * 2**20  # bytes of weight copies read per graph: several times an H100 / H200 L2

    def __init__(self, shape: LinearShape, batch_sizes, meta_weights: bool = False, seed: int = 0):
        import torch

        dev = "meta" if meta_weights else "cuda"
        N, K = shape.N, shape.K
        bn, bk = FP8_BLOCK
        self.shape = shape
        copies = max(2, min(GRAPH_CALLS, -(-self.L2_PAST // shape.weight_bytes())))
        Mx = max(batch_sizes)
        if meta_weights:
            self.B = [torch.empty(N, K, dtype=torch.float8_e4m3fn, device=dev)] * copies
            self.Bs = [torch.empty(-(-N // bn), -(-K // bk), device=dev)] * copies
            self.A = torch.empty(Mx, K, dtype=torch.float8_e4m3fn, device=dev)
            self.As = torch.empty(Mx, -(-K // bk), device=dev)
        else:
            g = torch.Generator(device=dev).manual_seed(seed)
            self.B = [Problem._rand((N, K), K, True, g) for _ in range(copies)]
            self.Bs = [
                torch.rand(-(-N // bn), -(-K // bk), device=dev, generator=g) + 0.5 for _ in range(copies)
            ]
            self.A = torch.randn(Mx, K, device=dev, generator=g).mul_(64).to(torch.float8_e4m3fn)
            self.As = torch.rand(Mx, -(-K // bk), device=dev, generator=g) * 1e-2

    def call(self, cfg, M: int, r: int = 0):
        import torch
        from sglang.kernels.ops.gemm import fp8_kernel

        i = r % len(self.B)
        with mock.patch.object(fp8_kernel, "get_w8a8_block_fp8_configs", lambda *a: {M: cfg}):
            return fp8_kernel.w8a8_block_fp8_matmul_triton(
                self.A[:M], self.B[i], self.As[:M], self.Bs[i], FP8_BLOCK, torch.bfloat16
            )

    def free(self) -> None:
        self.A = self.As = self.B = self.Bs = None


_LINEAR_KEYS = (
    "BLOCK_SIZE_M",
    "BLOCK_SIZE_N",
    "BLOCK_SIZE_K",
    "GROUP_SIZE_M",
    "num_warps",
    "num_stages",
    "SPLIT_K",
    "SWAP_AB",
)


def linear_pick(shape: LinearShape, M: int) -> tuple[dict, str]:
    """The config SGLang 0.5.23's Triton block-FP8 GEMM launches for this shape and M on its own (its own
    `get_w8a8_block_fp8_configs`, whatever a plugin hooked): read off one launch whose kernel only records its
    keyword arguments."""
    import torch
    from sglang.kernels.ops.gemm import fp8_kernel

    own = fp8_kernel.get_w8a8_block_fp8_configs
    while not hasattr(own, "cache_info") and hasattr(own, "__wrapped__"):
        own = own.__wrapped__
    seen: list[dict] = []

    class Record:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs)

    bn, bk = FP8_BLOCK
    N, K = shape.N, shape.K
    a = torch.empty(M, K, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(N, K, dtype=torch.float8_e4m3fn, device="meta")
    with (
        mock.patch.object(fp8_kernel, "get_w8a8_block_fp8_configs", own),
        mock.patch.object(fp8_kernel, "_w8a8_block_fp8_matmul", Record()),
        mock.patch.object(fp8_kernel, "_w8a8_block_fp8_matmul_hopper", Record()),
        mock.patch.object(fp8_kernel, "select_w8a8_block_fp8_matmul_kernel", lambda *x: Record()),
        mock.patch.object(fp8_kernel, "_reduce_block_fp8_split_k", Record()),
    ):
        fp8_kernel.w8a8_block_fp8_matmul_triton(
            a,
            b,
            torch.empty(M, -(-K // bk), device="meta"),
            torch.empty(-(-N // bn), -(-K // bk), device="meta"),
            FP8_BLOCK,
            torch.bfloat16,
        )
        from_file = own(N, K, bn, bk) is not None
    cfg = {k: seen[0][k] for k in _LINEAR_KEYS if k in seen[0]}
    return cfg, ("SGLang file" if from_file else "SGLang default")


# ------------------------------------------------------------------------------------------- compile workers
_W: dict = {}


def _worker_init(kernel_name: str) -> None:
    """Each worker: its own CUDA and SGLang context; SGLang's Triton kernels of `kernel_name` compile into
    Triton's on-disk cache (which the main process then loads from) but never launch, so no weights are needed
    (meta tensors carry their shapes and strides) and the GPU stays free for the timings."""
    import warnings

    warnings.filterwarnings("ignore")
    init_sglang()
    for kernel in KERNELS[kernel_name].triton_kernels():
        run = kernel.run

        def compile_only(*args, _run=run, **kwargs):  # `kernel[grid](...)` calls `run(..., warmup=False)`
            kwargs["warmup"] = True
            return _run(*args, **kwargs)

        kernel.run = compile_only


def _worker_compile(kernel_name: str, shape, cfg: dict, batch_sizes: list[int]) -> str | None:
    """Run `cfg` once at every M (every specialisation SGLang's launches ask for gets compiled); the first
    error, or None."""
    key = (kernel_name, shape.label)
    if _W.get("key") != key:
        _W.update(key=key, problem=KERNELS[kernel_name].problem(shape, batch_sizes, meta_weights=True))
    for M in batch_sizes:
        try:
            _W["problem"].call(cfg, M)
        except Exception as e:  # noqa: BLE001  (reported; the main process decides by running it)
            return f"{type(e).__name__}: {str(e)[:200]}"
    return None


class Compiler:
    """Compile jobs per (shape, config), queued in the order the main process needs them; `ready` waits for
    one (MAX_COMPILE_WAIT_S at most). Without workers, or when a job failed or is late, the main process
    compiles on first use."""

    def __init__(self, workers: int, kernel_name: str = "moe"):
        self.kernel_name = kernel_name
        self.pool = None
        self.broken = False
        self.reported: set = set()
        self.jobs: dict[tuple, futures.Future] = {}
        if workers > 0:
            import multiprocessing as mp

            self.pool = futures.ProcessPoolExecutor(
                workers, mp_context=mp.get_context("spawn"), initializer=_worker_init, initargs=(kernel_name,)
            )

    def submit(self, i: int, shape, cfg: dict, batch_sizes: list[int]) -> None:
        key = (i, cfg_key(cfg))
        if self.pool is not None and key not in self.jobs:
            self.jobs[key] = self.pool.submit(_worker_compile, self.kernel_name, shape, cfg, batch_sizes)

    def ready(self, i: int, cfg: dict, deadline: float) -> None:
        job = self.jobs.get((i, cfg_key(cfg)))
        if job is None:
            return
        try:
            err = job.result(timeout=max(0.0, min(deadline - time.perf_counter(), MAX_COMPILE_WAIT_S)))
        except (futures.TimeoutError, futures.CancelledError):
            return
        except Exception as e:  # noqa: BLE001  (the worker pool broke: the main process compiles everything)
            if not self.broken:
                self.broken = True
                log(f"compile workers failed ({type(e).__name__}: {str(e)[:300]}); compiling in this process")
            return
        if err and (i, cfg_key(cfg)) not in self.reported:
            self.reported.add((i, cfg_key(cfg)))
            log(f"    precompile of {cfg} failed ({err}); compiling in this process")

    def done(self, i: int, cfg: dict) -> bool:
        job = self.jobs.get((i, cfg_key(cfg)))
        return job is None or job.done()

    def close(self, deadline: float) -> None:
        """Let the queued jobs finish until the deadline, then stop the workers (the last timings run alone)."""
        if self.pool is None:
            return
        _, pending = futures.wait(list(self.jobs.values()), timeout=max(0.0, deadline - time.perf_counter()))
        if pending:
            log(f"{len(pending)} compile jobs left unfinished; stopping the workers")
            for proc in list(getattr(self.pool, "_processes", {}).values()):
                proc.terminate()
        self.pool.shutdown(wait=not pending, cancel_futures=True)
        self.pool = None


# ------------------------------------------------------------------------------------------- timing
def time_config(problem, cfg: dict, M: int, best_us: float | None) -> float | None:
    """us per call: median over replays of a graph of GRAPH_CALLS calls (each with its own routing, or its own
    weight copy);
    None when the config does not run. A config 3x slower than the best so far is replayed once."""
    import torch

    try:
        problem.call(cfg, M)  # compile / load, and launch errors, before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for r in range(GRAPH_CALLS):
                problem.call(cfg, M, r)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (a config that cannot launch: out of resources, ...)
        log(f"    skip {cfg}: {type(e).__name__}: {str(e)[:160]}")
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[float] = []
    reps = 3
    while len(times) < reps:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
        if len(times) == 1:
            if best_us is not None and times[0] > 3 * best_us:
                break
            reps = max(3, min(30, int(TARGET_REPLAY_S / (times[0] * GRAPH_CALLS * 1e-6))))
    del graph
    times.sort()
    return times[len(times) // 2]


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    if not (a.isfinite().all() and b.isfinite().all()):
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


KEY_ORDER = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def full_config(cfg: dict) -> dict:
    """A config with Triton's launch defaults written out (SGLang's BF16 heuristic leaves them to Triton), in
    the key order of SGLang's own files."""
    cfg = {"num_warps": 4, "num_stages": 3, **cfg}
    return {
        **{k: cfg[k] for k in KEY_ORDER if k in cfg},
        **{k: v for k, v in cfg.items() if k not in KEY_ORDER},
    }


@dataclass
class Row:
    M: int
    baseline_us: float | None
    baseline_source: str
    baseline_config: dict
    tuned_us: float | None = None
    tuned_config: dict | None = None
    timed: list = field(default_factory=list)  # [(us, config)], fastest first


class ShapeTuner:
    """One shape's rows: stage 1 (`candidates` + SGLang's pick per M), GROUP_SIZE_M refinement, and a last
    clean timing of SGLang's pick against the winner (no compile workers running then)."""

    def __init__(
        self, i: int, shape, batch_sizes: list[int], compiler: Compiler, kernel: Kernel | None = None
    ):
        self.i, self.shape, self.batch_sizes, self.compiler = i, shape, batch_sizes, compiler
        self.kernel = kernel or KERNELS["moe"]
        self.rows: list[Row] = []
        self.failed: set = set()
        self.complete = False

    def _time(self, problem, cfg, M, best, deadline):
        if cfg_key(cfg) in self.failed:
            return None
        self.compiler.ready(self.i, cfg, deadline)
        us = time_config(problem, cfg, M, best)
        if us is None:
            self.failed.add(cfg_key(cfg))
        return us

    def stage1(self, deadline: float) -> None:
        import torch

        problem = self.kernel.problem(self.shape, self.batch_sizes)
        label = self.shape.label
        try:
            for M in self.batch_sizes:
                if time.perf_counter() > deadline:
                    log(f"  {label}: out of time before M={M}")
                    return
                base_cfg, source = self.kernel.pick(self.shape, M)
                base_us = self._time(problem, base_cfg, M, None, deadline)
                row = Row(M, base_us, source, base_cfg)
                best = base_us
                cands = self.kernel.candidates(self.shape, M)
                # those already compiled first; the rest as the workers finish them
                for cfg in sorted(cands, key=lambda c: not self.compiler.done(self.i, c)):
                    us = self._time(problem, cfg, M, best, deadline)
                    if us is not None:
                        row.timed.append((us, cfg))
                        best = us if best is None else min(best, us)
                    if time.perf_counter() > deadline:
                        break
                if base_us is not None:
                    row.timed.append((base_us, base_cfg))
                row.timed.sort(key=lambda t: t[0])
                self._pick(problem, row)
                self.rows.append(row)
                log(
                    f"  {label} M={M}: {len(row.timed) - (base_us is not None)}/{len(cands)} timed; {source} "
                    f"{_us(base_us)}, tuned {_us(row.tuned_us)} {row.tuned_config}"
                )
            self.complete = all(r.tuned_config for r in self.rows)
        finally:
            problem.free()
            del problem
            torch.cuda.empty_cache()

    def _pick(self, problem, row: Row) -> None:
        """The fastest timed config whose output matches SGLang's pick's (same math, another order)."""
        ref = problem.call(row.baseline_config, row.M).clone()
        row.tuned_us = row.tuned_config = None
        for us, cfg in row.timed:
            err = rel_err(problem.call(cfg, row.M), ref)
            if err <= REL_TOL:
                row.tuned_us, row.tuned_config = us, full_config(cfg)
                return
            log(f"    M={row.M} {cfg}: output differs from SGLang's pick's (rel. err {err:.3g}); next")

    def refine_candidates(self, row: Row) -> list[dict]:
        seen = {cfg_key(c) for _, c in row.timed}
        out = []
        for _, cfg in row.timed[:2]:
            for g in REFINE_GROUPS:
                c = dict(cfg, GROUP_SIZE_M=g)
                if cfg_key(c) not in seen:
                    seen.add(cfg_key(c))
                    out.append(c)
        return out

    def queue_refinement(self) -> None:
        for row in self.rows:
            if row.M >= REFINE_MIN_M:
                for cfg in self.refine_candidates(row):
                    self.compiler.submit(self.i, self.shape, cfg, [row.M])

    def refine_and_confirm(self, refine_deadline: float, deadline: float) -> None:
        """GROUP_SIZE_M on the two fastest configs (M >= REFINE_MIN_M) until `refine_deadline`, then SGLang's
        pick and the winner timed again one after the other; the faster of the two is kept."""
        import torch

        if not self.rows:
            return
        problem = self.kernel.problem(self.shape, [r.M for r in self.rows])
        label = self.shape.label
        try:
            for row in self.rows:
                if row.M < REFINE_MIN_M or not row.timed or time.perf_counter() > refine_deadline:
                    continue
                before = row.tuned_us
                for cfg in self.refine_candidates(row):
                    us = self._time(problem, cfg, row.M, row.tuned_us, refine_deadline)
                    if us is not None:
                        row.timed.append((us, cfg))
                    if time.perf_counter() > refine_deadline:
                        break
                row.timed.sort(key=lambda t: t[0])
                self._pick(problem, row)
                log(f"  refine {label} M={row.M}: {_us(before)} -> {_us(row.tuned_us)} {row.tuned_config}")
            for row in self.rows:
                if time.perf_counter() > deadline or row.tuned_config is None or row.baseline_us is None:
                    continue
                base = time_config(problem, row.baseline_config, row.M, None)
                tuned = time_config(problem, row.tuned_config, row.M, None)
                if base is None or tuned is None:
                    continue
                if base < tuned:
                    log(
                        f"  confirm {label} M={row.M}: SGLang's pick {_us(base)} < tuned {_us(tuned)}; keeping it"
                    )
                    row.tuned_config = full_config(row.baseline_config)
                    tuned = base
                row.baseline_us, row.tuned_us = base, tuned
        finally:
            problem.free()
            del problem
            torch.cuda.empty_cache()


def warm_up(shapes: list, kernel: Kernel | None = None) -> None:
    """One small call per precision at SGLang's own config: SGLang's JIT helper kernels (activation, FP8
    quantisation, expert sort) compile here on a fresh machine, once (SGLang's JIT cache is shared by the
    compile workers, behind its own lock)."""
    import torch

    kernel = kernel or KERNELS["moe"]
    t = time.perf_counter()
    for precision in dict.fromkeys(s.precision for s in shapes):
        small = min((x for x in shapes if x.precision == precision), key=lambda x: x.weight_bytes())
        problem = kernel.problem(small, [64])
        for M in (1, 64):
            out = problem.call(kernel.pick(small, M)[0], M)
            torch.cuda.synchronize()
            if not out.isfinite().all():
                raise RuntimeError(f"{kernel.what} gave non-finite output ({precision}, M={M})")
        problem.free()
    log(f"{kernel.what} runs; warm-up {time.perf_counter() - t:.0f}s")


def _us(x) -> str:
    return "n/a" if x is None else f"{x:.1f}us"


# ------------------------------------------------------------------------------------------- kernels tuned
@dataclass(frozen=True)
class Kernel:
    """What the tuner needs of one SGLang Triton kernel: its shapes, search space, timed problem, SGLang's own
    pick, the Triton kernels a compile worker builds, the package folder its files go to, and the output names."""

    name: str
    what: str
    shapes: object
    candidates: object
    problem: object
    pick: object
    kernel_names: tuple[str, ...]
    configs: str
    outputs: tuple[str, str, str]

    def triton_kernels(self) -> list:
        import importlib

        found = []
        for ref in self.kernel_names:
            module, _, attr = ref.partition(":")
            found.append(getattr(importlib.import_module(module), attr))
        return found

    def config_module(self):
        import importlib

        return importlib.import_module(self.configs)


KERNELS = {
    "moe": Kernel(
        "moe",
        "fused_experts",
        model_shapes,
        candidates,
        Problem,
        sglang_pick,
        ("sglang.kernels.ops.moe.fused_moe_triton_kernels:fused_moe_kernel",),
        "sglang_ernie55.kernels.moe_configs",
        (BUNDLE, TARBALL, LOG),
    ),
    "linear": Kernel(
        "linear",
        "the block-FP8 GEMM",
        linear_shapes,
        linear_candidates,
        LinearProblem,
        linear_pick,
        (
            "sglang.kernels.ops.gemm.fp8_kernel:_w8a8_block_fp8_matmul",
            "sglang.kernels.ops.gemm.fp8_kernel:_w8a8_block_fp8_matmul_hopper",
            "sglang.kernels.ops.gemm.fp8_kernel:_reduce_block_fp8_split_k",
        ),
        "sglang_ernie55.kernels.fp8_linear_configs",
        ("tune_fp8_linear.json", "fp8_linear_configs.tar", "tune_fp8_linear.log"),
    ),
}
KERNEL_HELP = (
    "moe: the routed experts' fused-MoE kernel (default); linear: SGLang's Triton block-FP8 GEMM of the "
    "Linears (what serves them where DeepGEMM does not)"
)


# ------------------------------------------------------------------------------------------- tune
def tune(args) -> int:
    global _LOG_FILE
    import torch
    import triton

    kernel = KERNELS[args.kernel]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _LOG_FILE = open(out / kernel.outputs[2], "w")
    deadline = _T0 + args.budget_s
    stage1_deadline, refine_deadline = deadline - 0.15 * args.budget_s, deadline - 0.06 * args.budget_s
    if not torch.cuda.is_available():
        log("tune needs a CUDA GPU")
        return 2
    compiler = Compiler(args.workers, kernel.name)  # workers start importing while this process does
    device_name = torch.cuda.get_device_name()
    batch_sizes = sorted(set(args.batch_sizes))
    init_sglang()
    import sglang

    shapes = kernel.shapes(device_name)
    if args.shapes:
        keep = {int(x) for x in args.shapes.split(",")}
        shapes = [s for i, s in enumerate(shapes) if i in keep]
    log(
        f"{device_name}: triton {triton.__version__}, torch {torch.__version__}, sglang {sglang.__version__}; "
        f"{len(shapes)} shapes x {len(batch_sizes)} batch sizes, budget {args.budget_s:.0f}s, "
        f"{args.workers} compile workers"
    )
    tuners = []
    for i, s in enumerate(shapes):
        log(f"  shape {i}: {s.describe} -> {s.file_name(device_name)} ({', '.join(s.used_by)})")
        # compile jobs in the order stage 1 times them: per M ascending, SGLang's pick first
        per_cfg: dict[tuple, tuple[dict, list[int]]] = {}
        for M in batch_sizes:
            for cfg in [kernel.pick(s, M)[0], *kernel.candidates(s, M)]:
                per_cfg.setdefault(cfg_key(cfg), (cfg, []))[1].append(M)
        for cfg, ms in per_cfg.values():
            compiler.submit(i, s, cfg, ms)
        tuners.append(ShapeTuner(i, s, batch_sizes, compiler, kernel))
    log(f"{len(compiler.jobs)} (shape, config) compile jobs queued")
    warm_up(shapes, kernel)

    for t in tuners:
        log(f"shape {t.i}: {t.shape.label}")
        t.stage1(stage1_deadline)
        t.queue_refinement()
    compiler.close(stage1_deadline)
    for t in tuners:
        t.refine_and_confirm(refine_deadline, deadline)

    bundle = write_outputs(
        out, [(t.shape, t.rows, t.complete) for t in tuners], device_name, batch_sizes, kernel
    )
    print_tables(bundle)
    _LOG_FILE.close()
    return 0 if all(sh["complete"] for sh in bundle["shapes"]) else 1


def write_outputs(out: Path, results, device_name: str, batch_sizes, kernel: Kernel | None = None) -> dict:
    import sglang
    import torch
    import triton

    from sglang_ernie55.kernels import moe_configs

    kernel = kernel or KERNELS["moe"]
    bundle_name, tarball, log_name = kernel.outputs
    folder = moe_configs.version_dir(triton.__version__)
    bundle = dict(
        kernel=kernel.name,
        device_name=device_name,
        triton=triton.__version__,
        torch=torch.__version__,
        sglang=sglang.__version__,
        folder=folder,
        batch_sizes=list(batch_sizes),
        shapes=[],
    )
    for s, rows, complete in results:
        complete = complete and [r.M for r in rows] == list(batch_sizes) and all(r.tuned_config for r in rows)
        bundle["shapes"].append(
            dict(
                file=s.file_name(device_name),
                complete=complete,
                shape=asdict(s),
                configs={str(r.M): r.tuned_config for r in rows if r.tuned_config},
                rows=[
                    dict(
                        M=r.M,
                        baseline_source=r.baseline_source,
                        baseline_us=r.baseline_us,
                        baseline_config=r.baseline_config,
                        tuned_us=r.tuned_us,
                        tuned_config=r.tuned_config,
                        timed=len(r.timed),
                    )
                    for r in rows
                ],
            )
        )
    (out / bundle_name).write_text(json.dumps(bundle, indent=1) + "\n")
    with tarfile.open(out / tarball, "w") as tar:
        for sh in bundle["shapes"]:
            if sh["complete"]:
                data = config_text(sh["configs"]).encode()
                info = tarfile.TarInfo(f"{folder}/{sh['file']}")
                info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
                tar.addfile(info, io.BytesIO(data))
    log(f"wrote {out / bundle_name}, {out / tarball}, {out / log_name}")
    return bundle


def config_text(configs: dict) -> str:
    """A config file as SGLang's own are laid out: batch sizes ascending, 4-space indent."""
    return json.dumps({str(m): configs[str(m)] for m in sorted(map(int, configs))}, indent=4) + "\n"


def print_tables(bundle: dict) -> None:
    linear = bundle.get("kernel") == "linear"
    keys = KEY_ORDER + (("SPLIT_K", "SWAP_AB") if linear else ())
    for sh in bundle["shapes"]:
        s = sh["shape"]
        log("")
        log(
            f"{sh['file']} ({'complete' if sh['complete'] else 'INCOMPLETE: not installed'}; {', '.join(s['used_by'])})"
        )
        head = "BM, BN, BK, G, warps, stages" + (", split-K, swap-AB" if linear else "")
        log(f"| M | SGLang's pick | SGLang us | tuned us | speedup | tuned config ({head}) |")
        log("| ---: | --- | ---: | ---: | ---: | --- |")
        for r in sh["rows"]:
            b, t, c = r["baseline_us"], r["tuned_us"], r["tuned_config"]
            sp = f"{b / t:.2f}x" if b and t else "n/a"
            defaults = {"SPLIT_K": 1, "SWAP_AB": False}
            cs = ", ".join(str(c.get(k, defaults.get(k))) for k in keys) if c else "n/a"
            log(f"| {r['M']} | {r['baseline_source']} | {_us(b)[:-2]} | {_us(t)[:-2]} | {sp} | {cs} |")


# ------------------------------------------------------------------------------------------- install / plan
def install(args) -> int:
    bundle = json.loads(Path(args.bundle).read_text())
    configs = KERNELS[bundle.get("kernel", "moe")].config_module()
    dest = Path(args.dest) if args.dest else configs.CONFIG_DIR
    folder = dest / bundle["folder"]
    wrote, bad = [], []
    for sh in bundle["shapes"]:
        if not sh["complete"] and not args.allow_partial:
            print(f"skip {sh['file']}: incomplete (tuning ran out of time; --allow-partial writes it anyway)")
            continue
        if not sh["configs"]:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / sh["file"]
        previous = path.read_text() if path.exists() else None
        merged = dict(sh["configs"])
        kept = []
        if previous is not None and not args.replace:
            # a bundle of a few batch sizes keeps the file's rows for the others
            old = json.loads(previous)
            kept = sorted((m for m in old if m not in merged), key=int)
            merged = {**old, **merged}
        path.write_text(config_text(merged))
        problems = configs.check_file(path)
        if problems and previous is not None:
            path.write_text(previous)  # nothing half-written: an invalid bundle leaves the file as it was
        (bad if problems else wrote).append((path, problems))
        if kept and not problems:
            print(
                f"kept {path.name}'s rows for M {', '.join(kept)} (not in the bundle; --replace drops them)"
            )
    for path, _ in wrote:
        print(f"wrote {path}")
    for path, problems in bad:
        print(f"INVALID {path}: {problems}")
    return 1 if bad else 0


def plan(args) -> int:
    kernel = KERNELS[args.kernel]
    shapes = kernel.shapes(args.device_name)
    total = 0
    for i, s in enumerate(shapes):
        counts = {M: len(kernel.candidates(s, M)) for M in args.batch_sizes}
        total += sum(counts.values())
        print(f"shape {i}: {s.describe}, weights {s.weight_bytes() / 2**30:.3f} GiB ({', '.join(s.used_by)})")
        print(f"  file: {s.file_name(args.device_name)}")
        print("  candidates per M: " + ", ".join(f"{M}: {n}" for M, n in counts.items()))
    print(f"{total} (shape, M, config) timings before GROUP_SIZE_M refinement")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tune", help="time the search space on this GPU and write the outputs into --out")
    t.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder (default: $OUT)")
    t.add_argument(
        "--budget-s", type=float, default=420.0, help="wall time for the whole command (default 420)"
    )
    t.add_argument(
        "--workers", type=int, default=max(0, min(14, (os.cpu_count() or 2) - 2)), help="compile workers"
    )
    t.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    t.add_argument("--shapes", default="", help="comma-separated shape indices (see `plan`); default all")
    t.add_argument("--kernel", choices=sorted(KERNELS), default="moe", help=KERNEL_HELP)
    i = sub.add_parser(
        "install", help="write a tune bundle's complete shapes into the package's config folder"
    )
    i.add_argument("bundle")
    i.add_argument(
        "--dest", default=None, help="config folder (default: the package's folder for the bundle's kernel)"
    )
    i.add_argument("--allow-partial", action="store_true")
    i.add_argument(
        "--replace",
        action="store_true",
        help="write each file as the bundle has it (default: merge, keeping the file's other batch sizes)",
    )
    p = sub.add_parser("plan", help="list the shapes, file names and search-space sizes (no GPU needed)")
    p.add_argument("--device-name", default="NVIDIA H200")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    p.add_argument("--kernel", choices=sorted(KERNELS), default="moe", help=KERNEL_HELP)
    args = ap.parse_args(argv)
    return {"tune": tune, "install": install, "plan": plan}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
