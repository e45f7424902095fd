"""Helpers shared by the per-format loaders."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class FormatError(ValueError):
    """A stored file does not have the shape its format promises; the message says where."""


def require(record: Mapping[str, Any], keys: Iterable[str], where: str) -> None:
    missing = [key for key in keys if key not in record]
    if missing:
        raise FormatError(f"{where}: missing field(s) {missing}")


def reject_unknown(record: Mapping[str, Any], known: set[str], where: str) -> None:
    """Fail on fields the loader does not map, so no stored value is dropped unnoticed."""
    unknown = sorted(set(record) - known)
    if unknown:
        raise FormatError(f"{where}: field(s) this loader does not know: {unknown}")


# An error message with one of these prefixes marks a case that was never attempted (the run's
# time budget, a predicted failure, a peer library that is not installed): skipped, not failed.
NOT_ATTEMPTED = ("skipped:", "unavailable:", "unsupported:")
# How ladder rows up to commit b0ccf0d worded a size predicted too slow to try (later ones say
# "skipped: not attempted, timeout predicted: ..."): also never attempted.
OLD_PREDICTED_TIMEOUT = "timeout (predicted, not attempted)"


def status_of(error: Any) -> str:
    """'measured' without an error message, 'skipped' when the message says the case was not
    attempted, else 'failed' (out of memory, timeout, compile error, ...)."""
    if error is None or (isinstance(error, float) and error != error) or error == "":
        return "measured"
    text = str(error).strip().lower()
    return "skipped" if text.startswith((*NOT_ATTEMPTED, OLD_PREDICTED_TIMEOUT)) else "failed"


def as_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise FormatError(f"{where}: expected an object, found {type(value).__name__}")
    return value


def as_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise FormatError(f"{where}: expected a list, found {type(value).__name__}")
    return value


GRADIENTS = ("dq", "dk", "dv", "dlengthscale")


def split_rel_err(value: Any, where: str) -> dict[str, Any]:
    """RBF ``rel_err``: a number (fwd) -> ``rel_err``; a dict (fwd_bwd) -> ``rel_err_dq`` ...."""
    if value is None:
        return {}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"rel_err": value}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(GRADIENTS))
        if unknown:
            raise FormatError(f"{where}: rel_err has unknown key(s) {unknown}")
        return {f"rel_err_{key}": value[key] for key in value}
    raise FormatError(f"{where}: rel_err is {type(value).__name__}, expected a number or dict")


def seed_environment(device: Mapping[str, Any]) -> dict[str, Any]:
    """The environment columns a seed file's ``device`` block records."""
    return {
        "device": device.get("gpu") or device.get("device_kind"),
        "gpu_memory_gb": device.get("gpu_memory_gb"),
        "gpu_driver": device.get("driver"),
        "compute_capability": device.get("cc"),
        "cuda": device.get("torch_cuda"),
        "jax": device.get("jax"),
        "torch": device.get("torch"),
        "python": device.get("python"),
    }
