"""SM clock, board power and temperature sampled beside a benchmark, so each timing can say what
state the card was in while it ran.

Why: an H200 running our forward at ~500 TFLOP/s reaches its ~700 W power limit within a second
and then drops its SM clock from 1980 MHz to 1450-1900 MHz
(benchmarks/results/clock_nvidia-h200_20261201.json, heat_curve; docs/performance.md).
A kernel timed for 25 ms right after an idle compile therefore reads up to ~10 % faster than the
same kernel timed after another kernel has heated the card. The samples make that visible in each
record instead of leaving it as unexplained noise between runs.

The sampler runs ``nvidia-smi --query-gpu ... -lms`` in a child process and timestamps each line
as it arrives; without nvidia-smi it is simply unavailable (records then carry no telemetry).
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time

QUERY = "index,uuid,clocks.sm,power.draw,temperature.gpu"


def _gpu_identity() -> str:
    """How nvidia-smi names the GPU torch calls cuda:0: its UUID (lower case, no 'GPU-') where torch
    exposes one, else the index CUDA_VISIBLE_DEVICES maps to it, else '0'. Every GPU is queried and
    the lines filtered, so a wrong guess yields no samples rather than a failed sampler."""
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
        if uuid is not None:
            return _bare_uuid(str(uuid))
    except Exception:
        pass
    return _bare_uuid(os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0]) or "0"


def _bare_uuid(text: str) -> str:
    text = text.strip().lower()
    return text[4:] if text.startswith(("gpu-", "mig-")) else text


def parse_sample(line: str, identity: str) -> tuple[float, float, float] | None:
    """(SM MHz, watts, deg C) from one ``--format=csv,noheader,nounits`` line of the GPU ``identity``
    names (an index or a bare UUID); None for other GPUs' lines and unreadable ones (nvidia-smi
    prints '[N/A]' or '[Not Supported]' for fields a board does not report)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5 or identity not in (parts[0], _bare_uuid(parts[1])):
        return None
    try:
        return float(parts[2]), float(parts[3]), float(parts[4])
    except ValueError:
        return None


def summarize(samples: list[tuple[float, float, float]]) -> dict:
    """The record fields for the samples taken during one timing (empty when there are none)."""
    if not samples:
        return {}
    clocks = [s[0] for s in samples]
    return {"sm_mhz": statistics.median(clocks), "sm_mhz_min": min(clocks),
            "power_w": statistics.median(s[1] for s in samples), "temp_c": max(s[2] for s in samples)}


class GpuTelemetry:
    """Context manager: ``with GpuTelemetry() as t: t0 = t.now(); ...; fields = t.window(t0, t.now())``."""

    def __init__(self, period_ms: int = 50, command: str | None = None):
        self.period_ms = period_ms
        self.command = command or shutil.which("nvidia-smi")
        self._samples: list[tuple[float, tuple[float, float, float]]] = []
        self._lock = threading.Lock()
        self._proc = None
        self._thread = None
        self._identity = "0"

    @property
    def available(self) -> bool:
        return self._proc is not None

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def __enter__(self):
        if self.command:
            argv = [self.command, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.period_ms)]
            self._identity = _gpu_identity()
            try:
                self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
        if self._proc is not None:
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            sample = parse_sample(line, self._identity)
            if sample is not None:
                with self._lock:
                    self._samples.append((time.monotonic(), sample))

    def window(self, start: float, end: float) -> dict:
        """Median SM clock and power, minimum clock and peak temperature sampled in [start, end]."""
        # nvidia-smi stamps a sample only when it prints it: wait one period so the last lands.
        if self.available:
            time.sleep(self.period_ms / 1000)
        with self._lock:
            inside = [s for t, s in self._samples if start <= t <= end + self.period_ms / 1000]
        return summarize(inside)

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
        return False
