"""A CPU platform for verl 0.9.1, registered through verl's own plugin registry
(``PlatformRegistry.register``, selected with ``VERL_PLATFORM=cpu``): verl ships platforms for
NVIDIA, Ascend and AMD only and falls back to NVIDIA (``cuda``, NCCL) when none is found, so its
training worker cannot start on a CPU-only torch (``Distributed package doesn't have NCCL built
in``). With this platform its FSDP engine runs on CPU over gloo, one process (the test's
``TrainingWorker`` step)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, List, Optional, Tuple

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


class _CpuDevice:
    """``torch.cpu`` with the memory counters verl's metrics read from an accelerator's module
    (CPU memory is not counted per device: 0)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith(('max_memory', 'memory_', 'reset_peak', 'reset_max')):
            return lambda *args, **kwargs: 0
        if name == 'mem_get_info':
            return lambda *args, **kwargs: (0, 0)
        if name == 'get_device_name':
            return lambda *args, **kwargs: 'cpu'
        return getattr(torch.cpu, name)


@PlatformRegistry.register(platform='cpu')
class PlatformCPU(PlatformBase):
    device_name = 'cpu'
    vendor_name = 'cpu'
    device_module = _CpuDevice()

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> Any:
        # verl moves tensors with ``.to(get_device_id())``: an int there means an accelerator
        return 'cpu'

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: Optional[int] = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> Tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return 'gloo'

    def visible_devices_envvar(self) -> str:
        return 'CUDA_VISIBLE_DEVICES'

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return 'CPU'

    def ray_noset_envvars(self) -> List[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def register_cpu_engine() -> None:
    """verl registers its FSDP engine for ``cuda`` and ``npu`` devices only; the same class for
    ``cpu`` (through verl's ``EngineRegistry``), so a ``TrainingWorker`` finds it on this platform."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if 'cpu' not in EngineRegistry._engines['language_model'].get('fsdp', {}):
        EngineRegistry.register(model_type='language_model', backend=['fsdp', 'fsdp2'], device='cpu')(FSDPEngineWithLMHead)
