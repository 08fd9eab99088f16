"""ECHO speculative decoding through SGLang's EAGLE/NEXTN path: the patches that wire the draft in.

The draft architecture and the target->draft hidden width (ModelConfig), the draft's attention backends,
the weight sharing with the target and the draft-extend CUDA graph; each is a row of patches.py and falls
through to SGLang for every other model. The draft's KV pool is built by the one pool patch of
`sglang_ernie55.mem_cache`; design: docs/echo.md.
"""

from __future__ import annotations

import logging
import time

from ..arch import architecture, is_echo_draft, is_ernie55
from ..configuration import ARCH_ECHO, ARCH_MAIN

logger = logging.getLogger(__name__)
SHARE_LOG = "ECHO draft attached:"
GRAPH_LOG = "ECHO draft:"

# SGLang speculative algorithms whose draft for this architecture is ECHO (after NEXTN -> EAGLE).
ECHO_ALGORITHMS = (None, "EAGLE", "NEXTN")


# ----------------------------------------------------------------------------------- hooks
def after_config_draft_model(result, self, *args, **kwargs):
    """ModelConfig of the draft: `Ernie5_5_MoeForCausalLM` -> `Ernie5_5MoeMTPModel` (ECHO ships in the
    target checkpoint, so the draft path is the model path and config.json names the main arch)."""
    if (
        self.is_draft_model
        and architecture(self.hf_config) == ARCH_MAIN
        and getattr(self, "speculative_algorithm", None) in ECHO_ALGORITHMS
    ):
        self.hf_config.architectures[0] = ARCH_ECHO
    return result


def around_resolve_spec_hidden_size(original, hf_config, hidden_size, hc_mult, *args, **kwargs):
    """ERNIE-5.5 hands the draft all n residual streams (n*H wide; ECHO's h_proj reads each stream).
    The PP width (`hc_hidden_size`) stays None: pipeline parallelism is refused for this model."""
    if is_ernie55(hf_config) and hc_mult > 1:
        return hidden_size * hc_mult, None
    return original(hf_config, hidden_size, hc_mult, *args, **kwargs)


def around_create_decode_backend(original, self, *args, **kwargs):
    if not is_echo_draft(self.draft_model_runner.model_config.hf_config):
        return original(self, *args, **kwargs)
    if self.speculative_num_steps <= 1:
        return None  # one draft step comes from draft-extend alone (as SGLang does for every backend)
    from ..attention.draft_backend import EchoMultiStepDraftBackend

    return EchoMultiStepDraftBackend(self.draft_model_runner, self.topk, self.speculative_num_steps)


def around_create_draft_extend_backend(original, self, *args, **kwargs):
    if not is_echo_draft(self.draft_model_runner.model_config.hf_config):
        return original(self, *args, **kwargs)
    from ..attention.draft_backend import EchoDraftAttnBackend

    return EchoDraftAttnBackend(self.draft_model_runner)


def around_build_resolved_backend(original, *args, model_runner, **kwargs):
    """The draft ModelRunner builds a backend of its own from the attention-backend name (`ernie55`, whose
    target backend refuses the draft pool); the ECHO draft runner gets the window-only draft backend."""
    if getattr(model_runner, "is_draft_worker", False) and is_echo_draft(model_runner.model_config.hf_config):
        from ..attention.draft_backend import EchoDraftAttnBackend

        return EchoDraftAttnBackend(model_runner)
    return original(*args, model_runner=model_runner, **kwargs)


def after_init_lm_head(result, self, *args, **kwargs):
    """EagleDraftWorker: both models are loaded and no draft forward has run yet; bind the target's
    modules into the ECHO draft and prove the sharing (same tensors, by data pointer)."""
    draft = self.draft_runner.model
    if type(draft).__name__ != ARCH_ECHO:
        return result
    target = self.target_worker.model_runner.model
    draft.attach_target(target)
    shared = check_shared(draft, target)
    tparams = dict(target.named_parameters())
    shared_bytes = sum(tparams[n].numel() * tparams[n].element_size() for n in shared)
    own_bytes = sum(p.numel() * p.element_size() for p in draft.parameters())
    logger.info(
        f"{SHARE_LOG} shared_tensors={len(shared)} shared_bytes={shared_bytes} draft_owned_bytes={own_bytes} "
        f"(the draft runs the target's last layer, hc_head, embedding and lm_head by data pointer)"
    )
    return result


