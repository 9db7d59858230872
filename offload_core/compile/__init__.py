"""Regional torch.compile of a model's repeated blocks, streamed or resident (``apply_block_compile``).

Runs in the process that runs the model's forwards (a stage replica, or a user's process), after
``apply_layer_streaming`` when the model is streamed. See ``blocks`` for why the engine's hooks stay
outside the compiled code and ``buckets`` for the request shapes a compiled block serves.
"""
from offload_core.compile.blocks import BlockCompileError, CompiledBlocks, apply_block_compile
from offload_core.compile.buckets import RequestShape, ShapeBucket, parse_bucket
from offload_core.compile.config import CompileConfig, CompileMode
from offload_core.compile.warmup import BucketWarmup, warm_buckets

__all__ = ["BlockCompileError", "BucketWarmup", "CompileConfig", "CompileMode", "CompiledBlocks", "RequestShape",
           "ShapeBucket", "apply_block_compile", "parse_bucket", "warm_buckets"]
