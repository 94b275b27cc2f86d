"""tfmixprec 0.4.0 kept every module in one folder; since its modules moved into folders by
concern (issue 38), every public name and every import path of 0.4.0 still works: the public
API, the public modules (`from tfmixprec import cpu_float16`), and each old module path with
the names its `__all__` listed (`tfmixprec._moved`)."""

import importlib
import subprocess
import sys

import pytest

import tfmixprec

# 0.4.0's `tfmixprec.__all__` (commit 71c9978).
PUBLIC_040 = [
    "AuditReport",
    "CalibrationReport",
    "DoctorReport",
    "Finding",
    "Float8Change",
    "Float8LayerStats",
    "Float8Monitor",
    "Float8Quantized",
    "Float8Replay",
    "Float8TensorStats",
    "GPUInfo",
    "GradientRangeMonitor",
    "GradientRangeStats",
    "HardwareInfo",
    "KeptBatch",
    "LayerCalibration",
    "LayerDtypes",
    "LayerOverflows",
    "LayerReplay",
    "LossScaleConfig",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "MixedPrecisionFunctional",
    "MixedPrecisionMixin",
    "MixedPrecisionModel",
    "OverflowBatches",
    "OverflowDiagnosis",
    "OverflowGuard",
    "OverflowReport",
    "PolicyChange",
    "PolicyChoice",
    "PrecisionRepair",
    "Repair",
    "TensorBoard",
    "__version__",
    "audit",
    "calibrate",
    "choose_policy",
    "compute_unscaled_gradients",
    "cpu_bfloat16",
    "cpu_float16",
    "dashboard_layout",
    "datasets",
    "detect_hardware",
    "doctor",
    "explain_overflow",
    "float32_outputs",
    "float8",
    "float8_layers",
    "float8_stats",
    "gradient_range_stats",
    "guard_state",
    "make_train_step",
    "overflow_report",
    "policy_scope",
    "set_policy",
    "testing",
    "zoo",
]

# Each module of 0.4.0 and its `__all__` there.
MODULES_040 = {
    "_adoption": [],
    "_arrays": [],
    "_cadence": [],
    "_cpu_route": ["cpu_only", "route", "route_of", "unroute"],
    "_dtypes": [],
    "_fit_hooks": [],
    "_fit_reader": [],
    "_keras_compat": [
        "ARCHIVE_CONFIG",
        "ARCHIVE_WEIGHTS",
        "Functional",
        "KerasLossScaleHooks",
        "MultiWorkerFit",
        "REVERSIBLE_EMBEDDING",
        "STEP_COMPILES_ITSELF",
        "across_workers",
        "all_sublayers",
        "build_shapes",
        "built_variables",
        "call_losses",
        "compute_dtype_reverse_call",
        "float32_attention",
        "float32_convolution_call",
        "float32_product_call",
        "functional_init_arguments",
        "in_xla_context",
        "loss_tracker_count",
        "make_train_function",
        "no_automatic_dependency_tracking",
        "producing_layer",
        "producing_output_index",
        "replace_train_step",
        "reverse_called",
        "saved_optimizer_wrapped",
        "set_call_losses",
        "set_compiled_optimizer",
        "tensorboard_batch_work",
        "tensorboard_log_dir",
        "tensorboard_step",
        "tensorboard_writer",
        "traced_train_functions",
        "update_each_copy",
    ],
    "_layers": [],
    "_model_file": [],
    "_observe": [],
    "_state_file": [],
    "_text": [],
    "_validate": [],
    "accumulation": [],
    "attribution": ["LayerOverflows", "OverflowReport", "overflow_report"],
    "audit": ["AuditReport", "Finding", "LayerDtypes", "audit"],
    "bench": [],
    "calibration": ["CalibrationReport", "LayerCalibration", "calibrate"],
    "callbacks": ["LossScaleMonitor", "OverflowGuard"],
    "cli": [],
    "cpu_bfloat16": [
        "DEPTHWISE",
        "LOGITS",
        "ROUTES",
        "Route",
        "applies",
        "bfloat16_route_layers",
        "disable",
        "enable",
        "fast_bfloat16_layers",
        "routes_on",
        "served_layers",
        "status",
    ],
    "cpu_float16": [
        "applies",
        "disable",
        "enable",
        "fast_float16_layers",
        "float16_product_layers",
        "route_around_fused_matmul",
        "status",
    ],
    "datasets": ["load_digits"],
    "diagnosis": [
        "Float8Quantized",
        "Float8Replay",
        "KeptBatch",
        "LayerReplay",
        "OverflowBatches",
        "OverflowDiagnosis",
        "explain_overflow",
    ],
    "doctor": ["DoctorReport", "doctor"],
    "float8": [
        "Float8Change",
        "Float8LayerStats",
        "Float8Monitor",
        "Float8TensorStats",
        "float8_layers",
        "float8_stats",
        "quantization_counts",
    ],
    "gradient_range": ["GradientRangeMonitor", "GradientRangeStats", "gradient_range_stats"],
    "hardware": ["GPUInfo", "HardwareInfo", "detect_hardware"],
    "loss_scale": ["LossScaleConfig"],
    "optimizer": ["LossScaleOptimizer"],
    "overflow_batches": ["KeptBatch", "OverflowBatches"],
    "policy": [
        "PolicyChange",
        "PolicyChoice",
        "choose_policy",
        "float32_outputs",
        "policy_scope",
        "set_policy",
    ],
    "repair": ["PrecisionRepair", "Repair"],
    "state_guard": ["guard_state"],
    "tensorboard": ["TensorBoard", "dashboard_layout"],
    "testing": [
        "FaultInjector",
        "HostWait",
        "WorkerResult",
        "host_waits",
        "local_cluster",
        "run_workers",
    ],
    "training": [
        "MixedPrecisionFunctional",
        "MixedPrecisionMixin",
        "MixedPrecisionModel",
        "compute_unscaled_gradients",
        "make_train_step",
    ],
    "unscaling": [],
    "zoo": ["MODELS", "SIZES", "ZooModel", "build"],
}


