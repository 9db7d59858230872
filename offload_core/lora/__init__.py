"""LoRA adapters per request, applied unmerged on a model's Linears, resident or streamed.

- ``load_lora(path, name, scale=1.0, prefix="transformer") -> LoraAdapter``: one diffusers/PEFT
  safetensors file (or a folder holding one) on the host; ``LoraError`` if unreadable.
- ``check_fits(adapter, model)``: every target an ``nn.Linear`` of the model with matching shapes
  and one rank, else ``LoraError`` naming the adapter, the module and the mismatch.
- ``apply_lora(model, device, budget_bytes) -> LoraSet``: ``LoraSet.load(adapter) -> LoadedAdapter``
  (checked, copied to the device in each Linear's dtype, LRU eviction over the budget),
  ``loaded()``, ``evict(name)``, ``device_bytes``, ``close()``, and ``rows(per_row)`` around one
  forward: row ``i`` of the batch uses ``per_row[i] = (name, scale)`` or none (``None``: the base
  output, bit for bit). An adapter evicted under the budget is copied back when a forward names it.
- ``lora_flops(rank, linear_shapes, tokens)`` and ``linear_flops(linear_shapes, tokens)``: FLOPs of
  the low-rank terms and of the base Linears over one forward's tokens, for a bench's projection
  at real size (e.g. FLUX.1-dev's 57 blocks' Linears from ``configs``' real shapes, rank 64).

Pure torch (+ safetensors when a file is read; peft is only the tests' reference). Runs where the
model's forwards run (a Denoiser replica).
"""
from offload_core.lora.adapter import LoraAdapter, LoraError, check_fits, linear_flops, load_lora, lora_flops
from offload_core.lora.apply import LoadedAdapter, LoraSet, RowChoice, apply_lora

__all__ = ["LoadedAdapter", "LoraAdapter", "LoraError", "LoraSet", "RowChoice", "apply_lora", "check_fits",
           "linear_flops", "load_lora", "lora_flops"]