def echo_draft_extend_graph_wanted(worker) -> bool:
    """Whether the ECHO draft's DRAFT_EXTEND_V2 forward should be captured by SGLang's
    `EAGLEDraftExtendCudaGraphRunner`: an ECHO draft with its `EchoDraftAttnBackend`, and every condition
    under which SGLang's `EagleDraftWorker._capture_cuda_graphs` captures the draft extend for a backend of
    its allow-list on CUDA (graphs on, not CPU, not MindSpore, the target on a `cuda` device, an in-tree
    platform: an out-of-tree one picks its own runner through `get_speculative_graph_runner_cls`, and
    `SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH` unset). Reads SGLang's module state at call time."""
    from sglang.srt.speculative import eagle_worker_v2 as ew2

    from ..attention.draft_backend import EchoDraftAttnBackend

    runner = getattr(worker, "draft_runner", None)
    if runner is None or not is_echo_draft(runner.model_config.hf_config):
        return False
    if not isinstance(getattr(worker, "draft_extend_attn_backend", None), EchoDraftAttnBackend):
        return False
    if ew2._is_cpu or ew2.check_cuda_graph_backend(ew2.Phase.DECODE, ew2.Backend.DISABLED):
        return False
    if ew2.get_model().model_impl == "mindspore" or ew2.current_platform.is_out_of_tree():
        return False
    if ew2.envs.SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH.get():
        return False
    return str(worker.target_worker.device) == "cuda"


def capture_echo_draft_extend_graph(worker) -> None:
    """SGLang's own draft-extend capture step, for the ECHO draft: `EAGLEDraftExtendCudaGraphRunner(worker)`
    with SGLang's log lines and graph memory / time accounting (`_capture_cuda_graphs`'s last block)."""
    from sglang.srt.speculative import eagle_worker_v2 as ew2

    graph_backend = ew2.get_exec().graph.cuda_graph_config.decode.backend
    capture_bs, _ = ew2.get_batch_sizes_to_capture(worker.draft_runner)
    tic = time.perf_counter()
    before = ew2.get_available_gpu_memory(worker.device, worker.gpu_id)
    ew2.log_info_on_rank0(
        ew2.logger,
        f"Capture draft extend CUDA graph begin. backend={graph_backend}, "
        f"num_tokens_per_req={worker.speculative_num_draft_tokens}, bs={capture_bs}, avail mem={before:.2f} GB",
    )
    runner = ew2.EAGLEDraftExtendCudaGraphRunner(worker)
    worker.cuda_graph_runner_for_draft_extend = runner
    after = ew2.get_available_gpu_memory(worker.device, worker.gpu_id)
    elapsed = time.perf_counter() - tic
    mem, secs = worker._specialized_graph_memory_usage, worker._specialized_graph_time_usage
    mem["draft_extend"] = mem.get("draft_extend", 0.0) + before - after
    secs["draft_extend"] = secs.get("draft_extend", 0.0) + elapsed
    ew2.log_info_on_rank0(
        ew2.logger,
        f"Capture draft extend CUDA graph end. elapsed={elapsed:.2f} s, mem usage={(before - after):.2f} GB, "
        f"avail mem={after:.2f} GB.",
    )
    logger.info(
        f"{GRAPH_LOG} draft-extend CUDA graph captured by {type(runner).__name__} "
        f"(bs={capture_bs}, rows per request={worker.speculative_num_draft_tokens})"
    )


def around_capture_cuda_graphs(original, self, *args, **kwargs):
    """EagleDraftWorker: SGLang captures the draft decode and then the draft extend, the latter only for
    attention backends of a hard-coded isinstance allow-list; the ECHO draft's backend is not in it. After
    SGLang's own capture, an ECHO draft that SGLang left without a draft-extend runner gets SGLang's runner,
    under the conditions SGLang applies to its listed backends. Every other draft: SGLang's result as is."""
    result = original(self, *args, **kwargs)
    sglang_chose = getattr(self, "cuda_graph_runner_for_draft_extend", None) is not None
    if not sglang_chose and echo_draft_extend_graph_wanted(self):
        capture_echo_draft_extend_graph(self)
    return result


def check_shared(draft, target) -> dict[str, int]:
    """Every tensor the draft runs on besides `echo.*` is the target's tensor (same data pointer);
    returns {target parameter name: data_ptr}. Raises naming any that is not."""
    tparams = dict(target.named_parameters())
    own = {p.data_ptr() for p in draft.parameters()}
    used = draft.shared_parameter_names()
    bad = [n for n in used if n not in tparams]
    mods = dict(target.named_modules())
    L = target.config.num_hidden_layers - 1
    layer_ptrs = {n: p.data_ptr() for n, p in mods[f"model.layers.{L}"].named_parameters()}
    draft_layer_ptrs = {n: p.data_ptr() for n, p in draft.decoder_layer.named_parameters()}
    bad += [f"model.layers.{L}.{n}" for n, ptr in draft_layer_ptrs.items() if layer_ptrs.get(n) != ptr]
    bad += [n for n in used if n in tparams and tparams[n].data_ptr() in own]
    if bad:
        raise RuntimeError(f"ECHO draft: these tensors are not shared with the target: {bad[:20]}")
    return {n: tparams[n].data_ptr() for n in used}
