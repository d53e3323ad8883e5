"""SSD (Saguaro): speculative speculative decoding, the drafting time hidden behind verification.

- `fan_out`: the cache's fan-out (Theorem 12), the critical batch size and the speedup equation (the math, no model);
- `speculation`: the speculation cache's predicted outcomes and lookup, and Saguaro sampling;
- `source`: `SSDConfig` and `SSDSource`, the block source that serves cached blocks, falls back to drafting in time,
  and runs the speculator's thread beside the target's verification.
"""

from .source import SSDConfig, SSDSource

__all__ = ["SSDConfig", "SSDSource"]
