"""Test-only patches that let Colossal-AI's ZeRO path run on a CPU (CI has no GPU).

Colossal-AI 0.5 targets CUDA. On a CPU, as shipped (see ../shared/FACTS.md):

1. `CpuAccelerator` raises on every stream / synchronize / memory call. `LowLevelZeroOptimizer`
   makes such calls around gradient reduction, and both it and `LowLevelZeroPlugin` assert a
   cuda/npu accelerator.
   With streams as no-op contexts and synchronize as a no-op, ZeRO stage 1/2 runs on gloo
   with `overlap_communication=False` (no second stream to overlap with).
2. `CPUAdam` / `HybridAdam` load their x86 kernel through a CUDA extension builder, which
   refuses without CUDA. The kernel is plain C++ (AVX); only its headers mention CUDA. We
   compile `csrc/kernel/x86/cpu_adam.cpp` with `torch.utils.cpp_extension.load` against stub
   headers that map `__half` to `c10::Half`, and hand the module to `CPUAdamLoader`.

None of this is needed, or used, on a CUDA machine. `apply()` is idempotent.

Also here: `MemoryDisk`, an in-memory stand-in for `tensornvme`'s offloader (which does not build
offline), and a `__main__` that runs main.py with the patches, for multi-process runs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_STUB_HEADERS = {
    "cuda.h": "",
    "cuda_runtime_api.h": "",
    "cublas_v2.h": "",
    "cuda_fp16.h": "#pragma once\n#include <c10/util/Half.h>\ntypedef c10::Half __half;\n",
}

_applied = False
_kernel = None


class _NoStream:
    """Stands in for a CUDA stream on a CPU: waiting on it or synchronizing it does nothing."""

    def wait_stream(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _patch_accelerator() -> None:
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    CpuAccelerator.synchronize = lambda self, device=None: None
    CpuAccelerator.Stream = lambda self, device=None, priority=0, **kwargs: _NoStream()
    CpuAccelerator.current_stream = lambda self, device=None: _NoStream()
    CpuAccelerator.default_stream = lambda self, device=None: _NoStream()
    CpuAccelerator.stream = lambda self, stream_: contextlib.nullcontext()
    CpuAccelerator.empty_cache = lambda self: None
    CpuAccelerator.memory_allocated = lambda self, device=None: 0
    CpuAccelerator.max_memory_allocated = lambda self, device=None: 0
    CpuAccelerator.reset_peak_memory_stats = lambda self, device=None: None

    from colossalai.booster.plugin.low_level_zero_plugin import LowLevelZeroPlugin

    LowLevelZeroPlugin.supported_devices = lambda self: ["cuda", "npu", "cpu"]

    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    def dtype_checks_only(self) -> None:  # the shipped check also asserts a cuda/npu accelerator
        for group in self.optim.param_groups:
            for param in group["params"]:
                if not getattr(param, "skip_zero_check", False):
                    assert param.dtype == self._dtype, f"expected {self._dtype} parameters, got {param.dtype}"

    LowLevelZeroOptimizer._sanity_checks = dtype_checks_only


def build_cpu_adam_kernel(build_dir: str | os.PathLike | None = None):
    """JIT-compile Colossal-AI's x86 CPU-Adam kernel without CUDA (about 40 s the first time)."""
    global _kernel
    if _kernel is not None:
        return _kernel
    import colossalai
    from torch.utils.cpp_extension import load

    source = Path(colossalai.__file__).parent / "kernel" / "extensions" / "csrc" / "kernel" / "x86" / "cpu_adam.cpp"
    build_dir = Path(build_dir or os.environ.get("LDM_TEST_KERNEL_DIR", Path.home() / ".cache" / "ldm-cpu-adam"))
    stubs = build_dir / "stub_include"
    stubs.mkdir(parents=True, exist_ok=True)
    for name, text in _STUB_HEADERS.items():
        if not (stubs / name).exists() or (stubs / name).read_text() != text:
            (stubs / name).write_text(text)
    _kernel = load(
        name="cpu_adam_x86",
        sources=[str(source)],
        extra_include_paths=[str(stubs), str(source.parent)],
        extra_cflags=["-O3", "-std=c++17", "-fopenmp", "-march=native", "-Wno-reorder"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
    )
    return _kernel


def _patch_cpu_adam() -> None:
    from colossalai.kernel import kernel_loader

    kernel_loader.CPUAdamLoader.load = lambda self, ext_name=None: build_cpu_adam_kernel()


def apply() -> None:
    """Apply both patches (once per process)."""
    global _applied
    if _applied:
        return
    _patch_accelerator()
    _patch_cpu_adam()
    _applied = True


class MemoryDisk:
    """A stand-in for tensornvme's `DiskOffloader` (which needs liburing, unavailable here): the "disk"
    is a dict of copies keyed, like the real one, by the tensor's id. As with the real offloader,
    writing frees the tensor's storage and reading restores it, so code that forgets to read an
    offloaded state back finds an empty tensor."""

    writes = 0

    def __init__(self, path: str, n_entries: int = 8, backend: str = "aio") -> None:
        self.disk: dict[int, object] = {}

    def sync_write(self, tensor) -> None:
        assert tensor.untyped_storage().size() > 0, "writing a tensor that is already offloaded"
        self.disk[id(tensor)] = tensor.detach().clone()
        tensor.untyped_storage().resize_(0)
        MemoryDisk.writes += 1

    def sync_read(self, tensor) -> None:
        if tensor.untyped_storage().size() == 0:
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        tensor.copy_(self.disk[id(tensor)])

    def async_write(self, tensor, callback=None) -> None:
        self.sync_write(tensor)
        if callback is not None:
            callback()

    def async_read(self, tensor, callback=None) -> None:
        self.sync_read(tensor)
        if callback is not None:
            callback()

    def sync_read_events(self) -> None:
        pass

    def sync_write_events(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def memory_tensornvme() -> dict[str, object]:
    """Modules to put in `sys.modules` so Colossal-AI's NVMe optimizer offloads into `MemoryDisk`."""
    import types

    package, native = types.ModuleType("tensornvme"), types.ModuleType("tensornvme._C")
    package.DiskOffloader = MemoryDisk
    native.get_backends = lambda: {"aio"}
    package._C = native
    return {"tensornvme": package, "tensornvme._C": native}


if __name__ == "__main__":
    # `python tests/colossalai_cpu.py MAIN_ARGS` is main.py with these patches. Lightning's launcher
    # starts the other ranks by running this same command, so every process gets them.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    apply()
    from main import main

    sys.exit(main(sys.argv[1:]))