def test_every_public_name_of_0_4_0_is_there():
    assert sorted(set(PUBLIC_040) - set(tfmixprec.__all__)) == []
    for name in PUBLIC_040:
        assert getattr(tfmixprec, name) is not None, name


@pytest.mark.parametrize("old", sorted(MODULES_040))
def test_every_module_path_of_0_4_0_imports_with_its_names(old):
    module = importlib.import_module(f"tfmixprec.{old}")
    missing = [name for name in MODULES_040[old] if not hasattr(module, name)]
    assert missing == [], (old, missing)


def test_an_old_path_is_the_module_that_holds_the_code_now():
    """One module object, not a copy: what a test or a user patches on it, the code sees."""
    from tfmixprec.fit import overflow_batches
    from tfmixprec.precision import cpu_float16
    from tfmixprec.scaling import loss_scale

    assert importlib.import_module("tfmixprec.loss_scale") is loss_scale
    assert importlib.import_module("tfmixprec.cpu_float16") is cpu_float16
    assert tfmixprec.cpu_float16 is cpu_float16
    assert tfmixprec.overflow_batches is overflow_batches
    audit_module = importlib.import_module("tfmixprec.checks.audit")
    assert tfmixprec.audit is audit_module.audit  # the function, as in 0.4.0


def test_old_paths_import_in_a_fresh_process():
    code = (
        "from tfmixprec.cpu_float16 import status\n"
        "from tfmixprec.loss_scale import LossScaleConfig\n"
        "from tfmixprec.float8 import Float8Monitor, float8_layers\n"
        "from tfmixprec.diagnosis import OverflowBatches, explain_overflow\n"
        "import tfmixprec.gradient_range as g\n"
        "from tfmixprec import cpu_float16, datasets, testing, zoo\n"
        "print(g.GradientRangeMonitor.__module__, LossScaleConfig.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["tfmixprec.fit.gradient_monitor", "tfmixprec.scaling.loss_scale"]


# The modules split by concern in issue 48 (each was over 700 lines), with their 0.4.0 path and
# every name each defined before the split: a split module re-exports what moved out of it.
SPLIT_48 = {
    "checks.audit": (
        "audit",
        ["ALIGNMENT", "AuditReport", "CHECKS", "Finding", "IMAGE_CHANNELS", "IMAGE_INPUT"]
        + ["LARGE_PRODUCT", "LayerDtypes", "PADDING_COST", "SEVERITIES", "audit"],
    ),
    "tools.bench": (
        "bench",
        ["BenchResult", "MODELS", "MODEL_POLICIES", "ModelSource", "Recommendation"]
        + ["SPREAD_NOTE", "StepLosses", "StepTimer", "build_model", "describe_machine"]
        + ["distinct_policies", "format_table", "load_function", "model_source"]
        + ["paired_ratios", "process_kept", "recommend", "run_bench", "run_model_bench"]
        + ["synthetic_inputs", "synthetic_targets", "time_fit"],
    ),
    "replay.calibration": (
        "calibration",
        ["CalibrationReport", "Float32Set", "HEADROOM", "KERAS_START", "LayerCalibration"]
        + ["MARGIN", "Replayer", "calibrate", "calibration_batches", "float32_policy"]
        + ["float32_set", "float32_swapped", "move_to_float32", "starting_scale"]
        + ["warn_not_recorded"],
    ),
    "replay.diagnosis": (
        "diagnosis",
        ["CAUSES", "Float8Quantized", "Float8Replay", "LayerReplay", "OverflowDiagnosis"]
        + ["UNDERFLOW_SHARE", "explain_overflow"],
    ),
}


@pytest.mark.parametrize("path", sorted(SPLIT_48))
def test_a_split_module_keeps_every_name_it_had(path):
    """`from tfmixprec.replay.calibration import Replayer` and `tfmixprec.calibration.MARGIN`
    still work after the split, and give the object the module that holds it now defines."""
    old, names = SPLIT_48[path]
    module = importlib.import_module(f"tfmixprec.{path}")
    assert [name for name in names if not hasattr(module, name)] == []
    old_module = importlib.import_module(f"tfmixprec.{old}")  # 0.4.0's path
    assert [name for name in names if getattr(old_module, name) is not getattr(module, name)] == []
    moved = {  # functions and classes under their own name (not 0.4.0's `Float8Quantized`)
        name: getattr(module, name).__module__
        for name in names
        if getattr(getattr(module, name), "__name__", None) == name
    }
    for name, where in moved.items():
        assert getattr(importlib.import_module(where), name) is getattr(module, name), name


def test_the_report_types_moved_out_of_the_split_modules():
    """Each split module's report types are defined in a module of their own, and the folder
    and the package give the same objects."""
    from tfmixprec.checks import audit_report
    from tfmixprec.replay import calibration_report, diagnosis_report

    audit = importlib.import_module("tfmixprec.checks.audit")  # the attribute is the function
    assert tfmixprec.Finding is audit.Finding is audit_report.Finding
    assert tfmixprec.CalibrationReport is calibration_report.CalibrationReport
    assert tfmixprec.calibration.CalibrationReport is calibration_report.CalibrationReport
    assert tfmixprec.OverflowDiagnosis is tfmixprec.diagnosis.OverflowDiagnosis
    assert tfmixprec.OverflowDiagnosis is diagnosis_report.OverflowDiagnosis
    assert tfmixprec.Float8Quantized is diagnosis_report.Float8Quantized
