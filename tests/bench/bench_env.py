"""The environment of a bench run, for pytest-benchmark's ``machine_info``."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess

from bench_naming import short_commit


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_smi(fields: str, executable: str = "nvidia-smi",
               index: str | None = None) -> list[str] | None:
    """The first GPU's (or GPU ``index``'s) answer to ``--query-gpu=fields``, split at the
    commas; ``None`` where the tool is missing or refuses (a field this driver lacks)."""
    if shutil.which(executable) is None:
        return None
    try:
        out = subprocess.run(
            [executable, *(["-i", index] if index is not None else []),
             f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line for line in out.splitlines() if line.strip()]
    return [part.strip() for part in lines[0].split(",")] if lines else None


def _cuda_version() -> str | None:
    """The CUDA runtime JAX was built against, as "13.0"."""
    try:
        from jax._src.lib import cuda_versions

        version = cuda_versions.cuda_runtime_get_version()
        return f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # noqa: BLE001 - optional, private API
        pass
    try:
        import jax

        text = jax.devices()[0].client.platform_version
        for token in text.split():
            if token.isdigit() and len(token) >= 4:
                version = int(token)
                return f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # noqa: BLE001
        pass
    return None


def environment_info() -> dict:
    """GPU, driver, memory, compute capability, versions and commit (contract keys)."""
    import jax
    import jaxlib

    device = jax.devices()[0]
    backend = jax.default_backend()
    smi = nvidia_smi("name,driver_version,memory.total") if backend == "gpu" else None
    memory_gb = None
    if smi and len(smi) >= 3:
        try:
            memory_gb = round(float(smi[2]) / 1024, 1)
        except ValueError:
            memory_gb = None
    capability = getattr(device, "compute_capability", None)
    return {
        "gpu": device.device_kind if backend == "gpu" else None,
        "gpu_driver": smi[1] if smi and len(smi) >= 2 else None,
        "gpu_memory_gb": memory_gb,
        "compute_capability": str(capability) if capability else None,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "cuda": _cuda_version() if backend == "gpu" else None,
        "jax_cuda_plugin": _version("jax-cuda13-plugin") or _version("jax-cuda12-plugin"),
        "triton": _version("triton"),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "tokamax": _version("tokamax"),
        "pykeops": _version("pykeops"),
        "numpy": _version("numpy"),
        "commit": short_commit(),
        "platform": backend,
        "device_count": jax.device_count(),
        # settings that change what collectives and compiled programs do (the ep suite's rows
        # depend on them); None where unset
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
        or None,
    }
