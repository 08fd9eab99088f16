"""ECHO speculative decoding in the reference: chained draft rounds, a greedy speculative decoder that must
emit exactly `generate_greedy`'s tokens, and the ECHO-exact checkpoint construction (docs/echo.md).

Built only from `Ernie55ReferenceModel.step` / `echo_forward`. SGLang's EAGLE/NEXTN layout: draft entry i
combines the target's streams at position i with token i+1, sits at position i and proposes token i+2.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .model import Ernie55ReferenceModel


@dataclass
class EchoRound:
    tokens: list[int]  # d_1 .. d_S (greedy proposals)
    logits: list[torch.Tensor]  # [V] fp32, the draft logits that proposed each d_k
    streams: list[torch.Tensor]  # [n, H] fp32, the draft pre-hc_head streams of each proposing entry
    positions: list[int]  # draft position of each proposing entry


def draft_round(
    model: Ernie55ReferenceModel,
    cache,
    streams: torch.Tensor,
    next_tokens: torch.Tensor,
    start_pos: int,
    steps: int,
) -> EchoRound:
    """One ECHO round with topk 1; returns the `steps` greedy proposals.

    Draft-extend: entries start_pos .. start_pos+T-1 from the target's `streams` [T, n, H] and `next_tokens`
    [T] extend `cache` (committed positions); the last entry proposes d_1. Then `steps - 1` chained entries on
    a copy of the cache: entry k (position start_pos+T-1+k) takes the previous entry's draft streams and d_k
    and proposes d_{k+1}. The draft attends its own KV, window only."""
    out = model.echo_forward(streams, next_tokens, cache=cache, start_pos=start_pos)
    pos = start_pos + next_tokens.shape[0] - 1
    logits, st = out.logits[-1], out.streams[-1]
    rnd = EchoRound([int(torch.argmax(logits))], [logits], [st], [pos])
    chain = copy.deepcopy(cache)
    for _ in range(steps - 1):
        pos += 1
        tok = torch.tensor([rnd.tokens[-1]], device=next_tokens.device)
        out = model.echo_forward(st[None], tok, cache=chain, start_pos=pos)
        logits, st = out.logits[-1], out.streams[-1]
        rnd.tokens.append(int(torch.argmax(logits)))
        rnd.logits.append(logits)
        rnd.streams.append(st)
        rnd.positions.append(pos)
    return rnd


@dataclass
class SpecResult:
    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify (1 .. steps + 1)
    rounds: list[EchoRound] = field(default_factory=list)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)


@torch.no_grad()
def greedy_speculative(
    model: Ernie55ReferenceModel, prompt_ids: torch.Tensor, max_new_tokens: int, steps: int
) -> SpecResult:
    """Greedy decoding with ECHO drafts (chain, `steps` drafts per round), as SGLang's EAGLE worker does it.

    Committed tokens t_0 .. t_{L-1} have target KV; b = t_L is the target's latest token (not yet in
    its KV). A round drafts d_1..d_S, verifies [b, d_1..d_S] at positions L..L+S in one target extend,
    accepts the longest prefix of drafts equal to the target's own argmax, and commits it plus the
    target's next token (the new b). The verify runs on a copy of the target cache and the accepted tokens
    are replayed on the original: the reference caches cannot roll back an open compression block."""
    tcache, dcache = model.new_cache(), model.new_echo_cache()
    out = model.step(prompt_ids, tcache)
    b = int(torch.argmax(out.logits[-1]))
    res = SpecResult([b])
    # draft-extend over the prompt: entry i = target stream i + token i+1 (the last one's token is b)
    d_streams, d_next, d_start = out.streams, torch.cat([prompt_ids[1:], prompt_ids.new_tensor([b])]), 0
    L = prompt_ids.shape[0]
    while len(res.tokens) < max_new_tokens:
        rnd = draft_round(model, dcache, d_streams, d_next, d_start, steps)
        res.rounds.append(rnd)
        cand = prompt_ids.new_tensor([b] + rnd.tokens)
        ver = model.step(cand, copy.deepcopy(tcache))
        target_next = torch.argmax(ver.logits, -1).tolist()  # the target's token after each candidate
        a = 0
        while a < steps and rnd.tokens[a] == target_next[a]:
            a += 1
        accepted, b = cand[: a + 1], int(target_next[a])
        res.accept_lengths.append(a + 1)
        out = model.step(accepted, tcache)  # commit positions L .. L+a
        # next draft-extend: the committed positions, each with the token that follows it
        d_streams, d_next, d_start = out.streams, torch.cat([accepted[1:], accepted.new_tensor([b])]), L
        L += a + 1
        res.tokens += accepted[1:].tolist() + [b]
    res.tokens = res.tokens[:max_new_tokens]
    return res


# ----------------------------------------------------------------------------- ECHO-exact checkpoint


# the sublayer output projections `make_echo_exact_` scales by eps (logical tensor names end with these)
ECHO_EXACT_SCALED = (
    "self_attn.wo_b.weight",
    "self_attn.o_proj.weight",
    "mlp.down_proj.weight",
    "mlp.latent_up.weight",
    "shared_experts.down_proj.weight",
)


@torch.no_grad()
def make_echo_exact_(model: Ernie55ReferenceModel, seed: int = 0, eps: float = 0.02) -> torch.Tensor:
    """Turn `model` (random weights, any dtype) into one whose ECHO draft proposes exactly the target's
    next-next token, so greedy acceptance is steps + 1 by construction. Returns the permutation sigma.

    Construction (a "permutation bigram" model): every sublayer's output projection is scaled by `eps`
    (HCA wo_b, MLA o_proj, dense down_proj, MoE latent_up and shared-expert down_proj), so the final
    streams stay within a few percent of the token's embedding e(t) in every stream (mHC mixes equal
    streams into themselves: C's columns sum to 1). lm_head row v is e(sigma^-1(v)) / rms, and the
    final norms are 1, so the target's argmax after token t is sigma(t) with a margin of ~H against
    O(sqrt(H)) cross terms. ECHO: enorm = 1, e_proj = identity, h_proj = `eps` * random (the target
    streams still enter), so the draft entry holding token t_{i+1} also argmaxes to sigma(t_{i+1}) =
    t_{i+2}, the target's next-next token. All attention, MoE routing and cache paths still run at full
    cost (only output projections are small), so timings on it are representative.
    """
    assert model.echo is not None
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    V, H = cfg.vocab_size, cfg.hidden_size
    sigma = torch.randperm(V, generator=g)
    E = model.model.embed_tokens.weight.float()
    unit = E / E.pow(2).mean(-1, keepdim=True).sqrt()
    inv = torch.empty_like(sigma)
    inv[sigma] = torch.arange(V)
    model.lm_head.weight.copy_((unit[inv] / H**0.5).to(model.lm_head.weight.dtype))
    for name, p in model.named_parameters():
        if name.endswith(ECHO_EXACT_SCALED):
            p.mul_(eps)
    model.model.norm.weight.fill_(1.0)
    e = model.echo
    e.norm.weight.fill_(1.0)
    e.enorm.weight.fill_(1.0)
    e.e_proj.weight.copy_(torch.eye(H, dtype=e.e_proj.weight.dtype))
    e.h_proj.weight.copy_((torch.randn(H, H, generator=g) * eps * H**-0.5).to(e.h_proj.weight.dtype))
    return sigma


@torch.no_grad()
def echo_exact_copy(src, dst, *, seed: int = 0, eps: float = 0.02, force: bool = False, progress=None):
    """Copy checkpoint `src` (any geometry, bf16 or fp8) to `dst` with `make_echo_exact_`'s construction
    applied, shard by shard, so that it works at full width without building the model in memory.
    Returns sigma (target greedy after token t is sigma[t]; every ECHO draft is accepted).

    Tensors the construction leaves alone are copied bit for bit. FP8 output projections are scaled
    through their block scales (codes unchanged); the new lm_head, ECHO projections and norms are stored
    as the writer stores them. Atomic: `dst` appears complete or not at all."""
    import json
    import shutil
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..checkpoint.loader import CheckpointReader
    from ..checkpoint.spec import SCALE_SUFFIX
    from ..checkpoint.tiny import RECIPE_FILE
    from ..checkpoint.writer import _log, check_free_space, staged_checkpoint_dir, storage_form

    src, dst = Path(src), Path(dst).absolute()
    reader = CheckpointReader(src, progress)
    reader.check()
    cfg, spec, fmt = reader.config, reader.spec, reader.fmt
    if not cfg.num_nextn_predict_layers:
        raise ValueError(f"{src}: the config has no ECHO layer (num_nextn_predict_layers = 0)")
    V, H = cfg.vocab_size, cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    sigma = torch.randperm(V, generator=g)
    inv = torch.empty_like(sigma)
    inv[sigma] = torch.arange(V)

    def lm_head() -> torch.Tensor:
        E = reader.tensor("model.embed_tokens.weight")
        unit = E / E.pow(2).mean(-1, keepdim=True).sqrt()
        return unit[inv] / H**0.5

    new = {
        "lm_head.weight": lm_head,
        "model.norm.weight": lambda: torch.ones(H),
        "echo.norm.weight": lambda: torch.ones(H),
        "echo.enorm.weight": lambda: torch.ones(H),
        "echo.e_proj.weight": lambda: torch.eye(H),
        "echo.h_proj.weight": lambda: torch.randn(H, H, generator=g) * eps * H**-0.5,
    }
    scaled = [n for n in spec if n.endswith(ECHO_EXACT_SCALED)]
    missing = [n for n in new if n not in spec]
    if missing or not scaled:
        raise ValueError(f"{src}: no tensor(s) {missing or list(ECHO_EXACT_SCALED)} to build ECHO-exact from")
    check_free_space(dst, sum(f.stat().st_size for f in src.glob("*.safetensors")))
    with staged_checkpoint_dir(dst, force) as tmp:
        for f in src.iterdir():
            # the random checkpoint's recipe describes the source, not this copy
            if f.is_file() and f.suffix != ".safetensors" and f.name != RECIPE_FILE:
                shutil.copy2(f, tmp / f.name)
        # the stored form of every rebuilt tensor (an FP8 weight and its scale are two names, possibly in two
        # shards); h_proj draws after sigma, as in make_echo_exact_
        stored = {}
        for name, make in new.items():
            stored.update(storage_form(name, make(), spec[name].kind, fmt))
        for k, file in enumerate(reader.files, 1):
            with safe_open(str(src / file), framework="pt", device="cpu") as h:
                tensors = {name: h.get_tensor(name) for name in h.keys()}
            for name, t in tensors.items():
                base = name.removesuffix(SCALE_SUFFIX)
                if name in stored:
                    tensors[name] = stored[name]
                elif base not in scaled:
                    continue
                elif name != base:  # an FP8 block scale: W = codes x scale, so eps goes here
                    tensors[name] = t * eps
                elif t.dtype != torch.float8_e4m3fn:  # FP8 codes stay as they are
                    tensors[name] = (t.float() * eps).to(t.dtype)
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            _log(progress, f"ECHO-exact: wrote {file} ({k}/{len(reader.files)})")
        (tmp / "echo_exact.json").write_text(
            json.dumps({"seed": seed, "eps": eps, "source": str(src)}) + "\n"
        )
    return sigma


def write_echo_exact_checkpoint(
    out, seed: int = 0, eps: float = 0.02, fmt: str = "bf16", force: bool = False
):
    """A tiny checkpoint (tokenizer included) whose ECHO head is exact by construction (`make_echo_exact_`);
    returns (path, sigma)."""
    from ..checkpoint.tiny import preset_config
    from ..checkpoint.writer import write_checkpoint
    from .model import build_reference

    cfg = preset_config("tiny")
    model = build_reference(cfg, seed=seed, dtype=torch.bfloat16)
    sigma = make_echo_exact_(model, seed=seed, eps=eps)
    return write_checkpoint(out, cfg, model.state_dict(), fmt, force=force), sigma
