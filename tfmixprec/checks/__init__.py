"""Checks of a model and a machine that change nothing: the audit (of a model or a saved
file, read without running its code) and the doctor.

What it offers, by module (each module's `__all__`).
"""

from tfmixprec.checks.audit import audit
from tfmixprec.checks.audit_report import AuditReport, Finding, LayerDtypes
from tfmixprec.checks.doctor import DoctorReport, doctor

__all__ = [
    "Finding",
    "LayerDtypes",
    "AuditReport",
    "audit",
    "DoctorReport",
    "doctor",
]
