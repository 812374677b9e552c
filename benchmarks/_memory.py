"""Peak memory of a measured region in a benchmark process (Linux /proc): the long-input benchmarks run each point
in its own process, read the RSS before the region, reset the peak to it, and report the peak during the region
minus that RSS."""

from __future__ import annotations

from pathlib import Path


def rss_kb(field: str) -> int:
    """A memory field of /proc/self/status in kB: "VmRSS" (now) or "VmHWM" (the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Reset the peak RSS (VmHWM) to the current RSS; where /proc/self/clear_refs is not writable the peak stays the
    process's whole-life peak (an upper bound)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
