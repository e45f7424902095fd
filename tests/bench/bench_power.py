"""The GPU's board power and SM clock while a row's timed rounds run (``nvidia-smi``).

A step that draws the GPU to its power limit runs at lower clocks than one that does not, so
two rows of one file can differ in clock as well as in work (docs/methodology.md, "Power-limited
steps"). :class:`PowerSampler` samples ``nvidia-smi`` every ``INTERVAL_MS`` in a subprocess
started before the row's warm call (the tool takes a few tenths of a second to start) and keeps
the samples whose timestamps fall inside the timed rounds; the row stores their medians:

- ``power_w``: board power, W (``power.draw.instant`` where the driver has it; else
  ``power.draw``, which Hopper averages over the last second), named in ``power_field``;
- ``sm_clock_mhz``: SM clock, MHz;
- ``power_limit_w``: the enforced power limit, W;
- ``power_samples``: how many samples the medians are of.

Nothing is stored where ``nvidia-smi`` is missing, the run is not on a GPU, or no sample fell
inside the rounds. The GPU sampled is the first of ``CUDA_VISIBLE_DEVICES`` (else index 0): the
device a single-GPU row runs on.
"""

from __future__ import annotations

import datetime
import functools
import os
import shutil
import statistics
import subprocess
import time
from typing import Any

import bench_env

INTERVAL_MS = 50
POWER_FIELDS = ("power.draw.instant", "power.draw")
TIMESTAMP_FORMAT = "%Y/%m/%d %H:%M:%S.%f"
_chosen_field: dict[str, str | None] = {}


@functools.cache
def on_gpu() -> bool:
    """Whether JAX runs on a GPU here (where rows sample the power)."""
    import jax

    return jax.default_backend() == "gpu"


def gpu_index() -> str:
    """``nvidia-smi -i`` of the device rows run on (an index or a UUID)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def power_field(executable: str = "nvidia-smi") -> str | None:
    """The first of ``POWER_FIELDS`` this driver answers with a number (asked once)."""
    if executable not in _chosen_field:
        _chosen_field[executable] = next(
            (field for field in POWER_FIELDS if _is_number(
                bench_env.nvidia_smi(field, executable, gpu_index()))), None)
    return _chosen_field[executable]


def _is_number(answer: list[str] | None) -> bool:
    try:
        float(answer[0])
    except (TypeError, IndexError, ValueError):
        return False
    return True


def parse_samples(lines: list[str], start: float, stop: float) -> list[tuple[float, ...]]:
    """``(power_w, sm_clock_mhz, power_limit_w)`` of the lines ``timestamp, power, clock,
    limit`` stamped within ``[start, stop]`` (seconds since the epoch, local time as
    ``nvidia-smi`` prints it); lines that do not parse are skipped."""
    samples = []
    for line in lines:
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            stamp = datetime.datetime.strptime(parts[0], TIMESTAMP_FORMAT).timestamp()
            values = tuple(float(part) for part in parts[1:])
        except ValueError:
            continue
        if start <= stamp <= stop:
            samples.append(values)
    return samples


def summarize(samples: list[tuple[float, ...]], field: str) -> dict[str, Any]:
    """The row's ``extra_info`` entries of its samples (none without samples)."""
    if not samples:
        return {}
    power, clock, limit = zip(*samples, strict=True)
    return {
        "power_w": statistics.median(power),
        "sm_clock_mhz": statistics.median(clock),
        "power_limit_w": statistics.median(limit),
        "power_samples": len(samples),
        "power_field": field,
    }


class PowerSampler:
    """``with PowerSampler() as power: ...; power.timed(); <rounds>; power.done()`` then
    ``power.summary()``: the medians of the samples between ``timed()`` and ``done()``."""

    def __init__(self, enabled: bool, executable: str = "nvidia-smi"):
        self.executable = shutil.which(executable) if enabled else None
        self.field = power_field(self.executable) if self.executable else None
        self.process: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.start = self.stop = None

    def __enter__(self) -> PowerSampler:
        if self.field is not None:
            self.process = subprocess.Popen(
                [self.executable, "-i", gpu_index(),
                 f"--query-gpu=timestamp,{self.field},clocks.sm,enforced.power.limit",
                 "--format=csv,noheader,nounits", "-lms", str(INTERVAL_MS)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
        return self

    def timed(self) -> None:
        self.start = time.time()

    def done(self) -> None:
        self.stop = time.time()

    def __exit__(self, *exc) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        self.lines = out.splitlines()

    def summary(self) -> dict[str, Any]:
        if self.field is None or self.start is None or self.stop is None:
            return {}
        return summarize(parse_samples(self.lines, self.start, self.stop), self.field)
