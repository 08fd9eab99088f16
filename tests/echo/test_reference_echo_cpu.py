"""The reference's ECHO rounds (sglang_ernie55.reference.echo) against direct recomputation, and the greedy
speculative decoder against plain greedy decoding (random weights and the ECHO-exact construction)."""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_ernie55.configuration import tiny_config
from sglang_ernie55.reference import echo as E
from sglang_ernie55.reference.mhc import hc_head
from sglang_ernie55.reference.model import build_reference


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def ref(cfg):
    return build_reference(cfg, seed=3, dtype=torch.float32)


def _direct_entry(ref, stream, token, keys_streams, keys_tokens, pos0):
    """Entry at position pos0 + len(keys)-1 computed from scratch: echo_forward without a cache over the
    whole history of entries (positions pos0 ..), which must start at 0 (echo_forward's cacheless form)."""
    assert pos0 == 0
    s = torch.cat([keys_streams, stream[None]])
    t = torch.cat([keys_tokens, torch.tensor([token])])
    out = ref.echo_forward(s, t)
    return out.logits[-1], out.streams[-1]


@pytest.mark.parametrize("T,steps", [(1, 3), (19, 2), (127, 3), (130, 1), (140, 3)])
def test_draft_round_equals_direct_recomputation(ref, cfg, T, steps):
    """Chain step k feeds the previous entry's own pre-hc_head streams back and sits at position T-1+k;
    recomputing every chain entry from scratch over the full entry history gives the same logits. The
    lengths put the chain across the 128-token window (T = 127, 130, 140)."""
    g = torch.Generator().manual_seed(T)
    streams = torch.randn(T, cfg.hc_mult, cfg.hidden_size, generator=g)
    nxt = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    cache = ref.new_echo_cache()
    rnd = E.draft_round(ref, cache, streams, nxt, 0, steps)
    assert len(rnd.tokens) == steps and rnd.positions == list(range(T - 1, T - 1 + steps))
    hist_s, hist_t = streams, nxt
    torch.testing.assert_close(rnd.logits[0], ref.echo_forward(streams, nxt).logits[-1], rtol=1e-4, atol=1e-4)
    for k in range(1, steps):
        lg, st = _direct_entry(ref, rnd.streams[k - 1], rnd.tokens[k - 1], hist_s, hist_t, 0)
        torch.testing.assert_close(rnd.logits[k], lg, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rnd.streams[k], st, rtol=1e-4, atol=1e-4)
        assert rnd.tokens[k] == int(torch.argmax(lg))
        hist_s = torch.cat([hist_s, rnd.streams[k - 1][None]])
        hist_t = torch.cat([hist_t, torch.tensor([rnd.tokens[k - 1]])])
    # the caller's cache holds the T extend entries only (the chain ran on a copy)
    assert int(cache.pos[-1]) == T - 1


def test_chain_uses_draft_streams_not_target_streams(ref, cfg):
    """A chain entry fed the *target* stream instead of the draft's own gives different logits: the test
    above would catch a worker that feeds the wrong hidden states back."""
    g = torch.Generator().manual_seed(7)
    streams = torch.randn(5, cfg.hc_mult, cfg.hidden_size, generator=g)
    nxt = torch.randint(0, cfg.vocab_size, (5,), generator=g)
    rnd = E.draft_round(ref, ref.new_echo_cache(), streams, nxt, 0, 2)
    wrong, _ = _direct_entry(ref, streams[-1], rnd.tokens[0], streams, nxt, 0)
    assert (rnd.logits[1] - wrong).abs().max() > 1e-2


def test_echo_reads_the_last_layer_and_hc_head(ref):
    """The draft path is the backbone's last layer and the shared hc_head (same modules, no copies)."""
    assert ref.echo is not None and not any("layers" in n for n, _ in ref.echo.named_parameters())
    R = torch.randn(3, ref.config.hc_mult, ref.config.hidden_size)
    hc = ref.model.hc_head
    y = hc_head(R, hc.fn, hc.base, hc.scale, hc_eps=ref.config.hc_eps, rms_eps=ref.config.rms_norm_eps)
    torch.testing.assert_close(
        ref.head(R, ref.echo.norm), (ref.echo.norm(y) @ ref.lm_head.weight.float().t())
    )


def test_greedy_speculative_equals_greedy_random_weights(ref):
    """Random weights: drafts are mostly rejected, and the output is still exactly plain greedy."""
    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(11))
    want = ref.generate_greedy(prompt, 16)
    got = E.greedy_speculative(ref, prompt, 16, 2)
    assert got.tokens == want
    assert all(1 <= a <= 3 for a in got.accept_lengths)


@pytest.fixture(scope="module")
def exact(cfg):
    m = build_reference(cfg, seed=5, dtype=torch.bfloat16)
    sigma = E.make_echo_exact_(m, seed=5)
    return m, sigma


@pytest.fixture(scope="module")
def exact_greedy(exact):
    """Prompt of 100 tokens, 40 new: the generation crosses the 128-token window and compression block."""
    m, _ = exact
    prompt = torch.randint(3, 512, (100,), generator=torch.Generator().manual_seed(1))
    return prompt, m.generate_greedy(prompt, 40)


def test_echo_exact_target_is_the_permutation_bigram(exact, exact_greedy):
    _, sigma = exact
    prompt, want = exact_greedy
    assert want[0] == int(sigma[prompt[-1]]) and all(
        want[i + 1] == int(sigma[want[i]]) for i in range(len(want) - 1)
    )


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 3])
def test_echo_exact_checkpoint_accepts_everything(exact, exact_greedy, steps):
    """The ECHO-exact construction: every draft is accepted (acceptance = steps + 1 per round) across the
    128-token window and compression block, and the output is exactly plain greedy."""
    m, _ = exact
    prompt, want = exact_greedy
    got = E.greedy_speculative(m, prompt, len(want), steps)
    assert got.tokens == want
    full = got.accept_lengths[:-1]
    assert full and all(a == steps + 1 for a in full), got.accept_lengths


