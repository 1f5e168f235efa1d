"""What the running generation measures, one object shared by the generation loop and every
streamed block (they read it per call: a request can change it between replies)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Telemetry:
    mode: str = "step"  # options.TIMING_MODES: "layer" makes each block time its expert compute
