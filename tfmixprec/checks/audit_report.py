"""What `audit` returns: one finding (`Finding`), a layer's dtypes as audited (`LayerDtypes`) and
the report of both (`AuditReport`: its table, JSON and markdown).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tfmixprec._common.text import markdown_table
from tfmixprec.precision.policy import (
    LOW_PRECISION,
)

__all__ = ["Finding", "LayerDtypes", "AuditReport"]


SEVERITIES = ("error", "warning", "info")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem found by `audit`.

    Args:
        severity: String. `"error"`, `"warning"` or `"info"`.
        code: String. A short stable identifier, e.g. `"low-precision-output"`.
        layer: String or None. The layer's name (None for model-wide findings).
        message: String. What is wrong.
        fix: String. What to do about it.
    """

    severity: str
    code: str
    layer: str | None
    message: str
    fix: str


@dataclasses.dataclass(frozen=True)
class LayerDtypes:
    """A layer's compute and variable dtypes (as audited)."""

    layer: str
    class_name: str
    policy: str
    compute_dtype: str
    variable_dtype: str


@dataclasses.dataclass
class AuditReport:
    """The result of `audit(model)`: findings and per-layer dtypes.

    `str(report)` is a readable table; `to_dict()`, `to_json()` and `to_markdown()` convert it.
    """

    model: str
    policy: str
    findings: list[Finding]
    layers: list[LayerDtypes]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        """True when there is no error (warnings and info allowed)."""
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "policy": self.policy,
            "ok": self.ok,
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "layers": [dataclasses.asdict(layer) for layer in self.layers],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def _summary(self) -> str:
        counts = {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}
        return ", ".join(f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}" for s in SEVERITIES)

    def to_markdown(self) -> str:
        lines = [
            f"## Mixed-precision audit of `{self.model}` (policy `{self.policy}`)",
            "",
            self._summary(),
            "",
        ]
        if self.findings:
            rows = [(f.severity, f.layer or "-", f.message, f.fix) for f in self.findings]
            lines += markdown_table(("severity", "layer", "problem", "fix"), rows)
            lines.append("")
        rows = [(x.layer, x.class_name, x.compute_dtype, x.variable_dtype) for x in self.layers]
        lines += markdown_table(("layer", "class", "compute", "variables"), rows)
        return "\n".join(lines)

    def __str__(self) -> str:
        rows = [("layer", "class", "compute", "variables")] + [
            (lyr.layer, lyr.class_name, lyr.compute_dtype, lyr.variable_dtype)
            for lyr in self.layers
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [f"Mixed-precision audit of '{self.model}' (policy {self.policy})", ""]
        for index, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            if index == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        if self.findings:
            for f in self.findings:
                where = f" [{f.layer}]" if f.layer else ""
                lines.append(f"{f.severity.upper():7} {f.code}{where}: {f.message}")
                lines.append(f"        fix: {f.fix}")
        elif any(layer.compute_dtype in LOW_PRECISION for layer in self.layers):
            lines.append("No findings: the model is ready for mixed precision.")
        else:
            lines.append(f"No findings: the model computes in float32 (policy {self.policy}).")
        lines.append("")
        lines.append(f"Summary: {self._summary()}")
        return "\n".join(lines)