def test_echo_exact_draft_is_not_trivially_the_target(exact):
    """Under the construction the draft logits still depend on the target streams (h_proj != 0), though
    not enough to move the argmax. (Scaling the streams would not do: hnorm removes the scale.)"""
    m, _ = exact
    cfg = m.config
    R = torch.randn(2, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([5, 9])
    a = m.echo_forward(R, t).logits
    b = m.echo_forward(torch.randn(R.shape, generator=torch.Generator().manual_seed(3)), t).logits
    assert (a - b).abs().max() > 1e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_round_does_not_touch_callers_cache_beyond_extend(ref, cfg):
    cache = ref.new_echo_cache()
    s = torch.randn(4, cfg.hc_mult, cfg.hidden_size)
    t = torch.randint(0, cfg.vocab_size, (4,))
    E.draft_round(ref, cache, s, t, 0, 3)
    again = ref.new_echo_cache()
    ref.echo_forward(s, t, cache=again, start_pos=0)
    torch.testing.assert_close(cache.kv, again.kv)
    assert copy.deepcopy(cache).pos.tolist() == [0, 1, 2, 3]


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def exact_copy(request, tmp_path_factory):
    """A random tiny checkpoint and its ECHO-exact copy (`echo_exact_copy`, the shard-by-shard construction
    the full-width serving benchmark uses), in both checkpoint formats."""
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    d = tmp_path_factory.mktemp(f"exact-{request.param}")
    src = make_checkpoint(d / "src", dtype=request.param, seed=4)
    sigma = E.echo_exact_copy(src, d / "exact", seed=6)
    return src, d / "exact", sigma


def test_echo_exact_copy_accepts_everything(exact_copy):
    """The copy read back by the reference: the target is the permutation bigram, every ECHO draft of 3 steps
    is accepted across the 128-token window and compression block, and the output is plain greedy."""
    from tests.serving.server_harness import load_reference

    _, dst, sigma = exact_copy
    _, m = load_reference(dst, "cpu")
    prompt = torch.randint(3, 512, (100,), generator=torch.Generator().manual_seed(2))
    want = m.generate_greedy(prompt, 40)
    assert want[0] == int(sigma[prompt[-1]]) and all(
        want[i + 1] == int(sigma[want[i]]) for i in range(len(want) - 1)
    )
    got = E.greedy_speculative(m, prompt, len(want), 3)
    assert got.tokens == want
    assert got.accept_lengths[:-1] and all(a == 4 for a in got.accept_lengths[:-1]), got.accept_lengths


def test_echo_exact_copy_changes_only_the_construction(exact_copy):
    """Every stored tensor outside the construction is bit-identical to the source; FP8 output projections
    keep their codes and scale their block scales by eps; the copy is a complete checkpoint."""
    from safetensors import safe_open

    from sglang_ernie55.checkpoint.loader import CheckpointReader

    src, dst, _ = exact_copy
    r = CheckpointReader(dst)
    r.check()
    assert (dst / "tokenizer.json").is_file() and (dst / "echo_exact.json").is_file()
    rebuilt = ("lm_head.", "model.norm.", "echo.norm.", "echo.enorm.", "echo.e_proj.", "echo.h_proj.")
    scaled = changed = 0
    for file in r.files:
        with safe_open(str(src / file), "pt") as a, safe_open(str(dst / file), "pt") as b:
            assert set(a.keys()) == set(b.keys())
            for name in a.keys():
                x, y = a.get_tensor(name), b.get_tensor(name)
                base = name.removesuffix("_scale_inv")
                if base.endswith(E.ECHO_EXACT_SCALED):
                    if x.dtype == torch.float8_e4m3fn:
                        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
                    else:
                        torch.testing.assert_close(y.float(), x.float() * 0.02, rtol=8e-3, atol=0)
                    scaled += 1
                elif name.startswith(rebuilt):
                    changed += 1
                else:
                    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
    assert scaled >= 5 and changed >= 6, (scaled, changed)
    torch.testing.assert_close(
        r.tensor("echo.e_proj.weight"), torch.eye(r.config.hidden_size), rtol=0, atol=0
    )


def test_echo_exact_copy_scales_fp8_weights_whose_scale_sits_in_another_shard(tmp_path):
    """A checkpoint may store an FP8 weight and its block scale in different shards: the codes stay, the scale
    takes eps, wherever each of them is."""
    import json

    from safetensors.torch import load_file, save_file

    from sglang_ernie55.checkpoint.loader import CheckpointReader
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    src = make_checkpoint(tmp_path / "src", dtype="fp8", seed=1)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    wmap = index["weight_map"]
    moved = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    home = wmap[moved]
    other = next(f for f in sorted(set(wmap.values())) if f != home)
    a, b = load_file(str(src / home)), load_file(str(src / other))
    b[moved] = a.pop(moved)
    save_file(a, str(src / home), metadata={"format": "pt"})
    save_file(b, str(src / other), metadata={"format": "pt"})
    wmap[moved] = other
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    E.echo_exact_copy(src, tmp_path / "exact", eps=0.02)
    name = "model.layers.1.self_attn.o_proj.weight"
    before, after = CheckpointReader(src), CheckpointReader(tmp_path / "exact")
    after.check()
    assert (
        json.loads((tmp_path / "exact" / "model.safetensors.index.json").read_text())["weight_map"][moved]
        == other
    )
    torch.testing.assert_close(after.tensor(name), before.tensor(name) * 0.02, rtol=1e-6, atol=0)
